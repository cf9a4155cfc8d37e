"""A whole-cache scan for the ``cache`` commands, and prune plans built from it.

Every entry is checked as the server would load it (via the same validator as ``CacheStore``), plus
what only an offline tool can see: the stored key's digest against the file name, the directory it
sits in, and our own tensor checksum. Temporary files and lock files are listed too; a lock path that is
not a regular file (a directory, a symlink) is reported, since no writer can take that entry's lock.
Symlinked directories are listed, never entered, so a prune never reaches outside the cache.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import hashlib
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

from exl3tool.cache.entry import describe_unreadable, judge_entry, parse_proxy_error
from exl3tool.cache.key import CacheKey
from exl3tool.cache.locks import lock_path_unusable
from exl3tool.cache.paths import ENTRY_RE, LAYOUT_RE, LOCK_RE, TEMP_RE, layout_parts, link_problem, lock_path

__all__ = ["EntryInfo", "CacheHealth", "iso_utc", "PrunePlan", "scan", "inspect_entry", "plan_prune", "execute_prune", "PruneResult", "lock_is_held", "matches_model"]


@dataclass(frozen=True)
class EntryInfo:
    """One file under ``<root>/v1``: ``kind`` entry|temp|lock|stray.

    ``status`` for entries, deep scan: ``judge_entry``'s verdict (``valid``, ``unchecked``: the server loads it but it
    carries no exl3tool checksum, or ``invalid``); a header-only scan calls a well-formed entry ``unchecked`` (not
    loaded). For lock files ``invalid`` when the lock path is not a regular file, else ``n/a``; for a symlinked
    folder below the root (kind ``stray``, ``is_symlink``) ``invalid``.
    ``loadable``: whether the server would load the entry (None when not known, e.g. header-only).
    ``held`` (temps and orphan locks): whether a live process holds the entry lock; stale when it does not.
    """

    path: Path
    kind: str
    size: int
    mtime: float
    digest: str | None = None
    model_dir: str | None = None
    tp_world_size: int | None = None
    tp_rank: int | None = None
    status: str = "n/a"
    reason: str = ""
    key: CacheKey | None = None
    prefix: str | None = None
    model_identity: str | None = None
    proxy_error: float | None = None
    sha256_ok: bool | None = None
    is_symlink: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    orphan: bool = False
    loadable: bool | None = None
    covers: str | None = None  # entries, deep scan: what exl3tool's checksums cover (``checksum_covers``)
    held: bool | None = None  # temps and locks: whether a live process holds the entry lock

    @property
    def valid(self) -> bool:
        return self.kind == "entry" and self.status == "valid"

    def as_json(self) -> dict[str, Any]:
        """The stable JSON form of one scanned file, as `cache show|verify|prune --json` give it (docs/cache.md)."""
        return {
            "path": str(self.path),
            "kind": self.kind,
            "digest": self.digest,
            "status": self.status,
            "reason": self.reason,
            "size": self.size,
            "mtime": self.mtime,
            "mtime_utc": iso_utc(self.mtime),
            "model_dir": self.model_dir,
            "model_identity": self.model_identity,
            "tp_world_size": self.tp_world_size,
            "tp_rank": self.tp_rank,
            "prefix": self.prefix,
            "proxy_error": self.proxy_error,
            "sha256_ok": self.sha256_ok,
            "is_symlink": self.is_symlink,
            "orphan": self.orphan,
            "server_loads": self.loadable,
            "key": self.key.as_dict() if self.key else None,
            "checksum_covers": self.covers,
            "held": self.held,
        }


    def show_json(self) -> dict[str, Any]:
        """The `cache show --json` document: ``as_json()``, each tensor's dtype and shape (none when the file
        cannot be read as safetensors: ``status`` says why) and the header's metadata."""
        tensors: dict[str, Any] = {}
        try:
            with safe_open(str(self.path), framework="pt", device="cpu") as fh:
                for name in fh.keys():
                    sl = fh.get_slice(name)
                    tensors[name] = {"dtype": sl.get_dtype(), "shape": list(sl.get_shape())}
        except Exception:
            pass
        return {**self.as_json(), "tensors": tensors, "metadata": self.metadata}


def iso_utc(ts: float) -> str:
    """An mtime as UTC ISO 8601 with milliseconds and ``Z``, as provenance records write their times."""
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass(frozen=True)
class CacheHealth:
    """What `cache verify` finds in a scan: entries by verdict, and the lock, temp and stray files beside them."""

    root: Path
    entries: tuple[EntryInfo, ...]
    unchecked: tuple[EntryInfo, ...]  # the server loads them; no exl3tool checksum to check them with
    invalid: tuple[EntryInfo, ...]
    broken_locks: tuple[EntryInfo, ...]  # lock paths that are not regular files
    temp_files: tuple[EntryInfo, ...]
    orphan_locks: tuple[EntryInfo, ...]
    stale_locks: tuple[EntryInfo, ...]  # orphan locks no live process holds
    stray_files: tuple[EntryInfo, ...]
    links: tuple[EntryInfo, ...]  # symlinked folders below the root

    @classmethod
    def of(cls, root: Path, infos: list[EntryInfo]) -> "CacheHealth":
        """Sort a deep scan's files (already filtered, e.g. by model) into the report."""
        entries = [i for i in infos if i.kind == "entry"]
        orphans = [i for i in infos if i.kind == "lock" and i.orphan and i.status != "invalid"]
        strays = [i for i in infos if i.kind == "stray"]
        return cls(
            root=root, entries=tuple(entries),
            unchecked=tuple(i for i in entries if i.status == "unchecked"),
            invalid=tuple(i for i in entries if i.status == "invalid"),
            broken_locks=tuple(i for i in infos if i.kind == "lock" and i.status == "invalid"),
            temp_files=tuple(i for i in infos if i.kind == "temp"),
            orphan_locks=tuple(orphans), stale_locks=tuple(i for i in orphans if not i.held),
            stray_files=tuple(strays), links=tuple(i for i in strays if i.is_symlink and i.status == "invalid"),
        )

    @property
    def valid(self) -> list[EntryInfo]:
        return [i for i in self.entries if i.status == "valid"]

    @property
    def ok(self) -> bool:
        """Nothing the server would fail on: no invalid entry, no broken lock path, no symlinked folder."""
        return not (self.invalid or self.broken_locks or self.links)

    def as_json(self) -> dict[str, Any]:
        """The `cache verify --json` document (docs/cache.md)."""
        return {
            "root": str(self.root),
            "entries": len(self.entries),
            "valid": len(self.valid),
            "unchecked": [i.as_json() for i in self.unchecked],
            "invalid": [i.as_json() for i in self.invalid],
            "broken_locks": [i.as_json() for i in self.broken_locks],
            "temp_files": [i.as_json() for i in self.temp_files],
            "orphan_locks": [i.as_json() for i in self.orphan_locks],
            "stray_files": [i.as_json() for i in self.stray_files],
            "stale_locks": [i.as_json() for i in self.stale_locks],
            "links": [i.as_json() for i in self.links],
        }


def _stat(path: Path) -> tuple[int, float]:
    try:
        st = path.lstat()
        size = st.st_size
        if path.is_dir() and not path.is_symlink():
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return size, st.st_mtime
    except OSError:
        return 0, 0.0


def _check_entry(path: Path, digest: str, model_dir: str | None, world: int | None, rank: int | None, deep: bool) -> dict:
    """Status, reason, key and details of one entry file; never raises.

    ``deep`` runs the server's full load (§5.3) and our checksum; otherwise only the header is read and a
    well-formed entry gets status ``unchecked``.
    """
    out: dict = {"status": "invalid", "is_symlink": path.is_symlink()}
    if path.is_symlink() and not path.exists():
        out["reason"] = f"dangling symlink to {os.readlink(path)}"
        return out
    if path.is_dir():
        out["reason"] = "a directory where the entry file should be"
        return out
    if not path.is_file():
        out["reason"] = "not a regular file"
        return out
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            metadata = dict(fh.metadata() or {})
    except Exception as exc:
        out["reason"] = describe_unreadable(path, exc)
        return out
    out["metadata"] = metadata
    stored = metadata.get("cache_key")
    if stored is None:
        out["reason"] = "no cache_key metadata"
        return out
    try:
        key = CacheKey.from_json(stored)
    except Exception as exc:
        out["reason"] = f"cache_key is not a valid key ({exc})"
        return out
    out.update(key=key, prefix=key.prefix, model_identity=key.model_identity)
    try:
        out["proxy_error"] = parse_proxy_error(metadata.get("proxy_error"))
    except ValueError:
        pass
    if key.canonical_json() != stored:
        out["reason"] = "cache_key is not in canonical form; the server never matches it"
        return out
    if hashlib.sha256(stored.encode("utf-8")).hexdigest() != digest:
        out["reason"] = "file name is not the digest of the stored cache_key"
        return out
    if model_dir is not None and layout_parts(key.model_identity, key.tp_world_size, key.tp_rank)[1:] != (
            model_dir, f"tp{world}-rank{rank}"):
        out["reason"] = "entry sits in the wrong model or tp directory for its key"
        return out
    if not deep:
        out["status"] = "unchecked"
        out["reason"] = ""
        return out
    verdict = judge_entry(path, None if model_dir is not None else key)  # the one rule every command applies
    out.update(loadable=verdict.loadable, sha256_ok=verdict.sha256_ok, covers=verdict.covers)
    link = "; a symlink, the server follows it" if out["is_symlink"] else ""
    if verdict.status == "unchecked":
        out["status"] = "unchecked"
        out["reason"] = f"{verdict.reason}: exl3tool verify MODEL --exact checks them{link}"
    elif verdict.status == "invalid":
        out["reason"] = verdict.reason
        if verdict.loadable:
            out["reason"] += ": the server would load it, but it is not what exl3tool published for this key"
    else:
        out["status"] = "valid"
        out["reason"] = link.removeprefix("; ")
    return out


def _lock_problem(path: Path) -> str | None:
    """Why the lock path ``path`` cannot serve as a lock, or None (the store's rule: ``lock_path_unusable``)."""
    what = lock_path_unusable(path)
    return f"the lock path is {what}; no writer can take this entry's lock" if what else None


def inspect_entry(path: str | Path, *, deep: bool = True) -> EntryInfo:
    """One entry file anywhere: its layout is taken from its parent directories when they follow the template."""
    path = Path(path)
    em = ENTRY_RE.match(path.name)
    if em is None:
        raise ValueError(f"{path}: not an entry file name (<64-hex digest>.safetensors)")
    m = LAYOUT_RE.match(path.parent.name)
    world, rank = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    model_dir = path.parent.parent.name if m else None
    size, mtime = _stat(path)
    details = _check_entry(path, em.group(1), model_dir, world, rank, deep)
    return EntryInfo(
        path=path, kind="entry", size=size, mtime=mtime, digest=em.group(1), model_dir=model_dir,
        tp_world_size=world, tp_rank=rank, **details,
    )


def scan(root: str | Path, *, deep: bool = True) -> list[EntryInfo]:
    """Every entry, temp, lock and stray file under ``<root>/v1/<id20>/tp<W>-rank<R>/``, sorted by path.

    ``deep=False`` reads only headers (fast listing); ``deep=True`` loads every entry as the server would.
    """
    base = Path(root) / "v1"
    infos: list[EntryInfo] = []

    def link(p: Path) -> EntryInfo:
        """A symlinked folder below the root: listed, never entered (a prune must not reach outside the cache);
        ``invalid``, since the server follows it but exl3tool neither sees its entries nor writes through it."""
        size, mtime = _stat(p)
        return EntryInfo(path=p, kind="stray", size=size, mtime=mtime, is_symlink=True, status="invalid",
                         reason=f"{link_problem(root, p / 'x')}; not followed")

    if base.is_symlink():
        return [link(base)]
    if not base.is_dir():
        return infos

    def subdirs(parent: Path) -> list[Path]:
        found = []
        for p in sorted(parent.iterdir()):
            if p.is_symlink() and p.is_dir():
                infos.append(link(p))
            elif p.is_dir():
                found.append(p)
        return found

    for model_dir in subdirs(base):
        for layout_dir in subdirs(model_dir):
            m = LAYOUT_RE.match(layout_dir.name)
            world, rank = (int(m.group(1)), int(m.group(2))) if m else (None, None)
            names = set(os.listdir(layout_dir))
            for name in sorted(names):
                path = layout_dir / name
                size, mtime = _stat(path)
                common = dict(path=path, size=size, mtime=mtime, model_dir=model_dir.name, tp_world_size=world, tp_rank=rank)
                if (em := ENTRY_RE.match(name)) and m:
                    details = _check_entry(path, em.group(1), model_dir.name, world, rank, deep)
                    infos.append(EntryInfo(kind="entry", digest=em.group(1), **common, **details))
                elif lm := LOCK_RE.match(name):
                    orphan = f"{lm.group(1)}.safetensors" not in names
                    problem = _lock_problem(path)
                    held = lock_is_held(path) if orphan and not problem else None  # a lock beside its entry is normal
                    infos.append(EntryInfo(kind="lock", digest=lm.group(1), orphan=orphan, **common,
                                           status="invalid" if problem else "n/a", reason=problem or "",
                                           is_symlink=path.is_symlink(), held=held))
                elif tm := TEMP_RE.match(name):
                    held = lock_is_held(layout_dir / f"{tm.group(1)}.safetensors.lock")
                    infos.append(EntryInfo(kind="temp", digest=tm.group(1), held=held, **common,
                                           reason="a live writer's temporary file (its entry lock is held)" if held
                                           else "leftover temporary file (a killed writer's; no live process holds its entry lock)"))
                else:
                    infos.append(EntryInfo(kind="stray", reason="not a cache file", **common))
    return infos


def lock_is_held(path: Path) -> bool:
    """Whether someone holds ``flock`` on the lock file ``path``; never creates it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # never a link's target; a FIFO never blocks
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
    finally:
        os.close(fd)  # closing drops a lock we took
    return False


def matches_model(info: EntryInfo, model: str | None) -> bool:
    """``model`` is a full model identity or a hex prefix of it."""
    if model is None:
        return True
    model = model.lower()
    if info.model_identity is not None:
        return info.model_identity.startswith(model)
    return info.model_dir is not None and (info.model_dir.startswith(model) or model.startswith(info.model_dir))


@dataclass(frozen=True)
class PrunePlan:
    """Files a prune would delete, with the reason for each, and the bytes freed; executed separately."""

    items: tuple[tuple[EntryInfo, str], ...]
    skipped: tuple[tuple[EntryInfo, str], ...]

    @property
    def bytes_freed(self) -> int:
        return sum(info.size for info, _ in self.items)


def _entry_file(info: EntryInfo) -> Path:
    """The entry file a scanned entry, temp or lock file belongs to (by its digest, in its directory)."""
    return info.path.parent / f"{info.digest}.safetensors"


def plan_prune(
    infos: list[EntryInfo],
    *,
    invalid: bool = False,
    temp: bool = False,
    older_than_days: float | None = None,
    model: str | None = None,
    now: float | None = None,
) -> PrunePlan:
    """Choose what to delete: invalid entries, leftovers (temps, unheld orphan locks), entries older than N days.

    Lock files of entries that stay are never touched, except a lock path that is not a regular file
    (``invalid``: a directory or symlink no writer can lock), which ``invalid`` removes (a symlink itself,
    never its target); a temp file whose entry lock is held belongs to a live writer and is skipped.
    """
    now = time.time() if now is None else now
    cutoff = None if older_than_days is None else now - older_than_days * 86400
    chosen: list[tuple[EntryInfo, str]] = []
    skipped: list[tuple[EntryInfo, str]] = []
    removed_entries: set[Path] = set()
    for info in infos:
        if not matches_model(info, model):
            continue
        old = cutoff is not None and info.mtime < cutoff
        if info.kind == "entry":
            if invalid and info.status == "invalid" and (cutoff is None or old):
                chosen.append((info, f"invalid: {info.reason}"))
                removed_entries.add(info.path)
            elif old and (not invalid or info.status == "invalid"):
                chosen.append((info, f"older than {older_than_days:g} days"))
                removed_entries.add(info.path)
        elif info.kind == "stray" and info.is_symlink and info.status == "invalid" and invalid:
            chosen.append((info, "invalid: a symlinked folder below the cache root (the link only; never its target)"))
        elif info.kind == "temp" and temp and (cutoff is None or old):
            entry_lock = lock_path(_entry_file(info))
            if lock_is_held(entry_lock):
                skipped.append((info, "a writer holds the entry lock"))
            else:
                chosen.append((info, "leftover temporary file"))
    for info in infos:
        if info.kind != "lock" or not matches_model(info, model):
            continue
        if info.status == "invalid":
            if invalid:
                chosen.append((info, f"invalid: {info.reason}"))
            continue
        entry = _entry_file(info)
        if (info.orphan and temp) or entry in removed_entries:
            if lock_is_held(info.path):
                skipped.append((info, "lock is held"))
            else:
                chosen.append((info, "lock of a removed entry" if entry in removed_entries else "orphan lock file"))
    return PrunePlan(tuple(chosen), tuple(skipped))


@dataclass(frozen=True)
class PruneResult:
    """What ``execute_prune`` did: bytes freed, one line per file it could not remove, and per file it kept
    because it changed since the plan (a writer published over it, e.g. while the user read the prompt)."""

    freed: int
    errors: tuple[str, ...]
    kept: tuple[str, ...]


def _changed_since_plan(info: EntryInfo) -> str | None:
    """Why ``info``'s file must stay: a writer holds its entry lock, or its size/mtime differ from the scan."""
    if info.kind in ("entry", "temp") and info.digest:
        if lock_is_held(lock_path(_entry_file(info))):
            return "a writer holds its entry lock now"
    if info.kind == "lock" and not info.status == "invalid" and lock_is_held(info.path):
        return "the lock is held now"
    try:
        st = os.lstat(info.path)
    except FileNotFoundError:
        return None
    except OSError:
        return None  # the removal reports it
    if info.kind != "stray" and not stat.S_ISDIR(st.st_mode) and (st.st_size, st.st_mtime) != (info.size, info.mtime):
        return "it changed since the plan was made"
    return None


def execute_prune(plan: PrunePlan) -> PruneResult:
    """Delete the plan's files, re-checking each just before: one a writer holds or replaced since the scan
    stays (``kept``); ``errors`` has one line per file that could not be removed."""
    freed, errors, kept = 0, [], []
    kept_entries: set[Path] = set()
    for info, _ in plan.items:  # entries come before locks in a plan
        why = _changed_since_plan(info)
        if why is None and info.kind == "lock" and _entry_file(info) in kept_entries:
            why = "its entry was kept"
        if why:
            kept.append(f"{info.path}: {why}; left in place")
            if info.kind == "entry":
                kept_entries.add(info.path)
            continue
        try:
            if info.path.is_dir() and not info.path.is_symlink():
                shutil.rmtree(info.path)
            else:
                info.path.unlink(missing_ok=True)
            freed += info.size
        except OSError as exc:
            errors.append(f"{info.path}: {exc.strerror or exc}")
    return PruneResult(freed, tuple(errors), tuple(kept))
