"""Taking an entry lock, and saying who holds it when a warm has to wait.

The server's lock is an ``flock`` on ``<entry>.lock``; flock records no owner in the file, but on Linux
``/proc/locks`` lists the process holding a lock on each inode, so a waiting warm can name it (local holders
only: a writer on another host of a shared filesystem is not listed).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import Timeout

__all__ = ["Holder", "lock_holders", "lock_holder_processes", "process_state", "one_line", "acquire_with_notice",
           "lock_path_unusable", "NOTICE_AFTER_S"]

log = logging.getLogger(__name__)

NOTICE_AFTER_S = 2.0  # wait this long quietly before saying which entry we wait for


def lock_path_unusable(lock: str | Path) -> str | None:
    """What ``lock`` is when no writer can lock it ("a directory", "a symlink (to X)", "a socket"), or None.

    None also when nothing is there (the lock is created on first use). filelock opens the path ``O_RDWR``
    without following a link and then ``flock``s it: that works on regular files, FIFOs and devices, and fails
    on directories, symlinks and sockets. One rule for the store (before encoding) and for ``cache verify``.
    """
    try:
        mode = os.lstat(lock).st_mode
    except OSError:
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        try:
            return f"a symlink (to {os.readlink(lock)})"
        except OSError:
            return "a symlink"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return None


COMMAND_CHARS = 100  # a holder's command line is shortened to this many characters


def one_line(text: str, limit: int = COMMAND_CHARS) -> str:
    """``text`` on one line: NULs, newlines and other control characters become spaces, runs of spaces one, and
    the result is cut to ``limit`` characters (ending in "...").

    >>> one_line("python\\0-c\\0import x\\nx.run()\\0")
    'python -c import x x.run()'
    """
    flat = "".join(c if c.isprintable() and not c.isspace() else " " for c in text)
    flat = " ".join(flat.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return one_line(raw.decode(errors="replace"))


def process_state(pid: int) -> str | None:
    """The one-letter state of process ``pid`` from ``/proc/PID/stat`` (R, S, D, T, t, Z...), None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the command name in (...) may hold spaces
    return fields[0] if fields else None


@dataclass(frozen=True)
class Holder:
    """A local process holding an entry lock: its pid and its command line on one line."""

    pid: int
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid}" + (f" ({self.command})" if self.command else "")


def lock_holder_processes(path: str | Path, proc_locks: str = "/proc/locks") -> list[Holder]:
    """Each local process ``/proc/locks`` lists as holding a lock on ``path`` (this process included); empty
    when the holder is not on this host, in another PID namespace (listed as pid 0), or ``/proc`` is absent."""
    try:
        st = os.stat(path)
        lines = Path(proc_locks).read_text().splitlines()
    except OSError:
        return []
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    pids = set()
    for line in lines:
        fields = line.split()
        if "->" in fields:  # a process blocked waiting for the lock, not a holder
            continue
        try:
            pid = int(fields[4])
            major, minor, inode = fields[5].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
        except (IndexError, ValueError):
            continue
        if key == want and pid > 0:
            pids.add(pid)
    return [Holder(pid, _command(pid)) for pid in sorted(pids)]


def lock_holders(path: str | Path, proc_locks: str = "/proc/locks") -> list[str]:
    """``pid N (command)`` for each other local process holding a lock on ``path``; empty if unknown.

    >>> lock_holders("/nonexistent/entry.lock")
    []
    """
    return [str(h) for h in lock_holder_processes(path, proc_locks) if h.pid != os.getpid()]


def acquire_with_notice(lock, timeout: float, entry: Path) -> None:
    """``lock.acquire`` with ``timeout``; after NOTICE_AFTER_S of waiting, log which entry and who holds it."""
    if not hasattr(lock, "acquire"):  # a plain context manager (tests swap in a no-op lock)
        lock.__enter__()
        return
    start = time.monotonic()
    try:
        lock.acquire(timeout=min(NOTICE_AFTER_S, timeout))
        return
    except Timeout:
        if timeout <= NOTICE_AFTER_S:
            raise
    holders = lock_holders(lock.lock_file)
    who = ", ".join(holders) if holders else "another process (not on this host, or unknown)"
    left = max(0.0, timeout - (time.monotonic() - start))
    log.warning("Waiting up to %.0f s for the entry lock of %s, held by %s", left, entry, who)
    lock.acquire(timeout=left)
