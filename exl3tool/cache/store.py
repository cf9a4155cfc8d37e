"""The cache as the server uses it: look-up, atomic publish and ``load_or_encode`` per mode (docs/cache-format.md §1.5).

Correctness rests on the atomic rename, not on the lock: ``flock`` can be a no-op on network
filesystems, in which case two writers may both encode, but a reader still only ever sees a complete
file. The lock only saves duplicate work.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import torch
from filelock import FileLock, Timeout

from exl3tool.cache.entry import (
    Exl3OnlineNonFiniteError, InvalidEntryError, atomic_write, check_fresh_encode, judge_entry, write_entry,
)
from exl3tool.cache.key import CacheKey
from exl3tool.cache.locks import acquire_with_notice, lock_path_unusable
from exl3tool.cache.paths import TEMP_RE, entry_path, link_problem, lock_path
from exl3tool.cache.settings import CACHE_MODES
from exl3tool.format.encoded import EncodedLinear
from exl3tool.errors import InputError, describe

__all__ = ["CacheStore", "Claim", "Lookup", "LoadResult", "LOCK_TIMEOUT_S", "UNCHECKED_HIT", "Exl3OnlineNonFiniteError", "PRUNE_HINT",
           "entry_obstacle"]

LOCK_TIMEOUT_S = 600.0
PRUNE_HINT = "remove it with: exl3tool cache prune --invalid"
log = logging.getLogger(__name__)


def _mib(n: int) -> str:
    """``n`` bytes for people, exact below 1 MiB.

    >>> _mib(1536), _mib(5 * 2**20 + 1)
    ('1536 bytes', '5.0 MiB')
    """
    return f"{n} bytes" if n < 2**20 else f"{n / 2**20:.1f} MiB"


def entry_obstacle(path: Path, root: Path | None = None) -> str | None:
    """What at ``path`` (an entry file) or its lock path makes every publish fail, or None; never follows a link.

    With ``root`` (the cache root) also a symlinked folder between the root and the entry: nothing is written
    through it (``link_problem``).
    A directory at the entry path (``os.replace`` cannot replace it) and a directory, symlink (filelock refuses
    to follow it) or socket at the lock path (the lock cannot be opened). A symlink or FIFO at the entry path
    is no obstacle: publishing replaces it.
    """
    if root is not None:
        problem = link_problem(root, path)
        if problem:
            return problem
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            return f"{path} is a directory where the entry file should be; no warm can replace it"
    except OSError:
        pass
    lock = lock_path(path)
    what = lock_path_unusable(lock)
    return f"{lock} (the entry's lock path) is {what}, so no writer can take the entry lock" if what else None


def _not_about_the_file(exc: BaseException) -> bool:
    """A failure to load an entry that is this host's, not the file's: out of memory, an I/O error, no file
    descriptors. ``claim`` then leaves the entry alone (and raises) instead of deleting a file it could not read."""
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.EIO, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EAGAIN)


UNCHECKED_HIT = ("valid for the server; no exl3tool_sha256 (server-written?), so its weights are unchecked: "
                 "exl3tool verify MODEL --exact (or cache warm --check-unchecked) checks them")


@dataclass(frozen=True)
class Lookup:
    """``status`` hit|miss|invalid; ``reason`` for people; tensors and proxy error only on a hit.

    ``checked`` (hits only): the entry carries ``exl3tool_sha256`` and its bytes matched it; False for a hit
    without it (server-written), whose weights only ``exl3tool verify`` can check.
    """

    status: str
    reason: str
    path: Path | None
    tensors: dict[str, torch.Tensor] | None = None
    proxy_error: float | None = None
    checked: bool | None = None
    metadata: dict[str, str] | None = None  # hits: the entry's metadata (e.g. its platform record)

    @property
    def hit(self) -> bool:
        return self.status == "hit"


@dataclass(frozen=True)
class LoadResult:
    """The layer's weights: from the cache (``hit``) or a fresh encode (``encoded`` set, ``path`` None if unpublished).

    ``error`` says why a fresh encode was not published (lock or write failure), for people; ``errno`` is the
    OS error number of a failed write (ENOSPC: the cache's filesystem is full).
    """

    hit: bool
    path: Path | None
    tensors: dict[str, torch.Tensor]
    proxy_error: float | None
    encoded: EncodedLinear | None
    error: str | None = None
    errno: int | None = None


class Claim:
    """An entry lock held by ``CacheStore.claim`` with no valid entry under it: publish with
    ``CacheStore.publish_claimed`` (which releases it) or ``release`` it."""

    def __init__(self, key: CacheKey, path: Path, lock) -> None:
        self.key = key
        self.path = path
        self._lock = lock
        self._held = True

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        """Release the entry lock; a second call does nothing."""
        if self._held:
            self._held = False
            self._lock.__exit__(None, None, None)


def file_mode_problem(file_mode: int) -> str:
    """Why ``file_mode`` cannot be an entry's permissions, or "": the server must read the file (owner read at
    least), the cache must stay trusted (no group/world write), and only permission bits apply (no setuid etc.)."""
    if not 0 <= file_mode <= 0o777:
        return "has bits beyond the permissions 0000-0777 (setuid, setgid, sticky)"
    if not file_mode & 0o400:
        return "lacks owner read; no server could load such an entry"
    if file_mode & 0o022:
        return "is group/world-writable; the cache must stay trusted"
    return ""


class CacheStore:
    """One cache root in one mode (``off``, ``readonly``, ``readwrite``).

    ``file_mode`` sets published files' permissions (server: 0o600); the lock file gets the same
    bits without group/other write, so it is never world-writable.
    """

    def __init__(
        self,
        root: str | Path,
        mode: str = "readwrite",
        *,
        file_mode: int = 0o600,
        lock_timeout: float = LOCK_TIMEOUT_S,
        verify_checksum: bool = True,
    ) -> None:
        if mode not in CACHE_MODES:
            raise ValueError(f"cache mode must be off, readonly, or readwrite; got {mode!r}")
        problem = file_mode_problem(file_mode)
        if problem:
            raise ValueError(f"file_mode {oct(file_mode)} {problem}")
        self.root = Path(root)
        self.mode = mode
        self.file_mode = file_mode
        self.lock_timeout = lock_timeout
        self.verify_checksum = verify_checksum

    def check_writable(self) -> None:
        """Create the root if needed, then write and remove a file there; InputError naming the cause if that fails.

        A warm calls this before its first encode, so a read-only mount, a file in the way or missing permissions
        cost a second, not every layer's encode.
        """
        if self.root.exists() and not self.root.is_dir():
            raise InputError(f"cache directory {self.root} is not a directory; pass a directory as --cache-dir")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".exl3tool-write-check-", dir=self.root)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise InputError(f"cache directory {self.root} is not writable ({describe(exc)}); pass a writable "
                             "--cache-dir or fix its permissions") from None

    def check_free_space(self, needed: int, entries: int) -> None:
        """InputError (exit 2) when the cache's filesystem has fewer free bytes than ``needed`` (the ``entries``
        a warm will write, see ``entry_bytes``): a full disk costs a second, not every layer's encode."""
        try:
            free = shutil.disk_usage(self.root).free  # what this user may write (statvfs f_bavail)
        except OSError as exc:
            raise InputError(f"cache directory {self.root}: cannot read its free space ({describe(exc)})") from None
        if free < needed:
            raise InputError(
                f"cache directory {self.root}: {_mib(free)} free on its filesystem, but the plan writes {_mib(needed)} "
                f"({entries} entr{'y' if entries == 1 else 'ies'}); free space or pass another --cache-dir")

    def path(self, key: CacheKey) -> Path:
        """Where ``key``'s entry lives under this root."""
        return entry_path(key, self.root)

    def _load(self, path: Path, key: CacheKey, quick: bool = False, checksum: bool = True) -> Lookup:
        verdict = judge_entry(path, key, load_trellis=not quick, hash_tensors=self.verify_checksum and checksum)
        if verdict.status == "invalid":
            raise (Exl3OnlineNonFiniteError if verdict.nonfinite else InvalidEntryError)(verdict.reason)
        contents = verdict.contents
        assert contents is not None
        checked = verdict.status == "valid"
        reason = "valid entry" if checked else UNCHECKED_HIT
        return Lookup("hit", reason, path, contents.tensors, contents.proxy_error, checked, contents.metadata)

    def lookup(self, key: CacheKey, *, quick: bool = False, checksum: bool = True) -> Lookup:
        """The server's unlocked fast path, read-only: hit, miss (no regular file) or invalid (with reason).

        Like the server, a ``stat`` error other than not-found (e.g. EACCES on a directory) propagates.
        ``quick`` does not load the trellis into memory (a hit then carries suh and svh only) but, with
        ``checksum`` (and the store's ``verify_checksum``), still hashes its bytes from the file against
        ``exl3tool_sha256``: what a warm's plan uses, so that no hit with changed bytes is kept.
        ``checksum=False`` reads no trellis bytes: ``judge_entry`` without the tensor hash (every other rule holds).
        """
        if self.mode == "off":
            return Lookup("miss", "cache mode is off", None)
        path = self.path(key)
        if not path.is_file():
            return Lookup("miss", "no entry", path)
        try:
            return self._load(path, key, quick, checksum)
        except Exception as exc:  # any failure to read or validate makes the entry invalid, never an error
            return Lookup("invalid", describe(exc), path)

    def _lock(self, path: Path, cross_thread: bool = False) -> FileLock:
        lock_mode = (self.file_mode | 0o600) & ~0o022
        if cross_thread:  # held by one thread, released by another (filelock's holds are per thread by default)
            return FileLock(str(lock_path(path)), timeout=self.lock_timeout, mode=lock_mode, thread_local=False)
        return FileLock(str(lock_path(path)), timeout=self.lock_timeout, mode=lock_mode)

    def obstacle(self, key: CacheKey) -> str | None:
        """Why no publish of ``key`` can ever succeed under this root (see ``entry_obstacle``), or None."""
        return entry_obstacle(self.path(key), self.root)

    def _no_links(self, path: Path) -> None:
        """OSError (ELOOP) when a folder between the root and ``path`` is a symlink: checked before any folder is
        made, any lock taken or any file written, so nothing lands outside the cache through a link."""
        problem = link_problem(self.root, path)
        if problem:
            raise OSError(errno.ELOOP, problem)

    @staticmethod
    def _remove_stale_temps(path: Path) -> None:
        """Remove ``path``'s leftover temp files (``.<digest>.safetensors.*.tmp``); call with the entry lock held.

        Every writer (the server, exl3tool) writes its temp file under the entry lock, so with the lock held
        none is being written: they are a killed writer's leftovers. On a filesystem where ``flock`` is a
        no-op this can make a concurrent writer's publish fail; no reader ever sees a partial entry.
        """
        digest = path.name.removesuffix(".safetensors")
        try:
            names = os.listdir(path.parent)
        except OSError:
            return
        for name in names:
            m = TEMP_RE.match(name)
            if m is None or m.group(1) != digest:
                continue
            temp = path.parent / name
            try:
                if not stat.S_ISREG(os.lstat(temp).st_mode):
                    continue
                temp.unlink()
                log.info("Removed %s, a temp file left by a killed writer", temp)
            except OSError as exc:
                log.warning("Could not remove stale temp file %s: %s", temp, describe(exc))

    def publish(self, key: CacheKey, encoded: EncodedLinear) -> Path:
        """Check ``encoded`` like the server and write it atomically under the entry lock (replacing any file).

        Non-finite data is never published. Raises ``filelock.Timeout`` or ``OSError`` on failure.
        """
        tensors = encoded.tensors()
        check_fresh_encode(key, tensors, encoded.proxy_error)
        path = self.path(key)
        self._no_links(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock(path):
            self._remove_stale_temps(path)
            return write_entry(path, key, tensors, encoded.proxy_error, file_mode=self.file_mode,
                               platform=encoded.platform)

    def _encode(self, key: CacheKey, encode_fn: Callable[[], EncodedLinear]) -> EncodedLinear:
        encoded = encode_fn()
        check_fresh_encode(key, encoded.tensors(), encoded.proxy_error)
        return encoded

    @staticmethod
    def _fresh(encoded: EncodedLinear, path: Path | None) -> LoadResult:
        return LoadResult(False, path, encoded.tensors(), encoded.proxy_error, encoded)

    @staticmethod
    def _from_hit(found: Lookup) -> LoadResult:
        assert found.tensors is not None
        return LoadResult(True, found.path, found.tensors, found.proxy_error, None)

    def cached(self, key: CacheKey) -> LoadResult | None:
        """``load_or_encode``'s unlocked fast path: the entry as a hit when it is valid, else None.

        An invalid entry is logged and ignored. Like the server, a ``stat`` error other than not-found
        (e.g. EACCES) propagates. Mode off: always None.
        """
        if self.mode == "off":
            return None
        path = self.path(key)
        if path.is_file():  # unprotected, like the server: EACCES here propagates
            try:
                return self._from_hit(self._load(path, key))
            except Exception as exc:
                log.warning("Ignoring invalid online EXL3 cache entry %s: %s", path, exc)
        return None

    def claim(self, key: CacheKey, *, cross_thread: bool = False) -> Claim | LoadResult:
        """Take ``key``'s entry lock (readwrite only) and re-check under it.

        A valid entry found under the lock (another writer published meanwhile) comes back as a hit, with the
        lock released; an invalid one is logged and removed. Otherwise the lock stays held and comes back as a
        ``Claim``: encode, then ``publish_claimed`` (or ``Claim.release``). ``cross_thread`` lets another
        thread release it (filelock's ``thread_local=False``), for publishing on a background thread.
        Raises ``filelock.Timeout`` or ``OSError`` (then encode without the cache, see ``note_unavailable``).
        """
        path, lock = self._claim_lock(key, cross_thread)
        acquire_with_notice(lock, self.lock_timeout, path)
        return self._recheck(key, path, lock)

    def try_claim(self, key: CacheKey, *, cross_thread: bool = False, wait: float = 0.0) -> Claim | LoadResult | None:
        """``claim`` without waiting longer than ``wait`` seconds: None when another process holds the entry lock.

        What a warm uses: it never blocks on one entry while others are waiting (see ``exl3tool.operations.warm.lockwait``).
        Raises ``OSError`` when the lock cannot be opened at all.
        """
        path, lock = self._claim_lock(key, cross_thread)
        if not hasattr(lock, "acquire"):  # a plain context manager (tests swap in a no-op lock)
            lock.__enter__()
        else:
            try:
                lock.acquire(timeout=max(0.0, wait))
            except Timeout:
                return None
        return self._recheck(key, path, lock)

    def _claim_lock(self, key: CacheKey, cross_thread: bool) -> tuple[Path, FileLock]:
        if self.mode != "readwrite":
            raise ValueError(f"claim needs a readwrite cache, not {self.mode!r}")
        path = self.path(key)
        self._no_links(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path, self._lock(path, cross_thread)

    def _recheck(self, key: CacheKey, path: Path, lock) -> Claim | LoadResult:
        """With ``lock`` just taken: a valid entry is a hit (lock released), an invalid one is removed, else a Claim."""
        claimed = Claim(key, path, lock)
        try:
            self._remove_stale_temps(path)
            if path.is_file():
                try:
                    hit = self._from_hit(self._load(path, key))
                except Exception as exc:
                    if _not_about_the_file(exc):  # we could not read it; that says nothing against its bytes
                        raise
                    log.warning("Replacing invalid online EXL3 cache entry %s: %s", path, exc)
                    path.unlink(missing_ok=True)
                else:
                    claimed.release()
                    return hit
        except BaseException:
            claimed.release()
            raise
        return claimed

    def publish_claimed(self, claimed: Claim, encoded: EncodedLinear) -> LoadResult:
        """Write ``encoded`` (already checked, see ``check_fresh_encode``) atomically for ``claimed`` and release its lock.

        The lock is released in every case. A failed write is logged and the encode comes back unpublished
        (``path`` None), as in ``load_or_encode``.
        """
        if not claimed.held:
            raise ValueError(f"{claimed.path}: the claim was already released")
        try:
            try:
                published = write_entry(claimed.path, claimed.key, encoded.tensors(), encoded.proxy_error,
                                        file_mode=self.file_mode, platform=encoded.platform)
            except Exception as exc:
                log.warning("Could not publish online EXL3 cache entry %s: %s", claimed.path, exc)
                return replace(self._fresh(encoded, None), error=self.unpublished_reason(claimed.path, exc),
                               errno=getattr(exc, "errno", None))
            return self._fresh(encoded, published)
        finally:
            claimed.release()

    def unpublished_reason(self, path: Path, exc: BaseException) -> str:
        """Why an encode of ``path`` could not be published: the obstacle with its fix, else the OS error."""
        problem = entry_obstacle(path, self.root)
        if problem:
            return f"{problem}; {PRUNE_HINT}"
        if isinstance(exc, Timeout):
            return f"timed out after {self.lock_timeout:g} s waiting for {lock_path(path)}"
        return describe(exc)

    def note_unavailable(self, key: CacheKey, exc: BaseException) -> None:
        """Log why ``key``'s entry lock could not be used (time-out or OS error) before an uncached encode."""
        if isinstance(exc, Timeout):
            log.warning("Timed out after %g s waiting for %s; encoding without the cache", self.lock_timeout,
                        lock_path(self.path(key)))
        else:
            log.warning("Online EXL3 cache unavailable (%s); encoding without the cache", exc)

    def load_or_encode(self, key: CacheKey, encode_fn: Callable[[], EncodedLinear]) -> LoadResult:
        """The server's ``load_or_quantize``: hit if valid, else encode and (readwrite) publish under the lock.

        Raises ``Exl3OnlineNonFiniteError`` for a non-finite encode (nothing published) and ``ValueError``
        for wrong shapes; OS errors and lock time-outs fall back to an uncached encode, as on the server.
        In readwrite mode this is ``cached``, then ``claim``, the encode and ``publish_claimed``.
        """
        if self.mode == "off":
            return self._fresh(self._encode(key, encode_fn), None)
        hit = self.cached(key)
        if hit is not None:
            return hit
        if self.mode == "readonly":
            return self._fresh(self._encode(key, encode_fn), None)
        try:
            claimed = self.claim(key)
            if isinstance(claimed, LoadResult):
                return claimed
            try:
                encoded = self._encode(key, encode_fn)
            except BaseException:
                claimed.release()
                raise
            return self.publish_claimed(claimed, encoded)
        except (Timeout, OSError) as exc:
            self.note_unavailable(key, exc)
            return replace(self._fresh(self._encode(key, encode_fn), None), error=self.unpublished_reason(self.path(key), exc))

    def load_or_encode_with_retry(self, key: CacheKey, encode_fn: Callable[[], EncodedLinear]) -> LoadResult:
        """The server's ``_load_online_encoding_with_retry``: one more full attempt after a non-finite encode.

        The second attempt can be a hit if another process published meanwhile; a second non-finite
        result propagates. Other errors are not retried.
        """
        try:
            return self.load_or_encode(key, encode_fn)
        except Exl3OnlineNonFiniteError as exc:
            log.warning("Retrying %s once after a non-finite encode: %s", key.prefix, exc)
            return self.load_or_encode(key, encode_fn)

    def replace_unless(self, key: CacheKey, keep: Callable[[Lookup], bool], encoded: EncodedLinear) -> str:
        """Under ``key``'s entry lock, re-read the entry and publish ``encoded`` over it unless ``keep(found)``.

        For re-checking entries already there (``cache warm --check-unchecked``): the encode happens before the
        lock is taken, the decision on the entry as it is under the lock (another writer may have replaced it).
        Returns ``kept`` or ``replaced`` (``published`` when no valid entry was there any more); publishing is the
        same atomic write as ``publish``. Raises ``filelock.Timeout`` or ``OSError`` when the cache cannot be written.
        """
        if self.mode != "readwrite":
            raise ValueError(f"replace_unless needs a readwrite cache, not {self.mode!r}")
        check_fresh_encode(key, encoded.tensors(), encoded.proxy_error)
        path = self.path(key)
        self._no_links(path)
        lock = self._lock(path)
        acquire_with_notice(lock, self.lock_timeout, path)
        try:
            self._remove_stale_temps(path)
            found = self.lookup(key)
            if found.hit and keep(found):
                return "kept"
            write_entry(path, key, encoded.tensors(), encoded.proxy_error, file_mode=self.file_mode,
                        platform=encoded.platform)
            return "replaced" if found.hit else "published"
        finally:
            lock.__exit__(None, None, None)

    def import_entry(self, key: CacheKey, write: Callable[[BinaryIO], None], check: Callable[[Path], None]) -> str:
        """Publish bytes made elsewhere (a bundle's entry) as ``key``'s entry, through the same protocol as ``publish``.

        ``present``: a valid entry is there already (kept; ``write`` is not called; a second import of the same
        bundle takes no lock and changes nothing). Otherwise, under the entry lock and after a re-check, ``write``
        fills the temp file, ``check(temp)`` may refuse it (its exception propagates, nothing changes), then
        fsync and atomic rename: ``replaced`` (an invalid entry was there) or ``published``.
        Raises ``filelock.Timeout`` or ``OSError`` when the cache cannot be written.
        """
        if self.mode != "readwrite":
            raise ValueError(f"import_entry needs a readwrite cache, not {self.mode!r}")
        if self.lookup(key, quick=True).hit:  # every check, the checksum hashed from the file: no tensors loaded
            return "present"
        path = self.path(key)
        self._no_links(path)
        new_dirs = [d for d in reversed(path.parents) if d.is_relative_to(self.root) and d != self.root
                    and not d.exists()]  # v1/, the model's and the rank's folder, outermost first
        path.parent.mkdir(parents=True, exist_ok=True)
        new_lock = not os.path.lexists(lock_path(path))
        lock = self._lock(path)
        acquire_with_notice(lock, self.lock_timeout, path)
        try:
            self._remove_stale_temps(path)
            found = self.lookup(key, quick=True)
            if found.hit:
                return "present"
            atomic_write(path, write, file_mode=self.file_mode, check=check)
            return "replaced" if found.status == "invalid" else "published"
        except BaseException:  # refused or failed: leave no lock file or folder of ours for an entry not there
            lock.__exit__(None, None, None)
            self._undo_claim(path, new_lock, new_dirs)
            raise
        finally:
            lock.__exit__(None, None, None)

    def _undo_claim(self, path: Path, new_lock: bool, new_dirs: list[Path]) -> None:
        """After a refused import: remove the lock file this import created (when no entry is there and no
        process holds it) and the folders it created, if empty."""
        from exl3tool.cache.scan import lock_is_held

        if path.exists():
            return
        lock = lock_path(path)
        if new_lock and not lock_is_held(lock):
            try:
                lock.unlink()
            except OSError:
                return
        for folder in reversed(new_dirs):
            try:
                folder.rmdir()  # only when empty
            except OSError:
                return
