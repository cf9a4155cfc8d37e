"""Jobs whose entry lock another process holds: do the other jobs first, come back, give up only on a stuck holder.

Another process holding an entry's lock is encoding that very entry (another warm, or a server at start-up), so a
warm never encodes it itself: it defers the job, goes on with its other jobs, and retries the deferred ones between
jobs and, once nothing else is left, every ``POLL_S`` seconds. A retry that finds a valid entry counts a hit; one
that gets the lock re-checks under it and encodes only if the holder left no entry (its encode failed, or it died:
an ``flock`` ends with its process).

The warm gives up on a job (it fails, naming the lock and its holder on one line; nothing is encoded) only when:

* ``--lock-timeout S`` is set and the lock has stayed held for S seconds since the warm first found it held;
* every holder on this host is stopped (state T or t: SIGSTOP, Ctrl-Z, a debugger) for ``STUCK_AFTER_S`` on end;
* no holder can be identified (another host on a shared filesystem, another PID namespace, no ``/proc/locks``) and
  no file under the model's cache directory changed for ``UNKNOWN_AFTER_S`` (the server's own lock time-out):
  nothing shows that anyone is working on this model.

A live local holder is waited for without bound unless ``--lock-timeout`` is given.

While the warm encodes its other jobs, a watcher thread (``LockWaits.watching``) looks at every held lock each
``POLL_S`` seconds, so a stopped holder is noticed within seconds (not only between jobs, which may be minutes
apart) and the give-up is logged as soon as a rule holds, saying how long the warm waited and that the entry was
not encoded; the job's failure is reported with the next result.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from exl3tool.cache.locks import Holder, lock_holder_processes, process_state
from exl3tool.plan.plan import LookupJob
from exl3tool.releases import CACHE_MODULES

__all__ = ["LockWaits", "POLL_S", "STUCK_AFTER_S", "UNKNOWN_AFTER_S", "progress_stamp"]

POLL_S = 1.0  # how often a deferred job is retried
STUCK_AFTER_S = 60.0  # a holder stopped this long is stuck
# an unidentifiable holder with no sign of progress this long is stuck: the newer cache module's lock time-out
UNKNOWN_AFTER_S = float(CACHE_MODULES["newer"].lock_timeout_s or 600.0)
STOPPED = ("T", "t")
log = logging.getLogger(__name__)


def progress_stamp(lock: Path) -> int:
    """The newest change under the model's cache directory (``<root>/v1/<model>/``, two levels above ``lock``) in
    ns: a writer creating a temp file or publishing an entry in any ``tp*-rank*`` folder moves it."""
    model_dir = lock.parent.parent
    newest = 0
    try:
        with os.scandir(model_dir) as it:
            for d in it:
                try:
                    newest = max(newest, d.stat(follow_symlinks=False).st_mtime_ns)
                except OSError:
                    continue
    except OSError:
        pass
    return newest


@dataclass
class _Wait:
    job: LookupJob
    lock: Path
    since: float  # when this warm first found the lock held
    next_try: float
    holders: list[Holder]
    stopped_since: Optional[float] = None
    quiet_since: float = 0.0  # the last time the model's cache directory changed (unknown holders)
    stamp: int = 0
    told_stopped: bool = False  # the "holder is stopped" notice was logged


class LockWaits:
    """The deferred jobs of one warm, when to retry each and when to give up (see the module's rules)."""

    def __init__(self, lock_timeout: Optional[float] = None, *, poll_s: float = POLL_S,
                 stuck_after_s: float = STUCK_AFTER_S, unknown_after_s: float = UNKNOWN_AFTER_S,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 holders: Callable[[Path], list[Holder]] = lock_holder_processes,
                 state: Callable[[int], Optional[str]] = process_state,
                 stamp: Callable[[Path], int] = progress_stamp) -> None:
        if lock_timeout is not None and lock_timeout < 0:
            raise ValueError(f"lock_timeout must be 0 or more seconds, got {lock_timeout}")
        self.lock_timeout = lock_timeout
        self.poll_s, self.stuck_after_s, self.unknown_after_s = poll_s, stuck_after_s, unknown_after_s
        self._clock, self._sleep, self._holders, self._state, self._stamp = clock, sleep, holders, state, stamp
        self._waits: dict[str, _Wait] = {}
        self._given_up: dict[str, tuple[LookupJob, str]] = {}  # given up by the watcher, not yet reported
        self._mutex = threading.RLock()  # the watcher thread and the warm's thread share the waits

    def __len__(self) -> int:
        with self._mutex:
            return len(self._waits) + len(self._given_up)

    def __contains__(self, job: LookupJob) -> bool:
        with self._mutex:
            return job.digest in self._waits or job.digest in self._given_up

    def defer(self, job: LookupJob, lock: Path) -> str:
        """Record that ``job``'s lock is held; return the one-line notice for the log."""
        with self._mutex:
            now = self._clock()
            wait = _Wait(job, lock, now, now + self.poll_s, [], quiet_since=now, stamp=self._stamp(lock))
            self._waits[job.digest] = wait
            self._observe(wait, now)
        bound = "" if self.lock_timeout is None else f" (at most {self.lock_timeout:g} s, --lock-timeout)"
        return (f"{job.prefix} tp{job.tp_size}-rank{job.tp_rank}: entry lock {lock} is held by {self._who(wait)}; "
                f"doing the other jobs first, then waiting for it{bound}")

    def due(self) -> list[LookupJob]:
        """The deferred jobs whose retry time has come, in the order they were deferred (not those given up)."""
        with self._mutex:
            now = self._clock()
            return [w.job for w in self._waits.values() if w.next_try <= now]

    def given_up(self) -> list[tuple[LookupJob, str]]:
        """The jobs the watcher gave up on since the last call, each with its failure message (dropped here)."""
        with self._mutex:
            out = list(self._given_up.values())
            self._given_up.clear()
            return out

    def done(self, job: LookupJob) -> None:
        """``job`` no longer waits (its retry got the lock or found the entry)."""
        with self._mutex:
            self._waits.pop(job.digest, None)
            self._given_up.pop(job.digest, None)

    def held_again(self, job: LookupJob) -> Optional[str]:
        """A retry found ``job``'s lock still held: None to retry later, or why to give up (the job is dropped)."""
        with self._mutex:
            if job.digest in self._given_up:
                return self._given_up.pop(job.digest)[1]
            wait = self._waits[job.digest]
            now = self._clock()
            self._observe(wait, now)
            reason = self._give_up(wait, now)
            if reason is None:
                wait.next_try = now + self.poll_s
                return None
            del self._waits[job.digest]
            return self._message(wait, reason, now)

    def check_all(self) -> None:
        """Look at every held lock now (the watcher's pass): a job whose give-up rule holds is dropped, its message
        logged at once and kept for ``given_up``."""
        with self._mutex:
            now = self._clock()
            for digest, wait in list(self._waits.items()):
                self._observe(wait, now)
                reason = self._give_up(wait, now)
                if reason is not None:
                    del self._waits[digest]
                    message = self._message(wait, reason, now)
                    self._given_up[digest] = (wait.job, message)
                    log.warning("%s tp%d-rank%d: %s", wait.job.prefix, wait.job.tp_size, wait.job.tp_rank, message)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Run ``check_all`` every ``poll_s`` seconds on a background thread while the block runs."""
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(self.poll_s):
                try:
                    self.check_all()
                except Exception as exc:  # never ends the warm; the next retry between jobs decides instead
                    log.debug("lock watcher: %s", exc)

        thread = threading.Thread(target=watch, name="exl3tool-lockwait", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _message(self, wait: _Wait, reason: str, now: float) -> str:
        return (f"not encoded: gave up after waiting {now - wait.since:.0f} s for the entry lock {wait.lock}: "
                f"{reason}; this warm did not encode the entry; re-run the warm once the lock is released (the entry "
                "is then a hit if the holder published it)")

    def idle_wait(self) -> None:
        """Sleep until the next deferred job is due (nothing else is left to do); at once if one was given up."""
        with self._mutex:
            if self._given_up or not self._waits:
                return
            delay = min(w.next_try for w in self._waits.values()) - self._clock()
        if delay > 0:
            self._sleep(delay)

    def _observe(self, wait: _Wait, now: float) -> None:
        wait.holders = self._holders(wait.lock)
        states = [self._state(h.pid) for h in wait.holders]
        known = [s for s in states if s is not None]
        if known and all(s in STOPPED for s in known):
            wait.stopped_since = wait.stopped_since if wait.stopped_since is not None else now
            if not wait.told_stopped:
                wait.told_stopped = True
                log.warning("%s tp%d-rank%d: the holder of %s, %s, is stopped (SIGSTOP or a debugger); giving up on "
                            "this entry (not encoding it) if it stays stopped for %g s", wait.job.prefix,
                            wait.job.tp_size, wait.job.tp_rank, wait.lock, self._who(wait), self.stuck_after_s)
        else:
            wait.stopped_since = None
            wait.told_stopped = False
        stamp = self._stamp(wait.lock)
        if stamp != wait.stamp:
            wait.stamp, wait.quiet_since = stamp, now

    def _identified(self, wait: _Wait) -> bool:
        return any(self._state(h.pid) is not None for h in wait.holders)

    def _who(self, wait: _Wait) -> str:
        if wait.holders:
            return ", ".join(str(h) for h in wait.holders)
        return "a process not visible from here (another host on a shared filesystem, or another PID namespace)"

    def _give_up(self, wait: _Wait, now: float) -> Optional[str]:
        held = now - wait.since
        who = self._who(wait)
        if self.lock_timeout is not None and held >= self.lock_timeout:
            return f"held by {who} for {held:.0f} s, past --lock-timeout {self.lock_timeout:g} s"
        if wait.stopped_since is not None and now - wait.stopped_since >= self.stuck_after_s:
            return f"its holder {who} has been stopped (SIGSTOP or a debugger) for {now - wait.stopped_since:.0f} s"
        if not self._identified(wait) and now - wait.quiet_since >= self.unknown_after_s:
            return (f"held for {held:.0f} s by {who}, and no file of this model's cache changed for "
                    f"{now - wait.quiet_since:.0f} s")
        return None
