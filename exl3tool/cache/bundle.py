"""Cache bundles: a cache's valid entries in one file, to warm where the GPUs are and serve where the servers are.

A bundle (format version 1) is an uncompressed POSIX ustar archive. Its first member is ``manifest.json``; then one
member per entry at its path under the cache root (``v1/<id20>/tp<W>-rank<R>/<digest>.safetensors``), sorted by
path. Every header has the same fixed fields (mode 0644, uid/gid 0, no owner names, mtime 0), so the same entries
always give the same bytes, whatever their files' times and owners.

Importing treats a bundle as untrusted, because the cache holds what the server runs as weights: members are
matched by name against the manifest and never extracted by their own path; links, devices, extended headers,
unknown, duplicate or oversize members are refused; each entry must match the manifest's size and SHA-256 and pass
the one entry rule (``judge_entry``: the server's checks and exl3tool's checksums) in its temp file before ``CacheStore.import_entry`` renames it into place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import struct
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

from exl3tool.version import __version__
from exl3tool.cache.entry import EntryContents, judge_entry
from exl3tool.cache.key import HEX64, CacheKey
from exl3tool.cache.paths import entry_path, entry_relpath
from exl3tool.cache.records import (
    RECORD_LIMIT, RECORD_NAME_RE, RECORDS_DIR, ProvenanceRecord, parse_record, printable, read_records, record_bytes,
    write_record,
)
from exl3tool.cache.scan import EntryInfo, matches_model, scan
from exl3tool.cache.store import PRUNE_HINT, CacheStore
from exl3tool.errors import InputError, describe
from exl3tool.jsontext import loads_json

__all__ = [
    "write_bundle_file",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "BundleEntry",
    "BundleRecord",
    "ExportPlan",
    "ImportItem",
    "ImportReport",
    "BundleError",
    "plan_export",
    "write_bundle",
    "import_bundle",
    "manifest_bytes",
]

FORMAT = "exl3tool-cache-bundle"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MANIFEST_LIMIT = 64 * 1024 * 1024  # about 100,000 entries
HEADER_LIMIT = 1024 * 1024  # an entry's safetensors header (ours and the server's are about 1 KB)
_BLOCK = 512
_RECORD = 20 * _BLOCK  # archives end on a whole record, as tar writes them
_CHUNK = 1 << 20
_EXTENDED = {tarfile.XHDTYPE: "a pax extended header", tarfile.XGLTYPE: "a pax global header",
             tarfile.GNUTYPE_LONGNAME: "a GNU long-name header", tarfile.GNUTYPE_LONGLINK: "a GNU long-link header"}
_KINDS = {tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link", tarfile.CHRTYPE: "a character device",
          tarfile.BLKTYPE: "a block device", tarfile.FIFOTYPE: "a FIFO", tarfile.DIRTYPE: "a directory",
          tarfile.CONTTYPE: "a contiguous file"}


class BundleError(InputError):
    """The bundle cannot be read as one (not a tar, no manifest first, a broken header, cut short): exit 2."""


@dataclass(frozen=True)
class BundleEntry:
    """One manifest record: where the entry goes, its key (canonical JSON), size and SHA-256 of its bytes."""

    path: str
    digest: str
    key: str
    size: int
    sha256: str

    def as_json(self) -> dict:
        return {"path": self.path, "digest": self.digest, "key": self.key, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class BundleRecord:
    """A provenance record a bundle carries (member ``exl3tool-records/...``): its bytes, held in memory (small)."""

    path: str
    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def as_json(self) -> dict:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes (valid entries, sorted by path) and what it leaves out, with why."""

    root: Path
    entries: tuple[BundleEntry, ...]
    left_out: tuple[tuple[str, str], ...]  # (path under the root, reason)
    records: tuple[BundleRecord, ...] = ()  # the provenance of the entries, trimmed to them, sorted by path

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def as_json(self, bundle: str, bundle_bytes: int) -> dict:
        """The `cache export --json` document, once written to ``bundle`` (``bundle_bytes`` long; docs/cache.md)."""
        return {
            "bundle": bundle, "root": str(self.root), "entries": len(self.entries), "bytes": self.bytes,
            "bundle_bytes": bundle_bytes, "records": [r.path for r in self.records],
            "exported": [{"path": e.path, "digest": e.digest, "size": e.size, "sha256": e.sha256}
                         for e in self.entries],
            "left_out": [{"path": p, "reason": why} for p, why in self.left_out],
        }


@dataclass(frozen=True)
class ImportItem:
    """One entry or member of an import: ``status`` imported|replaced|present|refused, with the reason."""

    path: str
    status: str
    reason: str = ""
    size: int = 0
    kind: str = "entry"  # entry | record (a provenance record the bundle carries)


@dataclass(frozen=True)
class ImportReport:
    """Everything an import did, in bundle order; ``refused`` items leave the cache untouched."""

    root: Path
    tool_version: str
    items: tuple[ImportItem, ...]

    def count(self, status: str, kind: str = "entry") -> int:
        return sum(1 for i in self.items if i.status == status and i.kind == kind)

    @property
    def bytes_written(self) -> int:
        return sum(i.size for i in self.items if i.status in ("imported", "replaced") and i.kind == "entry")

    @property
    def ok(self) -> bool:
        return self.count("refused") == 0

    @property
    def refused(self) -> list[ImportItem]:
        """Every refused member, entries and records (nothing of them was written)."""
        return [i for i in self.items if i.status == "refused"]

    def as_json(self, bundle: str, against: dict | None = None) -> dict:
        """The `cache import --json` document for ``bundle`` as given (docs/cache.md); ``against``: the model and
        mode entries were checked against (``{"model": ..., "exact": ...}``), None without ``--against``."""
        return {
            "bundle": bundle, "root": str(self.root), "tool_version": self.tool_version, "against": against,
            "imported": self.count("imported"), "replaced": self.count("replaced"),
            "present": self.count("present"), "refused": len(self.refused), "bytes_written": self.bytes_written,
            "entries": [{"path": i.path, "status": i.status, "reason": i.reason, "size": i.size}
                        for i in self.items if i.kind == "entry"],
            "records": [{"path": i.path, "status": i.status, "reason": i.reason}
                        for i in self.items if i.kind == "record"],
        }


def _relative(key: CacheKey) -> str:
    return entry_path(key, "").as_posix()


def _file_sha256(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while block := fh.read(_CHUNK):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def plan_export(root: str | Path, *, model: str | None = None, tp_sizes: tuple[int, ...] | None = None) -> ExportPlan:
    """Load every entry under ``root`` as the server would (``scan``) and hash the valid ones; nothing is written.

    ``model`` (a model identity or hex prefix) and ``tp_sizes`` select entries; invalid selected entries are
    left out with their reason.
    """
    root = Path(root)
    chosen: list[BundleEntry] = []
    left_out: list[tuple[str, str]] = []
    infos: list[EntryInfo] = [i for i in scan(root, deep=True) if i.kind == "entry" and matches_model(i, model)]
    for info in infos:
        if tp_sizes is not None and info.tp_world_size not in tp_sizes:
            continue
        rel = info.path.relative_to(root).as_posix()
        if info.status == "invalid" or info.key is None:
            left_out.append((rel, info.reason or "invalid"))
            continue
        try:
            size, sha = _file_sha256(info.path)
        except OSError as exc:
            left_out.append((rel, f"unreadable ({describe(exc)})"))
            continue
        chosen.append(BundleEntry(rel, info.key.digest(), info.key.canonical_json(), size, sha))
    chosen.sort(key=lambda e: e.path)
    left_out.sort()
    return ExportPlan(root, tuple(chosen), tuple(left_out), _export_records(root, chosen))


def _export_records(root: Path, chosen: list[BundleEntry]) -> tuple[BundleRecord, ...]:
    """The records naming exported entries, each trimmed to those entries (so every digest it carries is in the
    bundle, as an import requires); unreadable records are left out."""
    exported = {e.digest for e in chosen}
    out: dict[str, BundleRecord] = {}
    for sr in read_records(root):
        r = sr.record
        if r is None:
            continue
        keep = tuple(e for e in r.entries if e.digest in exported)
        if not keep:
            continue
        trimmed = replace(r, entries=keep)
        path = f"{RECORDS_DIR}/{trimmed.relative_path}"
        out[path] = BundleRecord(path, record_bytes(trimmed))
    return tuple(out[p] for p in sorted(out))


def manifest_bytes(entries: tuple[BundleEntry, ...], records: tuple[BundleRecord, ...] = ()) -> bytes:
    """The manifest member's bytes: sorted keys, one entry per line, the tool version (deterministic)."""
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "tool_version": __version__,
           "entries": [e.as_json() for e in entries]}
    if records:  # optional: a bundle without records is byte for byte what earlier versions wrote
        doc["records"] = [r.as_json() for r in records]
    return (json.dumps(doc, sort_keys=True, indent=1, ensure_ascii=True) + "\n").encode("ascii")


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = size, 0, 0o644, 0, 0, "", ""
    info.type = tarfile.REGTYPE
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


def write_bundle_file(plan: ExportPlan, path: str | Path) -> int:
    """Write ``plan``'s bundle to the file ``path`` atomically; returns its size.

    A temp file in the same folder is written, fsynced and renamed over ``path`` (mode 0644), so a failed export
    never leaves a partial bundle there. InputError naming ``path`` if its folder is missing or not writable.
    """
    target = Path(path)
    folder = target.parent
    if not folder.is_dir():
        raise InputError(f"cannot write the bundle {target}: its folder {folder} does not exist")
    if target.is_dir():
        raise InputError(f"cannot write the bundle {target}: it is a directory; name a file")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise InputError(f"cannot write the bundle {target}: {describe(exc)}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            size = write_bundle(plan, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except OSError as exc:
        raise InputError(f"cannot write the bundle {target}: {describe(exc)}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return size


def write_bundle(plan: ExportPlan, out: BinaryIO) -> int:
    """Write ``plan``'s bundle to ``out`` (a file or a pipe, written in order); returns the bytes written.

    Each entry is re-hashed while it is copied: InputError if a file changed since ``plan_export`` (re-run the
    export; the bundle written so far is incomplete).
    """
    written = 0

    def put(data: bytes | memoryview) -> None:
        nonlocal written
        out.write(data)
        written += len(data)

    def pad() -> None:
        if written % _BLOCK:
            put(b"\0" * (_BLOCK - written % _BLOCK))

    manifest = manifest_bytes(plan.entries, plan.records)
    put(_header(MANIFEST_NAME, len(manifest)))
    put(manifest)
    pad()
    for entry in plan.entries:
        put(_header(entry.path, entry.size))
        h = hashlib.sha256()
        left = entry.size
        with open(plan.root / entry.path, "rb") as fh:
            while left:
                block = fh.read(min(_CHUNK, left))
                if not block:
                    break
                h.update(block)
                put(block)
                left -= len(block)
            extra = fh.read(1)
        if left or extra or h.hexdigest() != entry.sha256:
            raise InputError(f"{plan.root / entry.path}: changed while it was being exported (a warm or prune running?); "
                             "the bundle is incomplete, export again")
        pad()
    for record in plan.records:  # after the entries they describe
        put(_header(record.path, record.size))
        put(record.data)
        pad()
    put(b"\0" * (2 * _BLOCK))
    if written % _RECORD:
        put(b"\0" * (_RECORD - written % _RECORD))
    out.flush()
    return written


class _Reader:
    """Exact reads from a stream (a pipe may return less than asked)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.offset = 0

    def read(self, n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            block = self.stream.read(min(n - got, _CHUNK))
            if not block:
                break
            parts.append(block)
            got += len(block)
        self.offset += got
        return b"".join(parts)

    def exactly(self, n: int, what: str) -> bytes:
        data = self.read(n)
        if len(data) != n:
            raise BundleError(f"the bundle ends in the middle of {what} (cut short at byte {self.offset})")
        return data


class _Member:
    """One archive member as its header describes it; ``read`` hands out at most ``size`` bytes of its data."""

    def __init__(self, info: tarfile.TarInfo, reader: _Reader) -> None:
        self.name, self.type, self.size, self.linkname = info.name, info.type, info.size, info.linkname
        self._reader = reader
        self.left = info.size

    def read(self, n: int) -> bytes:
        data = self._reader.exactly(min(n, self.left), f"member {self.name!r}")
        self.left -= len(data)
        return data

    def skip(self) -> None:
        while self.left:
            self.read(_CHUNK)
        self._reader.exactly(-self.size % _BLOCK, f"member {self.name!r}'s padding")


def _members(reader: _Reader) -> Iterator[_Member]:
    """Members in order; each one's unread data is skipped when the next is asked for. Ends at a zero block."""
    while True:
        block = reader.read(_BLOCK)
        if not block or block == b"\0" * _BLOCK:
            return
        if len(block) != _BLOCK:
            raise BundleError(f"the bundle ends in the middle of a tar header (cut short at byte {reader.offset})")
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            raise BundleError(f"not a readable tar header at byte {reader.offset - _BLOCK} ({exc})") from None
        member = _Member(info, reader)
        yield member
        member.skip()


def _manifest_entries(doc: object) -> tuple[dict[str, tuple[BundleEntry, CacheKey]], list[ImportItem]]:
    """The manifest's usable entries by path, and a refusal for each record that is not one."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BundleError(f"{MANIFEST_NAME} is not an exl3tool cache bundle manifest")
    if doc.get("format_version") != FORMAT_VERSION:
        raise BundleError(f"bundle format version {doc.get('format_version')!r} is not {FORMAT_VERSION}; "
                          "use the exl3tool version that wrote it, or export again")
    records = doc.get("entries")
    if not isinstance(records, list):
        raise BundleError(f"{MANIFEST_NAME} has no entries list")
    usable: dict[str, tuple[BundleEntry, CacheKey]] = {}
    refused: list[ImportItem] = []
    seen: set[str] = set()
    for n, rec in enumerate(records):
        where = rec.get("path") if isinstance(rec, dict) and isinstance(rec.get("path"), str) else f"manifest entry {n}"
        try:
            entry, key = _check_record(rec)
        except ValueError as exc:
            refused.append(ImportItem(where, "refused", f"manifest: {exc}"))
            seen.add(where)
            continue
        if entry.path in seen:
            refused.append(ImportItem(entry.path, "refused", "manifest: listed twice"))
            usable.pop(entry.path, None)
            continue
        seen.add(entry.path)
        usable[entry.path] = (entry, key)
    return usable, refused


def _manifest_records(doc: dict) -> tuple[dict[str, tuple[int, str]], list[ImportItem]]:
    """The manifest's provenance records by member path (size, sha256), and a refusal for each that is not one."""
    records = doc.get("records", [])
    if not isinstance(records, list):
        raise BundleError(f"{MANIFEST_NAME}: records is not a list")
    usable: dict[str, tuple[int, str]] = {}
    refused: list[ImportItem] = []
    for n, rec in enumerate(records):
        path = rec.get("path") if isinstance(rec, dict) else None
        where = path if isinstance(path, str) else f"manifest record {n}"
        why = None
        if not isinstance(rec, dict) or set(rec) != {"path", "size", "sha256"}:
            why = "not a record of path, size and sha256"
        elif not isinstance(path, str) or not path.startswith(RECORDS_DIR + "/") or not RECORD_NAME_RE.fullmatch(
                path[len(RECORDS_DIR) + 1:]):
            why = f"path is not {RECORDS_DIR}/<model20>/<encoder20>-<fingerprint24>.json"
        elif type(rec["size"]) is not int or not 0 < rec["size"] <= RECORD_LIMIT:
            why = f"size is not from 1 to {RECORD_LIMIT} bytes"
        elif not isinstance(rec["sha256"], str) or not HEX64.fullmatch(rec["sha256"]):
            why = "sha256 is not 64 hex digits"
        elif path in usable:
            why = "listed twice"
            usable.pop(path)
        if why is not None:
            refused.append(ImportItem(where, "refused", f"manifest: {why}", kind="record"))
            continue
        usable[path] = (rec["size"], rec["sha256"])
    return usable, refused


def _record_problem(record: ProvenanceRecord, wanted: dict[str, tuple[BundleEntry, CacheKey]]) -> str | None:
    """Why a bundle's record does not describe the bundle's entries, or None: every digest must be an entry of the
    manifest whose key carries the record's identities, bits, layer, TP size and rank."""
    for e in record.entries:
        rel = entry_relpath(record.model_identity, e.tp_size, e.tp_rank, e.digest)
        found = wanted.get(rel)
        if found is None:
            return f"entry {e.digest[:16]} ({printable(e.prefix)}) is not in the bundle's manifest"
        key = found[1]
        if (key.model_identity, key.encoder_identity, key.bits, key.prefix) != (
                record.model_identity, record.encoder_identity, record.settings.bits, e.prefix):
            return f"entry {e.digest[:16]}'s key does not carry the record's identities, bits and layer"
    return None


def _import_record(name: str, data: bytes, size_sha: tuple[int, str], wanted: dict[str, tuple[BundleEntry, CacheKey]],
                   kept: set[str], store: CacheStore, source: str) -> ImportItem:
    """Check one provenance record member (``name``, its bytes) as untrusted input and write it (atomically) into
    the store's root, when at least one of its entries is in the cache now (``kept``: imported or present)."""
    if hashlib.sha256(data).hexdigest() != size_sha[1]:
        return ImportItem(name, "refused", "its bytes differ from the manifest's sha256", kind="record")
    try:
        record = parse_record(data)
    except ValueError as exc:
        return ImportItem(name, "refused", f"not a valid provenance record: {printable(str(exc))}", kind="record")
    if f"{RECORDS_DIR}/{record.relative_path}" != name:
        return ImportItem(name, "refused", f"its content names it {RECORDS_DIR}/{record.relative_path}",
                          kind="record")
    problem = _record_problem(record, wanted)
    if problem:
        return ImportItem(name, "refused", problem, kind="record")
    if not any(f"v1/{record.model_identity[:20]}/tp{e.tp_size}-rank{e.tp_rank}/{e.digest}.safetensors" in kept
               for e in record.entries):
        return ImportItem(name, "refused", "none of its entries was imported (nothing for it to describe)",
                          kind="record")
    from exl3tool.cache.records import new_record

    here = new_record(command="cache import", model_name="", model_identity=record.model_identity,
                      model_payload=record.model_payload, encoder_identity=record.encoder_identity,
                      encoder_payload=record.encoder_payload, settings=record.settings, entries=list(record.entries))
    record = replace(record, imported={"time": here.time, "host": here.host, "tool_version": here.tool_version,
                                       "bundle": printable(source)[:4096] or "-"})
    try:
        _, written = write_record(store.root, record, file_mode=store.file_mode)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        return ImportItem(name, "refused", f"the cache cannot take it: {exc.strerror}", kind="record")
    return ImportItem(name, "imported" if written else "present",
                      "" if written else "the same record is already there (kept)", len(data), kind="record")


def _check_record(rec: object) -> tuple[BundleEntry, CacheKey]:
    if not isinstance(rec, dict) or set(rec) != {"path", "digest", "key", "size", "sha256"}:
        raise ValueError("not a record of path, digest, key, size and sha256")
    path, digest, key_json, size, sha = rec["path"], rec["digest"], rec["key"], rec["size"], rec["sha256"]
    if not all(isinstance(v, str) for v in (path, digest, key_json, sha)) or type(size) is not int:
        raise ValueError("wrong field types")
    try:
        key = CacheKey.from_json(key_json)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"key is not a cache key ({exc})") from None
    if key.canonical_json() != key_json:
        raise ValueError("key is not in canonical form; the server never matches it")
    unproducible = key.unproducible_reason()
    if unproducible:
        raise ValueError(f"the server never builds this key: {unproducible}")
    if key.digest() != digest:
        raise ValueError("digest is not the SHA-256 of the key")
    if path != _relative(key):
        raise ValueError(f"path does not match its key (the key's entry is {_relative(key)})")
    if not HEX64.fullmatch(sha):
        raise ValueError("sha256 is not 64 hex digits")
    data = 2 * (key.input_size // 16) * (key.output_size // 16) * 16 * key.bits + 2 * key.input_size + 2 * key.output_size
    if not 8 < size <= 8 + HEADER_LIMIT + data:
        raise ValueError(f"size {size} is impossible for its key (at most {8 + HEADER_LIMIT + data} bytes)")
    return BundleEntry(path, digest, key_json, size, sha), key


def _refuse_member(member: _Member, extended: str | None) -> str | None:
    """Why ``member`` is refused before the manifest is consulted (type and name), or None."""
    if member.type in _EXTENDED:
        return f"{_EXTENDED[member.type]} (exl3tool bundles have none; it would rename the next member)"
    if extended:
        return f"follows {extended}, so its real name is unknown"
    if member.type in _KINDS:
        target = f" to {member.linkname}" if member.type in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
        return f"{_KINDS[member.type]}{target}; a bundle holds regular files only"
    if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        return f"unknown member type {member.type!r}"
    if member.name.startswith("/"):
        return "an absolute path"
    if ".." in member.name.split("/"):
        return "a path with '..'"
    return None


class _Refused(Exception):
    """A bundle entry that fails a check after its bytes were read (the temp file is dropped)."""


def _copy(member: _Member, first: bytes, sha: "hashlib._Hash") -> Callable[[BinaryIO], None]:
    def write(fh: BinaryIO) -> None:
        sha.update(first)
        fh.write(first)
        while member.left:
            block = member.read(_CHUNK)
            sha.update(block)
            fh.write(block)
    return write


EntryCheck = Callable[[CacheKey, EntryContents], None]  # raises ValueError(reason) to refuse an entry


def import_bundle(stream: BinaryIO, store: CacheStore, *, source: str = "", check: EntryCheck | None = None) -> ImportReport:
    """Read a bundle from ``stream`` (a file or a pipe, in one pass) and publish its entries into ``store``.

    Provenance records the bundle carries are checked as untrusted input (``parse_record``, and every digest an
    entry of this bundle with matching key fields) and written beside ``v1/`` with ``imported`` set (``source``:
    the bundle's name, for people). ``check(key, contents)`` runs on every entry that passed the bundle's own
    checks, before it is renamed into place; a ValueError refuses it with its message (e.g. ``--against MODEL``:
    not that model's weights).

    Raises BundleError when the stream is not a bundle (nothing written) or breaks off (entries published
    before that stay: each is complete). Raises InputError when the cache cannot be written.
    """
    reader = _Reader(stream)
    members = _members(reader)
    try:
        first = next(members, None)
    except BundleError as exc:
        raise BundleError(f"not a cache bundle: {exc}") from None
    if first is None:
        raise BundleError("the bundle is empty")
    if first.name != MANIFEST_NAME or first.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        raise BundleError(f"the first member is {first.name!r}, not the {MANIFEST_NAME} every bundle starts with")
    if first.size > MANIFEST_LIMIT:
        raise BundleError(f"{MANIFEST_NAME} is {first.size} bytes, over the {MANIFEST_LIMIT}-byte limit")
    try:
        doc = loads_json(first.read(first.size).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BundleError(f"{MANIFEST_NAME} is not JSON ({exc})") from None
    wanted, items = _manifest_entries(doc)
    records, record_refusals = _manifest_records(doc)
    items += record_refusals
    refused_in_manifest = {i.path for i in items}
    done: set[str] = set()
    held_records: list[tuple[str, bytes]] = []
    names: set[str] = {MANIFEST_NAME}
    extended: str | None = None
    try:
        for member in members:
            why = _refuse_member(member, extended)
            extended = _EXTENDED.get(member.type)
            if why is None and member.name in names:
                why = "appears twice in the bundle"
            names.add(member.name)
            if why is None and member.name in refused_in_manifest:
                continue  # already reported with the manifest's reason
            if why is None and member.name in records:
                if member.size != records[member.name][0]:
                    items.append(ImportItem(member.name, "refused", f"{member.size} bytes, but the manifest says "
                                                                    f"{records[member.name][0]}", kind="record"))
                else:  # written after the entries: a record whose entries were all refused is refused too
                    held_records.append((member.name, member.read(member.size)))
                done.add(member.name)
                continue
            record = wanted.get(member.name)
            if why is None and record is None:
                why = "not in the manifest"
            if why is None and member.size != record[0].size:
                why = f"{member.size} bytes, but the manifest says {record[0].size}"
            if why is not None:
                items.append(ImportItem(member.name, "refused", why))
                continue
            done.add(member.name)
            items.append(_import_one(member, *record, store, check))
        kept = {i.path for i in items if i.kind == "entry" and i.status in ("imported", "replaced", "present")}
        for name, data in held_records:
            items.append(_import_record(name, data, records[name], wanted, kept, store, source))
    except BundleError as exc:
        raise BundleError(f"{exc}; {_progress(items)} before that") from None
    except OSError as exc:
        raise InputError(f"cannot write the cache {store.root}: {describe(exc)}; {_progress(items)} before that") from None
    for path in sorted(set(wanted) - done):
        items.append(ImportItem(path, "refused", "listed in the manifest, missing from the bundle"))
    for path in sorted(set(records) - done):
        items.append(ImportItem(path, "refused", "listed in the manifest, missing from the bundle", kind="record"))
    return ImportReport(store.root, str(doc.get("tool_version", "")), tuple(items))


def _progress(items: list[ImportItem]) -> str:
    n = sum(1 for i in items if i.status in ("imported", "replaced") and i.kind == "entry")
    return f"{n} entr{'y' if n == 1 else 'ies'} imported"


def _import_one(member: _Member, entry: BundleEntry, key: CacheKey, store: CacheStore,
                extra: EntryCheck | None = None) -> ImportItem:
    first = member.read(8)
    (header_len,) = struct.unpack("<Q", first)
    if header_len > HEADER_LIMIT or 8 + header_len > entry.size:
        return ImportItem(entry.path, "refused", f"oversize safetensors header ({header_len} bytes; the limit is "
                                                 f"{HEADER_LIMIT} and the file has {entry.size})")
    sha = hashlib.sha256()

    def check(temp: Path) -> None:
        if sha.hexdigest() != entry.sha256:
            raise _Refused("its bytes differ from the manifest's sha256")
        try:
            verdict = judge_entry(temp, key)  # the rule every command applies
        except Exception as exc:
            raise _Refused(f"it cannot be checked: {describe(exc)}") from None
        if verdict.status == "invalid":
            what = "exl3tool's checksums fail" if verdict.loadable else "the server would not load it"
            raise _Refused(f"{what}: {verdict.reason}")
        contents = verdict.contents
        assert contents is not None
        if extra is not None:
            try:
                extra(key, contents)
            except ValueError as exc:
                raise _Refused(str(exc)) from None

    try:
        status = store.import_entry(key, _copy(member, first, sha), check)
    except _Refused as exc:
        return ImportItem(entry.path, "refused", str(exc))
    except OSError:
        problem = store.obstacle(key)  # something in this entry's place that no publish can replace
        if problem is None:
            raise
        return ImportItem(entry.path, "refused", f"the cache cannot take it: {problem}; {PRUNE_HINT}")
    if status == "present":
        return ImportItem(entry.path, "present", "a valid entry is already there (kept)")
    return ImportItem(entry.path, "imported" if status == "published" else "replaced",
                      "" if status == "published" else "replaced an invalid entry", entry.size)
