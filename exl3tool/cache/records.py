"""Provenance records: what went into the model and encoder identities of the entries a warm wrote or found.

A record is a small JSON file in ``<root>/exl3tool-records/<model_identity[:20]>/`` (the server only ever opens
``<root>/v1/...`` paths, so it never sees them). It holds both identity payloads exactly as hashed (so a later
``cache check`` can say *which* shard mtime, marker hash or encoder file changed), the settings (bits, dtype, TP
sizes, overlay), the exl3tool version, host and time, and the digests of the entries. Records are never needed to
use the cache, only to explain it.

One record per warm, named by a fingerprint of everything but when/where/how (identities, payloads, settings, the
entry set): a re-run that finds the same entries writes nothing new, so the record keeps the first warm's time;
concurrent warms on a shared cache write different files and never need a lock. Files are written atomically
(temp file, fsync, rename). Records read from a bundle are untrusted input: ``parse_record`` checks size, JSON depth,
schema, types, that each identity is the SHA-256 of its payload and that the file name is the one the content gives.
"""

from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import os
import re
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from exl3tool.version import __version__
from exl3tool.cache.entry import atomic_write
from exl3tool.cache.identity import model_payload_digest
from exl3tool.cache.key import HEX64, canonical_dumps
from exl3tool.cache.paths import entry_relpath, link_problem
from exl3tool.jsontext import loads_json

__all__ = [
    "RECORDS_DIR", "RECORD_FORMAT", "RECORD_VERSION", "RECORD_LIMIT", "RECORD_NAME_RE", "RecordEntry",
    "RecordSettings", "ProvenanceRecord", "StoredRecord", "parse_record", "record_bytes", "write_record",
    "read_records", "records_dir", "overlay_digest", "now_utc", "printable", "new_record", "ORIGINS",
    "entry_origin", "entry_file", "group_by_identity", "RecordPrune", "plan_record_prune", "execute_record_prune",
]

RECORDS_DIR = "exl3tool-records"
RECORD_FORMAT = "exl3tool-provenance"
RECORD_VERSION = 1
RECORD_LIMIT = 16 * 1024 * 1024  # bytes per record file (a 100,000-entry warm is about 12 MB)
PAYLOAD_LIMIT = 8 * 1024 * 1024  # an identity payload (a directory of ~50,000 shards)
ENTRY_LIMIT = 200_000
COMMANDS = ("cache warm", "encode", "cache import")
STATUSES = ("written", "found")
DTYPES = ("bfloat16", "float16", "float32", "float64")
# <model_identity[:20]>/<encoder_identity[:20]>-<fingerprint[:24]>.json, relative to RECORDS_DIR
RECORD_NAME_RE = re.compile(r"^([0-9a-f]{20})/([0-9a-f]{20})-([0-9a-f]{24})\.json$")
_TIME_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,6})?Z$")
_SHORT = 1024  # most strings: host, prefix, time, version


def now_utc() -> str:
    """The current UTC time as records store it (ISO 8601, milliseconds, ``Z``)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def printable(text: str) -> str:
    """``text`` with control characters escaped: record strings are shown to people and may be hostile."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def overlay_digest(overlay_json: Optional[dict]) -> Optional[str]:
    """SHA-256 of the resolved overlay (linear, shared_experts, ignore): equal overlays spelled differently agree."""
    if overlay_json is None:
        return None
    core = {k: overlay_json.get(k) for k in ("linear", "shared_experts", "ignore")}
    return hashlib.sha256(canonical_dumps(core).encode()).hexdigest()


@dataclass(frozen=True)
class RecordEntry:
    """One entry a warm wrote or found: its digest and the layer, TP size and rank of its key."""

    digest: str
    prefix: str
    tp_size: int
    tp_rank: int
    status: str  # written | found

    def as_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "prefix": self.prefix, "tp_size": self.tp_size, "tp_rank": self.tp_rank,
                "status": self.status}


@dataclass(frozen=True)
class RecordSettings:
    """The settings that went into the keys (bits, TP sizes, sizes through the overlay) and the encode (dtype)."""

    bits: int
    dtype: str  # the dtype weights were cast to (``--dtype auto`` resolved)
    tp_sizes: tuple[int, ...]
    quantization_config: Optional[str]  # the overlay string as given (None: the default overlay)
    overlay_digest: Optional[str]
    layers_planned: int
    server_lookup: bool

    def as_json(self) -> dict[str, Any]:
        return {"bits": self.bits, "dtype": self.dtype, "tp_sizes": list(self.tp_sizes),
                "quantization_config": self.quantization_config, "overlay_digest": self.overlay_digest,
                "layers_planned": self.layers_planned, "server_lookup": self.server_lookup}


@dataclass(frozen=True)
class ProvenanceRecord:
    """What went into one warm's (or encode's, or import's) entries; see the module docstring."""

    command: str
    tool_version: str
    host: str
    time: str
    model_name: str
    model_identity: str
    model_payload: str
    encoder_identity: str
    encoder_payload: str
    settings: RecordSettings
    entries: tuple[RecordEntry, ...]
    imported: Optional[dict[str, str]] = None  # {time, host, tool_version, bundle} when it came in a bundle
    # encoder parity of the warm that wrote the entries (operations.parity): {status, basis, detail,
    # encoder_identity, probe}; None when this command established none (nothing written, or an older record)
    encoder_parity: Optional[dict[str, Any]] = None

    def as_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "format": RECORD_FORMAT, "format_version": RECORD_VERSION, "command": self.command,
            "tool_version": self.tool_version, "host": self.host, "time": self.time,
            "model": {"name": self.model_name, "identity": self.model_identity, "payload": self.model_payload},
            "encoder": {"identity": self.encoder_identity, "payload": self.encoder_payload},
            "settings": self.settings.as_json(),
            "entries": [e.as_json() for e in sorted(self.entries, key=lambda e: e.digest)],
        }
        if self.imported is not None:
            doc["imported"] = dict(self.imported)
        if self.encoder_parity is not None:
            doc["encoder_parity"] = dict(self.encoder_parity)
        return doc

    def fingerprint(self) -> str:
        """SHA-256 of what the record says about the cache (not when, where or by which command)."""
        core = {"model_identity": self.model_identity, "model_payload": self.model_payload,
                "encoder_identity": self.encoder_identity, "encoder_payload": self.encoder_payload,
                "settings": self.settings.as_json(),
                "entries": sorted([e.digest, e.prefix, e.tp_size, e.tp_rank] for e in self.entries)}
        return hashlib.sha256(canonical_dumps(core).encode()).hexdigest()

    @property
    def relative_path(self) -> str:
        """Where the record lives under ``<root>/exl3tool-records`` (also its name in a bundle, under that folder)."""
        return f"{self.model_identity[:20]}/{self.encoder_identity[:20]}-{self.fingerprint()[:24]}.json"

    @property
    def model(self) -> dict[str, Any]:
        """The model payload as an object (it parsed when the record was made or read)."""
        return json.loads(self.model_payload)

    @property
    def encoder(self) -> dict[str, Any]:
        return json.loads(self.encoder_payload)

    @property
    def digests(self) -> frozenset[str]:
        return frozenset(e.digest for e in self.entries)


ORIGINS = ("record", "exl3tool", "server")


def entry_origin(has_checksum: bool, recorded: bool) -> str:
    """Who wrote an entry: ``server`` (no ``exl3tool_sha256``: the server writes none, even when a warm found and
    recorded it), ``record`` (exl3tool, with a provenance record) or ``exl3tool`` (no record: older, or lost)."""
    if not has_checksum:
        return "server"
    return "record" if recorded else "exl3tool"


def records_dir(root: str | Path) -> Path:
    """``<root>/exl3tool-records``: beside ``v1/``, never under it."""
    return Path(root) / RECORDS_DIR


def record_bytes(record: ProvenanceRecord) -> bytes:
    """The file's bytes: sorted keys, ASCII, one field per line (the same record always gives the same bytes)."""
    return (json.dumps(record.as_json(), sort_keys=True, indent=1, ensure_ascii=True) + "\n").encode("ascii")


def write_record(root: str | Path, record: ProvenanceRecord, *, file_mode: int = 0o600) -> tuple[Path, bool]:
    """Write ``record`` under ``root`` atomically; ``(path, written)``: False when the same record is already there.

    OSError propagates (the caller reports it; the entries stay valid without a record).
    """
    path = records_dir(root) / record.relative_path
    problem = link_problem(root, path)
    if problem:  # never write through a link below the root
        raise OSError(errno.ELOOP, problem)
    if path.is_file() and not path.is_symlink():
        try:
            there = parse_record(path.read_bytes())
            if there.fingerprint() == record.fingerprint() and record.encoder_parity in (None, there.encoder_parity):
                return path, False  # (a new parity verdict replaces the record: the claim it makes changed)
        except (OSError, ValueError):
            pass  # a broken or foreign file at our name: replace it
    data = record_bytes(record)
    atomic_write(path, lambda fh: fh.write(data), file_mode=file_mode)
    return path, True


@dataclass(frozen=True)
class StoredRecord:
    """A record file under a cache root: the record, or why it could not be read."""

    path: Path
    record: Optional[ProvenanceRecord]
    error: str = ""
    size: int = 0
    mtime: float = 0.0


def read_records(root: str | Path, *, model_prefix: Optional[str] = None) -> list[StoredRecord]:
    """Every record file under ``root`` (optionally of model directories starting with ``model_prefix``), sorted.

    Symlinks are never followed (listed as errors); a record whose content gives another name is an error too.
    """
    base = records_dir(root)
    out: list[StoredRecord] = []
    try:
        folders = sorted(os.listdir(base))
    except OSError:
        return out
    for folder in folders:
        if model_prefix is not None and not (folder.startswith(model_prefix[:20]) or model_prefix.startswith(folder)):
            continue
        d = base / folder
        if d.is_symlink() or not d.is_dir():
            continue
        for name in sorted(os.listdir(d)):
            if not name.endswith(".json"):
                continue
            path = d / name
            out.append(_read_one(path, f"{folder}/{name}"))
    return out


def _read_one(path: Path, rel: str) -> StoredRecord:
    try:
        st = os.lstat(path)
    except OSError as exc:
        return StoredRecord(path, None, f"unreadable ({exc.strerror})")
    if not stat.S_ISREG(st.st_mode):
        return StoredRecord(path, None, "not a regular file (never followed)", st.st_size, st.st_mtime)
    if st.st_size > RECORD_LIMIT:
        return StoredRecord(path, None, f"{st.st_size} bytes, over the {RECORD_LIMIT}-byte limit", st.st_size, st.st_mtime)
    try:
        record = parse_record(path.read_bytes())
    except (OSError, ValueError) as exc:
        return StoredRecord(path, None, str(exc), st.st_size, st.st_mtime)
    if record.relative_path != rel:
        return StoredRecord(path, None, f"its content names it {record.relative_path}", st.st_size, st.st_mtime)
    return StoredRecord(path, record, "", st.st_size, st.st_mtime)


# --- validation: a record is untrusted input (it may come in a bundle) --------------------------------------------


def _keys(obj: Any, where: str, required: set[str], optional: frozenset[str] = frozenset()) -> dict:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} is not an object")
    missing, extra = required - set(obj), set(obj) - required - optional
    if missing or extra:
        raise ValueError(f"{where}: members differ (missing {sorted(missing)}, extra {sorted(extra)[:5]})")
    return obj


def _str(value: Any, where: str, limit: int = _SHORT, *, empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} is not a string")
    if len(value) > limit:
        raise ValueError(f"{where} is longer than {limit} characters")
    if not empty and not value:
        raise ValueError(f"{where} is empty")
    if any(not c.isprintable() for c in value):
        raise ValueError(f"{where} holds control characters")
    return value


def _int(value: Any, where: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{where} is not an integer from {lo} to {hi}")
    return value


def _hex64(value: Any, where: str) -> str:
    if not isinstance(value, str) or not HEX64.fullmatch(value):
        raise ValueError(f"{where} is not 64 lower-case hex digits")
    return value


def _payload(obj: dict, where: str, kinds: tuple[str, ...]) -> tuple[str, str]:
    """(identity, payload) of a model/encoder object; the identity must be the SHA-256 of the payload string."""
    identity = _hex64(obj["identity"], f"{where}.identity")
    payload = obj["payload"]
    if not isinstance(payload, str) or len(payload) > PAYLOAD_LIMIT:
        raise ValueError(f"{where}.payload is not a string of at most {PAYLOAD_LIMIT} characters")
    if model_payload_digest(payload) != identity:
        raise ValueError(f"{where}.identity is not the SHA-256 of its payload")
    parsed = loads_json(payload)
    if not isinstance(parsed, dict):
        raise ValueError(f"{where}.payload is not a JSON object")
    if kinds and parsed.get("kind") not in kinds:
        raise ValueError(f"{where}.payload kind {str(parsed.get('kind'))[:40]!r} is not one of {', '.join(kinds)}")
    if not kinds and not (isinstance(parsed.get("root"), str) and ("revision" in parsed or "files" in parsed)):
        raise ValueError(f"{where}.payload is not an encoder payload (root and revision or files)")
    return identity, payload


def _settings(obj: Any) -> RecordSettings:
    s = _keys(obj, "settings", {"bits", "dtype", "tp_sizes", "quantization_config", "overlay_digest",
                                "layers_planned", "server_lookup"})
    if s["dtype"] not in DTYPES:
        raise ValueError(f"settings.dtype is not one of {', '.join(DTYPES)}")
    sizes = s["tp_sizes"]
    if not isinstance(sizes, list) or not 1 <= len(sizes) <= 64:
        raise ValueError("settings.tp_sizes is not a list of 1 to 64 TP sizes")
    qc = s["quantization_config"]
    if qc is not None:
        _str(qc, "settings.quantization_config", 1 << 20)
    od = s["overlay_digest"]
    if od is not None:
        _hex64(od, "settings.overlay_digest")
    if type(s["server_lookup"]) is not bool:
        raise ValueError("settings.server_lookup is not a boolean")
    return RecordSettings(
        bits=_int(s["bits"], "settings.bits", 3, 8), dtype=s["dtype"],
        tp_sizes=tuple(_int(t, "settings.tp_sizes[]", 1, 1 << 16) for t in sizes), quantization_config=qc,
        overlay_digest=od, layers_planned=_int(s["layers_planned"], "settings.layers_planned", 0, 1 << 24),
        server_lookup=s["server_lookup"])


def _entries(obj: Any) -> tuple[RecordEntry, ...]:
    if not isinstance(obj, list) or not 1 <= len(obj) <= ENTRY_LIMIT:
        raise ValueError(f"entries is not a list of 1 to {ENTRY_LIMIT} entries")
    out, seen = [], set()
    for n, e in enumerate(obj):
        where = f"entries[{n}]"
        _keys(e, where, {"digest", "prefix", "tp_size", "tp_rank", "status"})
        digest = _hex64(e["digest"], f"{where}.digest")
        if digest in seen:
            raise ValueError(f"{where}: digest listed twice")
        seen.add(digest)
        tp = _int(e["tp_size"], f"{where}.tp_size", 1, 1 << 16)
        if e["status"] not in STATUSES:
            raise ValueError(f"{where}.status is not one of {', '.join(STATUSES)}")
        out.append(RecordEntry(digest, _str(e["prefix"], f"{where}.prefix"), tp,
                               _int(e["tp_rank"], f"{where}.tp_rank", 0, tp - 1), e["status"]))
    return tuple(out)


def parse_record(data: bytes) -> ProvenanceRecord:
    """A record from a file's bytes, checked as untrusted input; ValueError naming the first problem."""
    if len(data) > RECORD_LIMIT:
        raise ValueError(f"record is {len(data)} bytes, over the {RECORD_LIMIT}-byte limit")
    try:
        doc = loads_json(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("record is not UTF-8") from None
    _keys(doc, "record", {"format", "format_version", "command", "tool_version", "host", "time", "model", "encoder",
                          "settings", "entries"}, frozenset({"imported", "encoder_parity"}))
    if doc["format"] != RECORD_FORMAT or doc["format_version"] != RECORD_VERSION:
        raise ValueError(f"not an {RECORD_FORMAT} record of version {RECORD_VERSION}")
    if doc["command"] not in COMMANDS:
        raise ValueError(f"command is not one of {', '.join(COMMANDS)}")
    time = _str(doc["time"], "time")
    if not _TIME_RE.match(time):
        raise ValueError("time is not an ISO 8601 UTC time")
    model = _keys(doc["model"], "model", {"name", "identity", "payload"})
    mid, mpayload = _payload(model, "model", ("hub", "file", "directory"))
    encoder = _keys(doc["encoder"], "encoder", {"identity", "payload"})
    eid, epayload = _payload(encoder, "encoder", ())
    imported = doc.get("imported")
    if imported is not None:
        _keys(imported, "imported", {"time", "host", "tool_version", "bundle"})
        imported = {k: _str(imported[k], f"imported.{k}", 4096) for k in ("time", "host", "tool_version", "bundle")}
    parity = doc.get("encoder_parity")
    if parity is not None:
        parity = _parity(parity, eid)
    return ProvenanceRecord(
        command=doc["command"], tool_version=_str(doc["tool_version"], "tool_version"), host=_str(doc["host"], "host"),
        time=time, model_name=_str(model["name"], "model.name", 4096), model_identity=mid, model_payload=mpayload,
        encoder_identity=eid, encoder_payload=epayload, settings=_settings(doc["settings"]),
        entries=_entries(doc["entries"]), imported=imported, encoder_parity=parity)


PARITY_STATUSES = ("identical", "differs", "unverified")  # operations.parity's verdicts
PARITY_BASES = ("construction", "probe", "none")


def _parity(obj: Any, encoder_identity: str) -> dict[str, Any]:
    """The ``encoder_parity`` member: status, basis and detail checked; the probe's digests kept as an object."""
    p = _keys(obj, "encoder_parity", {"status", "basis", "detail", "encoder_identity", "probe"})
    if p["status"] not in PARITY_STATUSES:
        raise ValueError(f"encoder_parity.status is not one of {', '.join(PARITY_STATUSES)}")
    if p["basis"] not in PARITY_BASES:
        raise ValueError(f"encoder_parity.basis is not one of {', '.join(PARITY_BASES)}")
    if _hex64(p["encoder_identity"], "encoder_parity.encoder_identity") != encoder_identity:
        raise ValueError("encoder_parity.encoder_identity is not the record's encoder identity")
    if p["probe"] is not None and not isinstance(p["probe"], dict):
        raise ValueError("encoder_parity.probe is not an object")
    return {"status": p["status"], "basis": p["basis"], "detail": _str(p["detail"], "encoder_parity.detail", 4096),
            "encoder_identity": p["encoder_identity"], "probe": p["probe"]}


def new_record(*, command: str, model_name: str, model_identity: str, model_payload: str, encoder_identity: str,
               encoder_payload: str, settings: RecordSettings, entries: list[RecordEntry],
               encoder_parity: Optional[dict[str, Any]] = None) -> ProvenanceRecord:
    """A record made here and now (tool version, host, UTC time filled in)."""
    return ProvenanceRecord(command=command, tool_version=__version__, host=printable(socket.gethostname()) or "?",
                            time=now_utc(), model_name=printable(model_name), model_identity=model_identity,
                            model_payload=model_payload, encoder_identity=encoder_identity,
                            encoder_payload=encoder_payload, settings=settings, entries=tuple(entries),
                            encoder_parity=encoder_parity)



# --- what `cache ls` and `cache prune` do with records -------------------------------------------------------------


def entry_file(root: str | Path, record: ProvenanceRecord, entry: RecordEntry) -> Path:
    """The entry file a record's entry names (its key's path: the record's model identity, TP size and rank)."""
    return Path(root) / entry_relpath(record.model_identity, entry.tp_size, entry.tp_rank, entry.digest)


def group_by_identity(root: str | Path, infos: list, records: list[StoredRecord]) -> list[dict[str, Any]]:
    """Entries (``scan`` infos) grouped by (model identity, encoder identity), each group with who wrote its
    entries (``origins``: a recorded warm, exl3tool without a record, the server) and the records that explain it."""
    recorded: dict[str, StoredRecord] = {}
    for sr in records:
        if sr.record is not None:
            for d in sr.record.digests:
                recorded[d] = sr
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for info in infos:
        if info.kind != "entry" or info.key is None:
            continue
        k = info.key
        g = groups.setdefault((k.model_identity, k.encoder_identity), {
            "model_identity": k.model_identity, "encoder_identity": k.encoder_identity, "entries": 0, "bytes": 0,
            "tp_sizes": set(), "bits": set(), "origins": {o: 0 for o in ORIGINS}, "records": {}})
        sr = recorded.get(info.digest or "")
        if sr is not None and sr.record.model_identity != k.model_identity:
            sr = None
        g["origins"][entry_origin("exl3tool_sha256" in info.metadata, sr is not None)] += 1
        g["entries"] += 1
        g["bytes"] += info.size
        g["tp_sizes"].add(k.tp_world_size)
        g["bits"].add(k.bits)
        if sr is not None:
            g["records"][str(sr.path)] = sr
    out = []
    for g in sorted(groups.values(), key=lambda g: (g["model_identity"], g["encoder_identity"])):
        rows = []
        for sr in sorted(g["records"].values(), key=lambda sr: sr.record.time):
            r = sr.record
            rows.append({"path": str(sr.path), "command": r.command, "host": r.host, "time": r.time,
                         "tool_version": r.tool_version, "model": r.model_name, "bits": r.settings.bits,
                         "dtype": r.settings.dtype, "tp_sizes": list(r.settings.tp_sizes),
                         "entries": len(r.entries), "imported": r.imported})
        out.append({**g, "tp_sizes": sorted(g["tp_sizes"]), "bits": sorted(g["bits"]), "records": rows})
    return out


@dataclass(frozen=True)
class RecordPrune:
    """Record files a prune removes (every entry they name is gone, or is being removed), and unreadable ones."""

    items: tuple[tuple[StoredRecord, str], ...]


def plan_record_prune(root: str | Path, records: list[StoredRecord], *, removing: set[Path] = frozenset(),
                      invalid: bool = False) -> RecordPrune:
    """Records whose entries are all gone once ``removing`` (entry paths a prune deletes) is gone; with
    ``invalid`` also record files that cannot be read as records."""
    items = []
    for sr in records:
        if sr.record is None:
            if invalid:
                items.append((sr, f"invalid record: {sr.error}"))
            continue
        alive = [e for e in sr.record.entries
                 if (p := entry_file(root, sr.record, e)) not in removing and (p.is_file() or p.is_symlink())]
        if not alive:
            items.append((sr, "every entry it records is gone"))
    return RecordPrune(tuple(items))


def execute_record_prune(root: str | Path, plan: RecordPrune) -> tuple[int, list[str], list[str]]:
    """Remove the planned records, re-checking each first: ``(removed, errors, kept)``; a record one of whose
    entries is back (a warm published it meanwhile) stays."""
    removed, errors, kept = 0, [], []
    for sr, _ in plan.items:
        if sr.record is not None and any(entry_file(root, sr.record, e).is_file() for e in sr.record.entries):
            kept.append(f"{sr.path}: an entry it records exists again; left in place")
            continue
        try:
            sr.path.unlink(missing_ok=True)
            removed += 1
        except OSError as exc:
            errors.append(f"{sr.path}: {exc.strerror or exc}")
    return removed, errors, kept
