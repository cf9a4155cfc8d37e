"""``cache check``: will a server started with these settings hit, and for every miss, why.

The look-ups are exactly a warm's plan (``prepare``, the code behind ``cache warm --dry-run``), each judged by the
rule every command applies (``judge_entry``: the server's checks and exl3tool's checksums, the trellis hashed from
the mapped file, nothing encoded), so ``check`` counts as a hit exactly what a warm keeps. For a miss the entries present at the same
layer, TP size and rank are compared key field by key field; the nearest one names the cause. Provenance records
(``exl3tool.cache.records``) turn "model identity differs" into "this shard's mtime differs", and tell entries a
warm wrote from entries the server wrote itself. Misses with the same cause are reported once, with the fix.
"""

from __future__ import annotations

import datetime as _dt
import json
import posixpath
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from exl3tool.cache.key import CacheKey
from exl3tool.checkpoint.plan import ALIGN, LayerPlan, plan_layers, rank_sizes
from exl3tool.errors import ConfigError
from exl3tool.cache.records import ORIGINS, StoredRecord, entry_origin, overlay_digest, printable, read_records
from exl3tool.text import plural
from exl3tool.plan.plan import LookupJob, LookupPlan
from exl3tool.plan.request import ServerRequest, prepare
from exl3tool.releases import (
    UNALIGNED_FIX, ReleaseChoice, RuleSplit, ServerRelease, lock_waits, release_depends, unaligned_start_failure,
    unaligned_start_unknown,
)
from exl3tool.operations.release_rules import release_rules

__all__ = ["Present", "Finding", "Cause", "CheckReport", "check", "no_lookup_json", "model_differences", "encoder_differences",
           "start_failures", "start_unknowns", "stored_only_report", "hydrated_failures", "stored_failures"]

_SHOWN = 3  # items named per line before "and N more"


@dataclass(frozen=True)
class Present:
    """An entry in the cache (header read): its key and who wrote it (a warm with a record, exl3tool, the server)."""

    key: CacheKey
    path: Path
    mtime: float
    origin: str
    record: Optional[StoredRecord] = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Finding:
    """One line of the report: which key field (or setting) differs, both values, and the fix."""

    field: str  # model_identity | encoder_identity | bits | shape | tp_layout | overlay | absent | invalid | ...
    text: str
    fix: str

    def as_json(self) -> dict[str, str]:
        return {"field": self.field, "text": self.text, "fix": self.fix}


@dataclass(frozen=True)
class Cause:
    """Look-ups that miss (or are invalid, or hit server-written entries) for one reason."""

    kind: str  # miss | invalid | server_written | unplanned (look-ups the server makes that no plan holds)
    fields: tuple[str, ...]
    lookups: tuple[LookupJob, ...]
    findings: tuple[Finding, ...]
    nearest: Optional[Present] = None

    def as_json(self) -> dict[str, Any]:
        n = self.nearest
        return {
            "kind": self.kind, "fields": list(self.fields), "count": len(self.lookups),
            "findings": [f.as_json() for f in self.findings],
            "nearest": None if n is None else {
                "path": str(n.path), "origin": n.origin, "key": n.key.as_dict(),
                "record": None if n.record is None else str(n.record.path)},
            "lookups": [{"prefix": j.prefix, "tp_size": j.tp_size, "tp_rank": j.tp_rank, "digest": j.digest}
                        for j in self.lookups],
        }


@dataclass(frozen=True)
class CheckReport:
    """Every look-up's state, the causes of misses, notes that do not change a hit, and the records consulted."""

    plan: LookupPlan
    dtype: str
    causes: tuple[Cause, ...]
    notes: tuple[Finding, ...]
    hit_origins: dict[str, int]
    records: tuple[StoredRecord, ...]
    seconds: float
    stored: str = ""  # non-empty: the server looks nothing up because every online layer is stored (hydrated)
    start_failures: tuple[Finding, ...] = ()  # why this server will not start at all (the release's rules)
    server_release: str = ""  # the release whose rules were applied (exl3tool.releases)
    release: Optional[ReleaseChoice] = None  # that release, where it came from and what was assumed
    cannot_tell: tuple[Finding, ...] = ()  # what exl3tool cannot tell about this server (an unread patched exl3.py)
    hydrated: Optional[Any] = None  # the checkpoint's `exl3tool hydrate` record (checkpoint.hydrate_record), if any
    # the release not determined (``ReleaseChoice.determined``): the rules whose outcome differs between the
    # releases that could be serving (then no answer: exit 2), else the note that every one gives this answer
    release_splits: tuple[RuleSplit, ...] = ()
    release_note: str = ""

    @property
    def assumed(self) -> bool:
        """Whether the answer rests on an assumption (an unknown release label, a patched image not read, a release
        not named where the answer depends on it): then ``cache check`` exits 2, never 0 or 1 (docs/releases.md)."""
        return (bool(self.cannot_tell) or bool(self.release_splits)
                or (self.release is not None and self.release.assumed))

    def assumptions(self) -> list[str]:
        """Each assumption in one line (what exl3tool did not know and what it assumed)."""
        return [*(self.release.unknown if self.release is not None else ()),
                *(f"cannot tell whether this server starts: {f.text}" for f in self.cannot_tell),
                *self.release_depends()]

    def release_depends(self) -> list[str]:
        """One line per rule whose outcome differs between the releases the server could run (the release not
        named), naming them."""
        if self.release is None or not self.release_splits:
            return []
        return release_depends(self.release, self.release_splits)

    @property
    def lookups(self) -> list[LookupJob]:
        return [j for j in self.plan.jobs if j.state != "skipped"]

    @property
    def ok(self) -> bool:
        """Every look-up the server makes hits: no miss, no invalid entry, and no look-up predicted outside the plan
        (a layer the server encodes that exl3tool cannot plan is a miss, counted or not)."""
        return (self.plan.count("miss") == 0 and self.plan.count("invalid") == 0
                and not any(c.kind == "unplanned" for c in self.causes) and not self.start_failures
                and not self.assumed)

    def as_json(self) -> dict[str, Any]:
        """The `cache check --json` document (fields in docs/cache.md)."""
        plan = self.plan
        cause_of: dict[str, list[int]] = {}
        for n, c in enumerate(self.causes):
            for j in c.lookups:
                cause_of.setdefault(j.digest, []).append(n)
        lookups = self.lookups
        return {
            "model": plan.model, "model_identity": plan.model_identity, "encoder_identity": plan.encoder_identity,
            "bits": plan.bits, "dtype": self.dtype, "tp_sizes": list(plan.tp_sizes), "cache_root": str(plan.cache_root),
            **plan.header_json(),
            "stored_only": self.stored or None, "ok": self.ok, "server_release": self.server_release,
            "release": None if self.release is None else self.release.as_json(), "assumed": self.assumed,
            "release_differs": [x.as_json() for x in self.release_splits], "release_note": self.release_note or None,
            "cannot_tell": [f.as_json() for f in self.cannot_tell],
            "hydrated": None if self.hydrated is None else self.hydrated.as_json(),
            "start_failures": [f.as_json() for f in self.start_failures], "lookups": len(lookups), "hit": plan.count("hit"), "miss": plan.count("miss"),
            "invalid": plan.count("invalid"), "not_looked_up": plan.count("skipped"), "hit_origins": self.hit_origins,
            "causes": [c.as_json() for c in self.causes],
            "notes": [f.as_json() for f in self.notes],
            "records": [{"path": str(sr.path), "error": sr.error} if sr.record is None else
                        {"path": str(sr.path), "command": sr.record.command, "host": sr.record.host,
                         "time": sr.record.time, "model_identity": sr.record.model_identity,
                         "encoder_identity": sr.record.encoder_identity, "entries": len(sr.record.entries)}
                        for sr in self.records],
            "seconds": self.seconds,
            "entries": [{"prefix": j.prefix, "tp_size": j.tp_size, "tp_rank": j.tp_rank, "input_size": j.input_size,
                         "output_size": j.output_size, "state": j.state, "reason": j.reason, "digest": j.digest,
                         "path": str(j.path), "causes": cause_of.get(j.digest, [])} for j in lookups],
        }


def no_lookup_json(reasons: tuple[str, ...]) -> dict[str, Any]:
    """The `cache check --json` document of a launch whose server looks nothing up (``reasons``: why): zero
    look-ups and ``"ok": false``, a finding, never "all hit" (docs/cache.md)."""
    return {"ok": False, "server_lookup": False, "lookup_off": list(reasons), "lookups": 0, "hit": 0, "miss": 0,
            "invalid": 0, "causes": [], "notes": []}


# --- payload comparisons ------------------------------------------------------------------------------------------


def _when_ns(ns: Any) -> str:
    if type(ns) is not int:
        return printable(str(ns))
    sec, frac = divmod(ns, 1_000_000_000)
    stamp = _dt.datetime.fromtimestamp(sec, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return stamp + (f".{frac:09d}".rstrip("0") if frac else "") + "Z"


def _s(value: Any) -> str:
    return printable(str(value)) if not isinstance(value, str) else printable(value)


def _more(names: list[str]) -> str:
    shown = ", ".join(_s(n) for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def model_differences(here: str, there: str) -> list[Finding]:
    """Which component of two model identity payloads differs, both values, the fix (``here``: this launch's)."""
    a, b = json.loads(here), json.loads(there)
    f = "model_identity"
    if a.get("kind") != b.get("kind"):
        return [Finding(f, f"the model is a {_s(a.get('kind'))} here, a {_s(b.get('kind'))} when warmed",
                        "warm the checkpoint the server loads, named as the server names it (Hub id or local path)")]
    out: list[Finding] = []
    if a["kind"] == "hub":
        if a.get("model") != b.get("model"):
            out.append(Finding(f, f"Hub repo {_s(a.get('model'))} here, {_s(b.get('model'))} when warmed",
                               "warm the repo id the server is started with"))
        if a.get("revision") != b.get("revision"):
            out.append(Finding(f, f"the Hub revision resolved to {_s(a.get('revision'))} here, "
                                  f"{_s(b.get('revision'))} when warmed",
                               f"start the server and warm with --revision {_s(a.get('revision'))} (a full commit "
                               "hash never moves)"))
        return out
    if a.get("path") != b.get("path"):
        out.append(Finding(f, f"model path {_s(a.get('path'))} here, {_s(b.get('path'))} when warmed",
                           f"warm with --server-path {_s(a.get('path'))} (the path as the server sees it)"))
    if a["kind"] == "file":
        for name, what in (("size", "size"), ("mtime_ns", "mtime"), ("sha256", "sha256")):
            if a.get(name) != b.get(name):
                show = _when_ns if name == "mtime_ns" else _s
                out.append(Finding(f, f"the file's {what} {show(a.get(name))} here, {show(b.get(name))} when warmed",
                                   "copy with cp -p / rsync -t (mtimes kept), or warm again here"))
        return out
    if a.get("revision") != b.get("revision"):
        def rev(x: Any) -> str:
            return "none" if x is None else repr(_s(x))

        out.append(Finding(f, f"revision {rev(a.get('revision'))} here, {rev(b.get('revision'))} when warmed",
                           "start the server with the --revision the warm used (a local folder hashes the string as "
                           f"given), or warm with {'no --revision' if a.get('revision') is None else '--revision ' + _s(a.get('revision'))}"))
    ma = {m[0]: m[1] for m in a.get("markers", []) if isinstance(m, list) and len(m) == 2}
    mb = {m[0]: m[1] for m in b.get("markers", []) if isinstance(m, list) and len(m) == 2}
    for name in sorted(set(ma) | set(mb)):
        if ma.get(name) == mb.get(name):
            continue
        if name not in mb or name not in ma:
            where = "here only" if name in ma else "only when warmed"
            out.append(Finding(f, f"marker file {_s(name)} present {where}",
                               "the checkpoint folder's files differ: copy it whole, or warm again here"))
        else:
            out.append(Finding(f, f"{_s(name)} sha256 {_s(ma[name])[:12]} here, {_s(mb[name])[:12]} when warmed (the "
                                  "file changed since the warm)",
                               "restore the warmed file, or warm again here"))
    sa = {s[0]: s for s in a.get("shards", []) if isinstance(s, list) and len(s) == 4}
    sb = {s[0]: s for s in b.get("shards", []) if isinstance(s, list) and len(s) == 4}
    only_here, only_there = sorted(set(sa) - set(sb)), sorted(set(sb) - set(sa))
    if only_here or only_there:
        parts = ([f"{_more(only_here)} here only"] if only_here else []) + (
            [f"{_more(only_there)} only when warmed"] if only_there else [])
        out.append(Finding(f, "shards differ: " + "; ".join(parts), "copy the checkpoint whole, or warm again here"))
    moved, resized, touched = [], [], []
    for name in sorted(set(sa) & set(sb)):
        x, y = sa[name], sb[name]
        if x[1] != y[1] and not (x[1] == posixpath.join(str(a.get("path")), name)
                                 and y[1] == posixpath.join(str(b.get("path")), name)):  # the path finding says it
            moved.append(f"{_s(name)} resolves to {_s(x[1])} here, {_s(y[1])} when warmed")
        if x[2] != y[2]:
            resized.append(f"{_s(name)} size {_s(x[2])} here, {_s(y[2])} when warmed")
        elif x[3] != y[3]:
            touched.append(f"{_s(name)} mtime {_when_ns(x[3])} here, {_when_ns(y[3])} when warmed")
    for items, fix in ((moved, "the shard links resolve elsewhere: mount or copy as when warmed, or warm with "
                                "--server-path so the links map as the server resolves them"),
                       (resized, "a different file: copy the warmed checkpoint again, or warm again here"),
                       (touched, "copy with cp -p / rsync -t (mtimes kept), or warm again here")):
        if items:
            more = f" (and {len(items) - _SHOWN} more shard(s) likewise)" if len(items) > _SHOWN else ""
            out.append(Finding(f, "; ".join(items[:_SHOWN]) + more, fix))
    return out


def encoder_differences(here: str, there: str) -> list[Finding]:
    """Which part of two encoder identity payloads differs (root string, revision string, source files)."""
    a, b = json.loads(here), json.loads(there)
    f = "encoder_identity"
    out: list[Finding] = []
    if a.get("root") != b.get("root"):
        out.append(Finding(f, f"encoder root {_s(a.get('root'))} here, {_s(b.get('root'))} when warmed",
                           "VLLM_EXL3_ENCODER_SOURCE (--encoder-root) must be the same path string for the server and "
                           "the warm: the string is hashed"))
    if ("revision" in a) != ("revision" in b):
        here_mode = "a revision string" if "revision" in a else "its source files' digests"
        there_mode = "a revision string" if "revision" in b else "its source files' digests"
        out.append(Finding(f, f"the encoder is identified by {here_mode} here, by {there_mode} when warmed",
                           "set VLLM_EXL3_ENCODER_REVISION (--encoder-revision) for both the server and the warm, or "
                           "for neither"))
    elif "revision" in a and a.get("revision") != b.get("revision"):
        out.append(Finding(f, f"encoder revision {_s(a.get('revision'))!r} here, {_s(b.get('revision'))!r} when warmed",
                           "VLLM_EXL3_ENCODER_REVISION (--encoder-revision) must be the same string for both"))
    elif "files" in a:
        fa = {x[0]: x[1] for x in a.get("files", []) if isinstance(x, list) and len(x) == 2}
        fb = {x[0]: x[1] for x in b.get("files", []) if isinstance(x, list) and len(x) == 2}
        changed = sorted(n for n in set(fa) & set(fb) if fa[n] != fb[n])
        parts = [f"{_more(changed)} changed"] if changed else []
        if set(fa) - set(fb):
            parts.append(f"{_more(sorted(set(fa) - set(fb)))} here only")
        if set(fb) - set(fa):
            parts.append(f"{_more(sorted(set(fb) - set(fa)))} only when warmed")
        if parts:
            out.append(Finding(f, "encoder source files differ: " + "; ".join(parts),
                               "the server's encoder copy is not the one warmed with: install the same exllamav3 "
                               "version, or pin VLLM_EXL3_ENCODER_REVISION for both"))
    return out


# --- the check ----------------------------------------------------------------------------------------------------

_FIELDS = ("model_identity", "encoder_identity", "bits", "shape")


def _differs(a: CacheKey, b: CacheKey) -> tuple[str, ...]:
    out = [f for f in ("model_identity", "encoder_identity", "bits") if getattr(a, f) != getattr(b, f)]
    if (a.input_size, a.output_size) != (b.input_size, b.output_size):
        out.append("shape")
    return tuple(out)


def _who(p: Present) -> str:
    if p.origin == "server":
        return "the server itself (no exl3tool checksum, no record)"
    if p.record is None or p.record.record is None:
        return "exl3tool (no provenance record)"
    r = p.record.record
    return f"exl3tool {r.command} on {r.host} at {r.time}"


class _Cache:
    """The entries present (headers) and the records, indexed for the comparisons."""

    def __init__(self, root: Path, records: list[StoredRecord]) -> None:
        from exl3tool.cache.scan import scan

        self.by_digest: dict[str, StoredRecord] = {}
        self.by_model: dict[str, StoredRecord] = {}
        self.by_encoder: dict[str, StoredRecord] = {}
        for sr in records:  # newest record wins where several explain one identity
            if sr.record is None:
                continue
            for d in sr.record.digests:
                self.by_digest[d] = sr
            for index, ident in ((self.by_model, sr.record.model_identity), (self.by_encoder, sr.record.encoder_identity)):
                if ident not in index or index[ident].record.time < sr.record.time:
                    index[ident] = sr
        self.present: list[Present] = []
        for info in scan(root, deep=False):
            if info.kind != "entry" or info.key is None or info.status == "invalid":
                continue
            sr = self.by_digest.get(info.digest or "")
            if sr is not None and sr.record.model_identity != info.key.model_identity:
                sr = None
            origin = entry_origin("exl3tool_sha256" in info.metadata, sr is not None)
            self.present.append(Present(info.key, info.path, info.mtime, origin, sr))
        self.slot: dict[tuple[str, int, int], list[Present]] = defaultdict(list)
        self.prefix: dict[str, list[Present]] = defaultdict(list)
        for p in self.present:
            self.slot[(p.key.prefix, p.key.tp_world_size, p.key.tp_rank)].append(p)
            self.prefix[p.key.prefix].append(p)

    @staticmethod
    def nearest(key: CacheKey, found: list[Present], ignore_shape: bool = False) -> Present:
        def rank(p: Present):
            fields = [f for f in _differs(key, p.key) if not (ignore_shape and f == "shape")]
            return len(fields), ORIGINS.index(p.origin), -p.mtime, str(p.path)
        return min(found, key=rank)


def _identity_findings(fields: tuple[str, ...], key: CacheKey, near: Present, plan: LookupPlan, cache: _Cache,
                       *, here: str = "here", there: str = "in the cache") -> list[Finding]:
    """Lines for the fields in which ``near``'s key differs from ``key`` (payload components where records tell)."""
    out: list[Finding] = []
    ids = plan.identities
    for f, mine, theirs, payload_of, diff in (
            ("model_identity", key.model_identity, near.key.model_identity,
             lambda sr: sr.record.model_payload, model_differences),
            ("encoder_identity", key.encoder_identity, near.key.encoder_identity,
             lambda sr: sr.record.encoder_payload, encoder_differences)):
        if f not in fields:
            continue
        index = cache.by_model if f == "model_identity" else cache.by_encoder
        sr = index.get(theirs)
        own = None
        if ids is not None:
            own_id = ids.model if f == "model_identity" else ids.encoder
            own = own_id.payload if own_id.identity == mine else None
        if own is None:  # ``key`` is not this launch's (comparing server-written entries with a warm's)
            mine_sr = index.get(mine)
            own = payload_of(mine_sr) if mine_sr is not None else None
        lines = diff(own, payload_of(sr)) if sr is not None and own is not None else []
        if lines:
            out.extend(lines)
        else:
            what = f.replace("_", " ")
            out.append(Finding(f, f"{what} {mine[:16]} {here}, {theirs[:16]} {there}; no provenance record explains "
                                  f"{'both' if sr is None and own is None else 'the other'} (written by the server, "
                                  "or by exl3tool before records)",
                               "run `exl3tool identity` with the warm's options where it ran and compare the payloads, "
                               "or warm again here"))
    if "bits" in fields:
        out.append(Finding("bits", f"bits {key.bits} {here}, {near.key.bits} {there}",
                           f"warm with --bits {key.bits}, or start the server with VLLM_EXL3_ONLINE_TRELLIS_BITS="
                           f"{near.key.bits}"))
    if "shape" in fields:
        out.append(Finding("shape", f"input x output {key.input_size} x {key.output_size} {here}, "
                                    f"{near.key.input_size} x {near.key.output_size} {there} (e.g. {_s(key.prefix)})",
                           "the rank-local shape differs: the checkpoint's config or the family planning changed "
                           "since the warm; warm again from the checkpoint the server loads"))
    return out


def _overlay_findings(jobs: list[LookupJob], plan: LookupPlan, cache: _Cache, ours: Optional[str]) -> list[Finding]:
    """Layers this launch plans that no entry in the cache has at any TP size (the warm's overlay left them out)."""
    prefixes = sorted({j.prefix for j in jobs})
    if not plan.cache_root.is_dir():
        what = "is not a directory" if plan.cache_root.exists() else "does not exist here"
        return [Finding("absent", f"the cache root {_s(str(plan.cache_root))} {what}",
                        "pass the server's cache root (--cache-dir, VLLM_EXL3_ONLINE_CACHE_DIR), or import or warm "
                        "the entries into it")]
    mine = [sr for sr in cache.by_digest.values() if plan.identities is not None
            and sr.record.model_identity == plan.model_identity]
    ref = max(mine or list(cache.by_model.values()) or [None],
              key=lambda sr: (sr.record.time if sr is not None else ""))
    pair_present = any(p.key.model_identity == plan.model_identity for p in cache.present)
    if ref is None and not pair_present:
        return [Finding("absent", f"{len(prefixes)} layer(s) have no entry in the cache at any TP size (e.g. "
                                  f"{_more(prefixes)}), and no warm of this model is recorded",
                        f"warm them: exl3tool cache warm MODEL --tp-size {','.join(map(str, plan.tp_sizes))} with "
                        "the server's settings and --cache-dir")]
    text = f"{len(prefixes)} layer(s) planned here that the warm did not (e.g. {_more(prefixes)})"
    if ref is not None:
        s = ref.record.settings
        theirs = s.quantization_config or "the default overlay"
        if s.overlay_digest != ours:
            text += (f"; the warm of {ref.record.time} planned with quantization config {_s(theirs)} "
                     f"({s.layers_planned} layers), this launch with {_s(_overlay_text(plan))} "
                     f"({len(plan.layer_plan.layers) if plan.layer_plan else 0} layers)")
    return [Finding("overlay", text, "warm with the server's exact --quantization-config (and --layers/--exclude "
                                     "as the warm used them)")]


def _overlay_text(plan: LookupPlan) -> str:
    lp = plan.layer_plan
    if lp is None or lp.overlay is None:
        return "no overlay"
    return "the default overlay" if lp.overlay.default else lp.overlay.text


def _resolved_dtype(request: ServerRequest, checkpoint) -> str:
    return request.dtype if request.dtype not in (None, "auto") else str(checkpoint.dtype).removeprefix("torch.")


def check(request: ServerRequest, *, environ: Optional[dict] = None) -> CheckReport:
    """Every look-up a server started as ``request`` describes will make, each hit, miss or invalid, with causes.

    The plan is ``prepare``'s (as ``cache warm --dry-run``), looked up read-only with the warm's verdicts;
    nothing is encoded or written. Entries present are indexed (headers only) when a look-up misses or hits an
    entry the server wrote, so an all-hit check of a warm cache reads the look-ups' headers and the records only.

    Args:
        request: the server's settings (``exl3tool.plan.ServerRequest``), usually filled from its launch.
        environ: the environment identities and the cache root are read from (None: ``os.environ``).

    Returns:
        A ``CheckReport``: every look-up's state and, for each miss or invalid entry, its causes.
    """
    start = time.perf_counter()
    stored = stored_only_report(request, environ)
    if stored is not None:
        return stored
    checkpoint, plan, store = prepare(replace(request, mode="readonly"), environ=environ)  # the warm's verdicts
    dtype = _resolved_dtype(request, checkpoint)
    records = read_records(plan.cache_root)
    lookups = [j for j in plan.jobs if j.state != "skipped"]
    recorded = {d for sr in records if sr.record is not None and sr.record.model_identity == plan.model_identity
                for d in sr.record.digests}
    hit_origins = {o: 0 for o in ORIGINS}
    server_hits = []
    for j in lookups:
        if j.state == "hit":
            origin = entry_origin(_has_checksum(j.path), j.digest in recorded)
            hit_origins[origin] += 1
            if origin == "server":
                server_hits.append(j)
    misses = [j for j in lookups if j.state == "miss"]
    invalid = [j for j in lookups if j.state == "invalid"]
    causes: list[Cause] = []
    notes: list[Finding] = []
    cache = _Cache(plan.cache_root, records) if (misses or invalid or server_hits) else None
    if cache is not None:
        causes += _miss_causes(misses, plan, cache)
        causes += _server_causes(misses + server_hits, plan, cache)
    by_reason: dict[str, list[LookupJob]] = defaultdict(list)
    for j in invalid:
        by_reason[j.reason].append(j)
    for reason, jobs in by_reason.items():
        causes.append(Cause("invalid", ("invalid",), tuple(jobs), (Finding(
            "invalid", f"an invalid entry (the server would not load it, or exl3tool's checksums fail): {_s(reason)}",
            "a warm re-encodes it (the server deletes and re-encodes one it would not load at start-up): run "
            "`exl3tool cache warm` with these settings, or remove it with `exl3tool cache prune --invalid`"),)))
    causes += _unplanned_causes(plan)
    notes += _dtype_notes(lookups, records, plan, dtype)
    notes += _unplanned_notes(plan, cache, records)
    notes += _parity_notes(lookups, records, plan)
    release = request.release
    notes += _lock_notes(lookups, request.release_choice)
    full = plan.layer_plan
    if full is not None and full.server_lookup and (request.layers or request.exclude):
        try:  # the server builds every layer, not only the ones --layers selects
            full = plan_layers(checkpoint, overlay=full.overlay, language_model_only=request.language_model_only,
                               release=release)
        except ConfigError:
            pass
    failures = start_failures(plan, request, release, full)
    record = _hydrate_record(request)
    stored, unknown = stored_failures(full, record, tuple(request.tp_sizes), request.model)
    splits, note = release_rules(request, checkpoint.config, environ, plan, full)
    return CheckReport(plan, dtype, tuple(causes), tuple(notes), hit_origins, tuple(records),
                       round(time.perf_counter() - start, 4), start_failures=tuple(failures + stored),
                       server_release=release.name, release=request.release_choice,
                       cannot_tell=tuple(start_unknowns(plan, release, full) + unknown), hydrated=record,
                       release_splits=splits, release_note=note)


def _unaligned(plan: LookupPlan, full: Optional[LayerPlan], rule) -> dict[tuple[str, int], str]:
    """(prefix, TP size) -> ``rule(k_r)``'s sentence for each 128-unaligned shard the server builds where it says
    something (``unaligned_start_failure`` / ``unaligned_start_unknown``), in plan order."""
    seen: dict[tuple[str, int], str] = {}
    lp = full or plan.layer_plan
    for tp in plan.tp_sizes:
        for layer in (lp.layers if lp is not None and lp.server_lookup else ()):
            try:
                k_r, n_r = rank_sizes(layer, tp)
            except (ValueError, ConfigError):
                continue  # a TP size this layer cannot be sharded at: the plan says so itself
            if (k_r % ALIGN or n_r % ALIGN) and (why := rule(k_r)) is not None:
                seen.setdefault((layer.prefix, tp), why)
    return seen


def _one_line(seen: dict[tuple[str, int], str], lead: str) -> str:
    (prefix, tp), why = next(iter(seen.items()))
    others = [f"{p} (TP {t})" for p, t in list(seen)[1:4]]
    more = f"; also {', '.join(others)}" + (" ..." if len(seen) > 4 else "") if others else ""
    return f"{lead}{prefix} at TP {tp}: {why}{more}"


def start_unknowns(plan: LookupPlan, release: ServerRelease, full: Optional[LayerPlan] = None) -> list[Finding]:
    """What exl3tool cannot tell about the start of a server of ``release``: a shard the releases' exl3.py fails on
    and PR #312's keeps BF16, when which one the server runs was not read (a patched image known by its labels)."""
    seen = _unaligned(plan, full, lambda k_r: unaligned_start_unknown(k_r, release))
    if not seen:
        return []
    return [Finding("start", _one_line(seen, ""), "give the image's files (--image-root DIR, or --pid of the running "
                    f"server), or name what it runs: --server-release {release.name.split('+')[0]}+pr312 (PR #312's "
                    f"exl3.py) or --server-release {release.name.split('+')[0]} (the release's own)")]


def start_failures(plan: LookupPlan, request: ServerRequest, release: ServerRelease,
                   full: Optional[LayerPlan] = None) -> list[Finding]:
    """Why a server of ``release`` started as ``request`` describes fails at start-up, whatever the cache holds:
    a 128-unaligned shard whose K_r is not a multiple of 32 (the MXFP8 fallback raises: fork issue #311; not with
    PR #312's exl3.py), and an encoder root with ``~`` when some look-up misses (the server's import does not expand
    it). ``full``: the layer plan without ``--layers``/``--exclude`` (the server builds every layer; default: the
    plan's)."""
    out: list[Finding] = []
    seen = _unaligned(plan, full, lambda k_r: unaligned_start_failure(k_r, release))
    if seen:
        out.append(Finding("start", _one_line(seen, "this server will not start: "), UNALIGNED_FIX))
    import os

    here = os.path.normpath(request.cache_dir or "") + "/"
    for mount in getattr(request.server_view, "mounts", ()):  # left by launch.resolve: the cache root's own bind
        if getattr(mount, "refused", "") and mount.host and here.startswith(os.path.normpath(mount.host) + "/"):
            out.append(Finding("launch", f"this server will not start yet: {mount.refused}",
                               "`exl3tool cache warm` creates it with the cache root (or create it first)"))
    root = request.encoder_root or ""
    misses = [j for j in plan.jobs if j.state in ("miss", "invalid")]
    if root.startswith("~") and misses and not release.encoder_source_tilde_expanded_for_import:
        out.append(Finding(
            "encoder_source",
            f"this server will not start: VLLM_EXL3_ENCODER_SOURCE={root} starts with ~, which the encoder identity "
            f"expands but the server's encoder import does not ({release.name}'s _load_exl3_online_quantizer takes "
            f"Path({root!r}).resolve(), a folder {root.split('/')[0]} under its working directory), so its first "
            f"online encode ({plural(len(misses), 'look-up')} miss, e.g. {misses[0].prefix}) fails the start",
            "set VLLM_EXL3_ENCODER_SOURCE to the absolute path (the identity is the same: the server expands ~ for "
            "it), or warm every look-up so the server never imports its encoder"))
    return out


def _lock_notes(lookups: list[LookupJob], choice: ReleaseChoice) -> list[Finding]:
    """Entry locks held now (a warm running): what the release's server does when it reaches one at start-up (each
    rule, when the release is not determined and the releases it could be wait differently)."""
    from exl3tool.cache.locks import lock_holders
    from exl3tool.cache.paths import lock_path

    held = []
    for j in lookups:
        lock = lock_path(j.path)
        if lock.exists() and lock_holders(lock):
            held.append(j)
    release = choice.release
    module = release.cache_module
    if not held or module is None:
        return []
    if len({r.cache_module.lock_timeout_s for r in choice.candidates if r.cache_module is not None}) > 1:
        what = f"the server's release is not determined: {lock_waits(choice.candidates)}"
    elif module.lock_timeout_s is None:
        what = (f"{release.name}'s entry lock has no timeout: a server starting now waits on each of them for as "
                "long as the warm holds it")
    else:
        what = (f"{release.name}'s server waits up to {module.lock_timeout_s:.0f} s on each, then encodes that layer "
                "without the cache")
    return [Finding("lock", f"{plural(len(held), 'entry lock')} held now (a warm is running), e.g. "
                            f"{held[0].prefix}: {what}", "let the warm finish before starting the server")]


def _hydrate_record(request: ServerRequest):
    """The `exl3tool hydrate` record of a local checkpoint folder (``checkpoint.hydrate_record``), else None."""
    import os

    from exl3tool.checkpoint.hydrate_record import read_hydrate_record

    return read_hydrate_record(request.model) if os.path.isdir(os.path.expanduser(request.model)) else None


def hydrated_failures(record, tp_sizes: tuple[int, ...], model: str) -> list[Finding]:
    """Why a server at one of ``tp_sizes`` fails to load a checkpoint `exl3tool hydrate` wrote, as its record says
    (``fails_at``: the first stored layer that TP size cannot slice, and the server's error); nothing for a size
    the record does not name (``stored_failures`` judges every stored module there)."""
    if record is None:
        return []
    checked = ",".join(map(str, record.tp_sizes))
    return [Finding("hydrated", f"this server will not start: {model} was hydrated for TP {checked}, and at TP {tp} "
                                f"{record.fails_at[tp]}",
                    f"serve it at TP {checked}, or hydrate SOURCE again with --tp-size {tp} (a layer TP {tp} cannot "
                    "slice then stays BF16, as in SOURCE)")
            for tp in tp_sizes if record.loads_at(tp) is False]


def stored_failures(layer_plan: Optional[LayerPlan], record, tp_sizes: tuple[int, ...],
                    model: str) -> tuple[list[Finding], list[Finding]]:
    """``(failures, unknowns)`` of the modules the checkpoint stores as EXL3 at each of ``tp_sizes``: a size where a
    rank cannot slice one of them (``LayerPlan.stored_failures``: the fork's rules, ``checkpoint.slicing``) is a
    start failure naming the first one in the order the server slices them and the server's error, whatever the
    cache holds. The hydrate ``record`` gives the context (the sizes OUT was hydrated for) and the fix: hydrating
    SOURCE again helps only where every failing module is one the hydrate stored (SOURCE's own stored modules fail
    there too otherwise); where the rule finds nothing the record's ``fails_at`` is still said (never a start on
    a disagreement). ``unknowns``: stored modules whose layout exl3tool does not model (then it cannot tell
    whether the server starts)."""
    out: list[Finding] = []
    if layer_plan is None or not layer_plan.server_lookup:
        return out, []
    recorded = {f.text: f for f in hydrated_failures(record, tp_sizes, model)}
    starts: Optional[tuple[int, ...]] = None
    for tp in tp_sizes:
        failing = layer_plan.stored_failures(tp)
        if not failing:
            out += [f for f in recorded.values() if f" at TP {tp} " in f.text]
            continue
        module, why = failing[0]
        if starts is None:
            starts = layer_plan.startable_tp_sizes()
        serve = (f"serve it at TP {','.join(map(str, starts))} (where every rank slices each stored module)"
                 if starts else "no TP size up to 8 loads every stored module: store this module for the TP size "
                                "you serve (its rank slices 128-aligned), or serve another checkpoint")
        ours = [m for m, _ in failing if record is not None and any(s.module in record.modules for s in m.sources)]
        theirs = [(m, w) for m, w in failing if m not in ours]
        ours_sources = {s.module for m in ours for s in m.sources}
        if record is not None and not theirs and set(record.modules) <= ours_sources:
            # every module the hydrate stored fails at tp: a hydrate for tp would store nothing (it refuses)
            again = (f", or serve SOURCE itself at TP {tp} (no module the hydrate stored slices there, so a hydrate "
                     f"for TP {tp} would store nothing; SOURCE's server encodes those layers online)")
        elif record is not None and not theirs:
            again = (f", or hydrate SOURCE again with --tp-size {tp} (a layer TP {tp} cannot slice then stays BF16, "
                     "as in SOURCE)")
        elif record is not None:
            again = (f"; hydrating again does not help at TP {tp}: {theirs[0][0].prefix}, stored as EXL3 in SOURCE "
                     f"itself, cannot be sliced there either ({theirs[0][1]})")
        else:
            again = ""
        if record is not None:
            checked = ",".join(map(str, record.tp_sizes))
            text = (f"this server will not start: {model} was hydrated for TP {checked}, and at TP {tp} "
                    f"{module.prefix}: {why}")
            out.append(Finding("hydrated", text, serve + again))
        else:
            out.append(Finding("stored", f"this server will not start: at TP {tp} {module.prefix}, stored as EXL3 in "
                                         f"{model}, cannot be loaded: {why}", serve + again))
    unknown = [Finding("stored", f"{m.prefix} is stored as EXL3, but {m.unknown}; exl3tool does not model how the "
                                 "fork loads it", "check that a server of this checkpoint starts at these TP sizes")
               for m in layer_plan.stored_unknown()]
    return out, unknown


def _launch_notes(environ: Optional[dict]) -> list[Finding]:
    """A launch of a checkpoint whose every online layer is stored that still sets the online-encode variables: the
    fork then requires VLLM_EXL3_ENCODER_SOURCE at start-up (``Exl3Config._configure_online_cache_identity``: set
    at all, and with the cache on and no revision, .py files under it to hash) although it encodes nothing."""
    import os

    from exl3tool.releases import KEY_VARIABLES

    env = os.environ if environ is None else environ
    bits = (env.get("VLLM_EXL3_ONLINE_TRELLIS_BITS") or "").strip()
    if not bits:
        return []
    present = [v for v in KEY_VARIABLES if (env.get(v) or "").strip()]
    return [Finding(
        "launch", f"the launch sets VLLM_EXL3_ONLINE_TRELLIS_BITS={bits}, so the server still requires "
                  "VLLM_EXL3_ENCODER_SOURCE at start-up (and, with the cache on and no VLLM_EXL3_ENCODER_REVISION, "
                  ".py files under it to hash) although it encodes nothing",
        f"drop {', '.join(present)} from the launch; keep --quantization-config (the layers the server keeps MXFP8 "
        "stay MXFP8; docs/hydrate.md, 'Upload and serve')")]


def stored_only_report(request: ServerRequest, environ: Optional[dict] = None) -> Optional[CheckReport]:
    """A report of zero look-ups when the local checkpoint stores every layer the server would encode online and
    exl3tool models (a hydrated checkpoint, `exl3tool hydrate`): the rule is
    ``operations.hydrate.stored_only_reason``. None otherwise (also for Hub models: their plan is ``prepare``'s,
    which fetches only what it needs). A TP size vLLM cannot split the model into is a ConfigError (exit 2) naming
    why, as for any plan. Its start failures are ``stored_failures``' (every module the checkpoint stores, the
    hydrate record's among them); layers the server encodes that exl3tool does not model (a vision tower the
    overlay does not ignore) are its causes (each look-up a miss); its notes say which launch variables the server
    no longer needs."""
    import os

    from exl3tool.checkpoint import open_checkpoint, plan_layers, resolve_overlay
    from exl3tool.checkpoint.overrides import parse_hf_overrides
    from exl3tool.errors import Exl3ToolError
    from exl3tool.operations.hydrate import stored_only_reason

    if not os.path.isdir(os.path.expanduser(request.model)):
        return None
    start = time.perf_counter()
    try:
        checkpoint = open_checkpoint(request.model, hf_overrides=parse_hf_overrides(request.hf_overrides))
        layer_plan = plan_layers(checkpoint, overlay=resolve_overlay(request.quantization_config,
                                                                     shared_experts=request.shared_experts),
                                 layers=list(request.layers) or None, exclude=list(request.exclude) or None,
                                 language_model_only=request.language_model_only, release=request.release)
    except Exl3ToolError:
        return None  # prepare says it, as for any check
    for tp in request.tp_sizes:  # vLLM cannot split the model there: that is the answer, whatever is stored
        problem = layer_plan.shard_problem(tp)
        if problem:
            raise ConfigError(problem)
    why = stored_only_reason(layer_plan, tuple(request.tp_sizes))
    if not why:
        return None
    record = _hydrate_record(request)
    failures, unknown = stored_failures(layer_plan, record, tuple(request.tp_sizes), checkpoint.model)
    root = request.cache_root(environ)
    plan = LookupPlan(model=checkpoint.model, model_identity="", encoder_identity="", bits=request.bits,
                    tp_sizes=tuple(request.tp_sizes), cache_root=root, mode="readonly", jobs=(), layer_plan=layer_plan)
    splits, note = release_rules(request, checkpoint.config, environ, lookups=False)
    return CheckReport(plan, _resolved_dtype(request, checkpoint), tuple(_unplanned_causes(plan)),
                       tuple(_launch_notes(environ)), {o: 0 for o in ORIGINS}, (), round(time.perf_counter() - start, 4),
                       stored=why, start_failures=tuple(failures), server_release=request.release.name,
                       release=request.release_choice, cannot_tell=tuple(unknown), hydrated=record,
                       release_splits=splits, release_note=note)


def _unplanned_causes(plan: LookupPlan) -> list[Cause]:
    """Look-ups the server makes that the plan cannot hold, each a predicted miss: modules it encodes online that
    exl3tool does not model (a vision tower the overlay does not ignore), and a plan the server never looks up
    (generic ``--layers`` mode)."""
    lp = plan.layer_plan
    if lp is None:
        return []
    out = [Cause("unplanned", ("not_modelled",), (), (Finding(
        "not_modelled", f"{e.prefix}: {e.detail}",
        "ignore these modules in the server's --quantization-config, or accept that the server encodes them at "
        "start-up (these look-ups miss)"),)) for e in lp.excluded if e.reason == "not_modelled"]
    if not lp.server_lookup:
        why = "; ".join(lp.notes) or "the checkpoint is not one the fork serves online"
        out.append(Cause("unplanned", ("server_lookup",), (), (Finding(
            "server_lookup", f"the server looks none of these layers up: {why}",
            "check a checkpoint and launch the fork encodes online (an EXL3 checkpoint of a served family)"),)))
    return out


def _has_checksum(path: Path) -> bool:
    """Whether an entry's header carries ``exl3tool_sha256`` (written by exl3tool, not the server)."""
    import struct

    from exl3tool.jsontext import loads_json

    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = loads_json(fh.read(min(n, 1 << 20)))
        return "exl3tool_sha256" in (header.get("__metadata__") or {})
    except (OSError, ValueError, struct.error, AttributeError):
        return False


def _miss_causes(misses: list[LookupJob], plan: LookupPlan, cache: _Cache) -> list[Cause]:
    groups: dict[tuple, list[tuple[LookupJob, Optional[Present]]]] = defaultdict(list)
    for j in misses:
        same = cache.slot.get((j.prefix, j.tp_size, j.tp_rank))
        if same:
            near = cache.nearest(j.key, same)
            fields = _differs(j.key, near.key)
            group = ("slot", fields, near.key.model_identity, near.key.encoder_identity, near.key.bits, near.origin)
        elif cache.prefix.get(j.prefix):
            near = cache.nearest(j.key, cache.prefix[j.prefix], ignore_shape=True)
            sizes = tuple(sorted({p.key.tp_world_size for p in cache.prefix[j.prefix]}))
            fields = ("tp_layout",) + tuple(f for f in _differs(j.key, near.key) if f != "shape")
            group = ("tp", fields, sizes, near.key.model_identity, near.key.encoder_identity, near.key.bits)
        else:
            near, group = None, ("layers",)
        groups[group].append((j, near))
    digest = overlay_digest(plan.layer_plan.overlay.as_json()) if plan.layer_plan and plan.layer_plan.overlay else None
    causes = []
    layers = groups.pop(("layers",), [])
    aligned_here_only, rest = _unaligned_when_warmed([j for j, _ in layers], plan, cache)
    for sizes, jobs in aligned_here_only.items():
        tps = ",".join(map(str, sorted({j.tp_size for j in jobs})))
        warmed = ",".join(map(str, sizes))
        prefixes = sorted({j.prefix for j in jobs})
        causes.append(Cause("miss", ("tp_layout",), tuple(jobs), (Finding(
            "tp_layout", f"{plural(len(prefixes), 'layer')} (e.g. {_more(prefixes)}) are 128-aligned at TP {tps} "
                         f"but not at TP {warmed}, the TP size(s) warmed, where the server keeps them MXFP8: the "
                         "warm had nothing to encode for them",
            f"warm with --tp-size {tps} (add it to the warm's list)"),)))
    if rest:
        groups[("layers",)] = [(j, None) for j in rest]
    for group, items in groups.items():
        jobs = [j for j, _ in items]
        first, near = items[0]
        if group[0] == "layers":
            found = _overlay_findings(jobs, plan, cache, digest)
            causes.append(Cause("miss", tuple(dict.fromkeys(f.field for f in found)), tuple(jobs), tuple(found)))
            continue
        fields = group[1]
        findings = []
        if group[0] == "tp":
            sizes = group[2]
            findings.append(Finding("tp_layout", f"these layers were warmed at TP {','.join(map(str, sizes))} only; "
                                                 f"these look-ups are at TP {first.tp_size}",
                                    f"warm with --tp-size {first.tp_size} (add it to the warm's list)"))
        findings += _identity_findings(fields, first.key, near, plan, cache)
        if not fields:  # same key, yet the look-up missed: a file the server's is_file() does not see
            findings.append(Finding("path", "an entry with this very key exists elsewhere", "check the cache root"))
        causes.append(Cause("miss", fields, tuple(jobs), tuple(findings), near))
    return causes


def _warmed_tp_sizes(plan: LookupPlan, cache: _Cache) -> tuple[int, ...]:
    """The TP sizes this model was warmed at, by the entries present and the records of its identity."""
    sizes = {p.key.tp_world_size for p in cache.present if p.key.model_identity == plan.model_identity}
    for sr in cache.by_model.values():
        if sr.record is not None and sr.record.model_identity == plan.model_identity:
            sizes.update(sr.record.settings.tp_sizes)
    return tuple(sorted(sizes))


def _unaligned_when_warmed(jobs: list[LookupJob], plan: LookupPlan,
                           cache: _Cache) -> tuple[dict[tuple[int, ...], list[LookupJob]], list[LookupJob]]:
    """Split look-ups of layers no entry holds: those the warm's TP sizes left unencoded because the layer is not
    128-aligned there (the fix is the TP size, not the overlay), keyed by those sizes, and the rest."""
    lp = plan.layer_plan
    warmed = tuple(t for t in _warmed_tp_sizes(plan, cache) if t not in plan.tp_sizes)
    if lp is None or not warmed or not jobs:
        return {}, jobs
    unaligned: dict[int, set[str]] = {}
    for t in warmed:
        try:
            unaligned[t] = {prefix for prefix, _, _ in lp.skipped(t)}
        except Exception:  # a TP size this plan cannot shard (heads not divisible): it tells nothing here
            unaligned[t] = set()
    by_sizes: dict[tuple[int, ...], list[LookupJob]] = defaultdict(list)
    rest = []
    for j in jobs:
        if all(j.prefix in unaligned[t] for t in warmed):
            by_sizes[warmed].append(j)
        else:
            rest.append(j)
    return dict(by_sizes), rest


def _server_causes(jobs: list[LookupJob], plan: LookupPlan, cache: _Cache) -> list[Cause]:
    """Entries the server wrote itself at this launch's look-ups, and which key fields separate them from the warm's."""
    groups: dict[tuple, list[tuple[LookupJob, Present, Optional[Present]]]] = defaultdict(list)
    for j in jobs:
        found = cache.slot.get((j.prefix, j.tp_size, j.tp_rank), [])
        server = [p for p in found if p.origin == "server"]
        ours = [p for p in found if p.origin != "server"]
        if not server:
            continue
        newest = max(server, key=lambda p: p.mtime)
        warm = cache.nearest(newest.key, ours) if ours else None
        fields = _differs(newest.key, warm.key) if warm is not None else ()
        groups[(fields, newest.key.model_identity, warm.key.model_identity if warm else None)].append((j, newest, warm))
    causes = []
    for (fields, _, _), items in groups.items():
        j, server, warm = items[0]
        when = _dt.datetime.fromtimestamp(max(s.mtime for _, s, _ in items), _dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
        if warm is None:
            findings = [Finding("server_written", f"the server wrote these entries itself (newest {when} UTC); no "
                                                  "entry exl3tool wrote is there for these layers",
                                "warm these layers with exl3tool so the cache holds checked entries")]
        else:
            when_warm = f"the warm's ({_who(warm)})"
            findings = [Finding("server_written", f"the server wrote these entries itself (newest {when} UTC): their "
                                                  f"keys differ from {when_warm} in "
                                                  f"{', '.join(f.replace('_', ' ') for f in fields) or 'nothing'}",
                                "the server missed the warm's entries and encoded these; fix the cause below (or "
                                "warm with the server's settings), then the warm's unused entries can go: "
                                f"exl3tool cache prune --model {warm.key.model_identity[:20]} --older-than 0")]
            findings += _identity_findings(fields, server.key, warm, plan, cache, here="in the server's entries",
                                           there="in the warm's")
        causes.append(Cause("server_written", ("server_written",) + fields, tuple(j for j, _, _ in items),
                            tuple(findings), server))
    return causes


def _dtype_notes(lookups: list[LookupJob], records: list[StoredRecord], plan: LookupPlan, dtype: str) -> list[Finding]:
    """Hits encoded from weights cast to another dtype: the server loads them, but would encode others itself."""
    hits = {j.digest for j in lookups if j.state == "hit"}
    other: dict[tuple[str, str], int] = defaultdict(int)
    for sr in records:
        r = sr.record
        if r is None or r.model_identity != plan.model_identity or r.settings.dtype == dtype:
            continue
        n = len(hits & r.digests)
        if n:
            other[(r.settings.dtype, r.time)] += n
    return [Finding("dtype", f"{n} hit(s) were encoded from {d} weights (warm of {t}); this launch serves {dtype}",
                    f"the server loads them as they are; warm again with --dtype {dtype} for the weights it would "
                    "encode itself") for (d, t), n in sorted(other.items())]


def _unplanned_notes(plan: LookupPlan, cache: Optional[_Cache], records: list[StoredRecord]) -> list[Finding]:
    """The other way round: layers warmed for these identities, bits and TP sizes that this launch does not plan
    (from the entries present when the cache was indexed, else from the records)."""
    planned = {j.prefix for j in plan.jobs}
    if cache is not None:
        found = {(p.key.prefix, p.key.model_identity, p.key.encoder_identity, p.key.bits, p.key.tp_world_size)
                 for p in cache.present}
    else:
        found = {(e.prefix, sr.record.model_identity, sr.record.encoder_identity, sr.record.settings.bits, e.tp_size)
                 for sr in records if sr.record is not None for e in sr.record.entries}
    extra = sorted({prefix for prefix, mid, eid, bits, tp in found
                    if (mid, eid, bits) == (plan.model_identity, plan.encoder_identity, plan.bits)
                    and tp in plan.tp_sizes and prefix not in planned})
    if not extra:
        return []
    return [Finding("overlay", f"{len(extra)} layer(s) warmed that this launch does not plan (e.g. {_more(extra)})",
                    "harmless (unused entries); if the server should encode them, start it with the warm's "
                    "--quantization-config")]


def _parity_notes(lookups: list[LookupJob], records: list[StoredRecord], plan: LookupPlan) -> list[Finding]:
    """Hits exl3tool wrote under an encoder identity whose parity with exl3tool's encoder is not proved
    (``operations.parity``: unverified, or written with --trust-encoder-identity although it differs)."""
    from exl3tool.operations.parity import parity_line, recorded_parity

    hits = [j.digest for j in lookups if j.state == "hit"]
    out = []
    for item in recorded_parity(records, plan.model_identity, plan.encoder_identity, hits):
        if item["status"] != "identical":
            what, fix = parity_line(item)
            out.append(Finding("encoder_parity", what, fix))
    return out
