"""Running a warm plan: encode this worker's share of the pending jobs and publish each through the store.

Misses are encoded in order of decreasing tile count and published through the cache store, which makes
concurrent writers (other processes, other hosts on a shared cache) safe. By default reading the next weights
and publishing run on background threads while the calling thread encodes (``run_plan(overlap=True)``).

A job whose entry lock another process holds is never encoded here: it is deferred and retried after the other
jobs (``exl3tool.operations.warm.lockwait``). The first "no space left" on the cache stops encoding: the jobs left fail at
once with one message, and what was published stays.
"""

from __future__ import annotations

import errno
import functools
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Optional

import torch

from exl3tool.cache import CacheStore, Claim, LoadResult
from exl3tool.cache.store import PRUNE_HINT
from exl3tool.cache.entry import check_fresh_encode
from exl3tool.checkpoint import Checkpoint, encoder_input, rank_local_weight
from exl3tool.format.encoded import EncodedLinear
from exl3tool.cache.paths import lock_path
from exl3tool.errors import describe
from exl3tool.operations.warm.lockwait import LockWaits
from exl3tool.timing import StageTimer, stage
from exl3tool.plan.plan import LookupJob, LookupPlan
from exl3tool.operations.warm.results import JobResult, job_result
from exl3tool.plan.sharing import SharedEncode, group_jobs, share_jobs

__all__ = ["EncodeFn", "TilesFn", "run_plan"]


EncodeFn = Callable[..., EncodedLinear]  # (weight, bits, seed, device) [, progress=callable(tiles)]
TilesFn = Callable[[LookupJob, int], None]

log = logging.getLogger(__name__)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_BUSY = object()  # an attempt found the entry lock held by another process


def _default_encode(weight: torch.Tensor, bits: int, seed: int, device: torch.device,
                    progress: Optional[Callable[[int], None]] = None, *,
                    memory_budget: Optional[int] = None, timer: Optional[StageTimer] = None) -> EncodedLinear:
    """``encode_linear`` on ``device``; ``memory_budget`` bounds the weight's copy there plus the encode's peak."""
    from exl3tool.encode import encode_linear

    with stage(timer, "h2d", device):
        w = weight.to(device)
    budget = None
    if memory_budget is not None:  # the weight on the device is part of the job's footprint
        budget = max(1, memory_budget - w.numel() * w.element_size())
    return encode_linear(w, bits=bits, seed=seed, device=device, progress=progress, memory_budget_bytes=budget,
                         timer=timer)


def _call_encode(encode: EncodeFn, job: LookupJob, weight: torch.Tensor, bits: int, device: torch.device,
                 on_tiles: Optional[TilesFn]) -> EncodedLinear:
    """``encode`` for ``job``; with ``on_tiles`` it also reports tiles as they are quantized (``progress=``)."""
    if on_tiles is None:
        return encode(weight, bits, job.key.seed, device)
    return encode(weight, bits, job.key.seed, device, progress=lambda n: on_tiles(job, n))


def run_plan(
    plan: LookupPlan,
    checkpoint: Checkpoint,
    store: CacheStore,
    *,
    device: torch.device,
    worker: int = 0,
    workers: int = 1,
    todo: Optional[list[LookupJob]] = None,
    dtype: Optional[torch.dtype] = None,
    on_start: Optional[Callable[[LookupJob], None]] = None,
    on_done: Optional[Callable[[LookupJob, JobResult], None]] = None,
    encode: EncodeFn = _default_encode,
    overlap: bool = True,
    on_tiles: Optional[TilesFn] = None,
    memory_budget: Optional[int] = None,
    lock_timeout: Optional[float] = None,
    waits: Optional[LockWaits] = None,
    timer: Optional[StageTimer] = None,
) -> list[JobResult]:
    """Encode this worker's share of the pending jobs; worker 0 also reports every other job once.

    ``todo`` is the pending list every worker agrees on (worker 0's plan under torchrun, see
    ``agreed_todo``); by default this plan's own. A job that fails (unreadable weight, non-finite values,
    encoder error) is recorded with its error and the others still run; nothing partial is ever
    published (the store writes atomically).

    ``overlap`` (default) keeps the device busy: a background thread reads and checks the next jobs' weights
    (at most two ahead) and another publishes (hash, write, fsync, rename) while the calling thread encodes
    the next job. Encodes still run one at a time, in job order (a deferred job after the others), on the calling
    thread, and so do the callbacks; results and published bytes are the same as without overlap.

    ``on_tiles(job, n)`` (on the calling thread) hears of every n tiles quantized inside a job's encode, for
    progress bars that move during a long layer; ``encode`` must then take a ``progress`` keyword.

    ``memory_budget`` (bytes, the default encoder only) bounds what one job allocates on the device: its weight
    there and the encode's chunks. One job is on the device at a time (the next job's weight is read ahead on
    the host), so the budget is the worker's; a job that cannot fit fails with the figure it needed.
    A job whose entry lock another process holds waits in ``waits`` (default ``LockWaits(lock_timeout)``: no
    bound while the holder lives) while the others run; it ends as a hit, an encode, or a failure naming the holder.

    Jobs whose entries one encode fills (``sharing``: a replicated layer on every rank and TP size) are a share
    group, kept on one worker and run one after another: the first member that needs the encode runs it, the others
    publish its tensors under their own keys (each file with its own key and checksum) and report ``reused_from``.
    ``timer`` collects the seconds of each stage (``worker_stats``' ``stages``).
    """
    if encode is _default_encode and (memory_budget is not None or timer is not None):
        encode = functools.partial(_default_encode, memory_budget=memory_budget, timer=timer)
    todo = plan.todo if todo is None else todo
    pending = {j.digest for j in todo}
    results: list[JobResult] = []
    if worker == 0:
        for job in plan.jobs:
            if job.state == "skipped":
                results.append(job_result(job, "skipped", worker, error=job.reason))
            elif job.digest not in pending:
                results.append(job_result(job, "hit", worker, path=str(job.path)))
    mine = share_jobs(todo, worker, workers)
    if mine:
        pipeline = _Pipeline(plan, checkpoint, store, device, worker, dtype, encode, on_start, on_done, on_tiles,
                             overlap=overlap, waits=waits if waits is not None else LockWaits(lock_timeout),
                             timer=timer)
        results.extend(pipeline.run(mine))
    return results


def _prepare_input(job: LookupJob, checkpoint: Checkpoint, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The encoder's input for ``job``: the rank-local weight, transposed to float32 and checked finite."""
    weight = encoder_input(rank_local_weight(checkpoint, job.rank_job, dtype=dtype))
    if not torch.isfinite(weight).all():
        bad = int((~torch.isfinite(weight)).sum())
        raise ValueError(f"{bad} non-finite weight values in the rank-local weight; nothing was published")
    return weight


def _through_store(job: LookupJob, store: CacheStore, worker: int, encode_fn: Callable[[], EncodedLinear]) -> JobResult:
    """``store.load_or_encode`` for one job, as a result: a failed layer never stops the warm."""
    start = time.perf_counter()
    try:
        blocked = _blocked(job, store, worker)
        if blocked is not None:
            return blocked
        loaded = store.load_or_encode(job.key, encode_fn)
    except Exception as exc:
        return _failed(job, worker, exc, time.perf_counter() - start)
    return _loaded_result(job, loaded, store, worker, time.perf_counter() - start)


def _publish_failed(reason: Optional[str]) -> str:
    return f"encoded, but publishing failed ({reason or 'an OS error on the cache'}); nothing was written"


def _blocked(job: LookupJob, store: CacheStore, worker: int) -> Optional[JobResult]:
    """A failed result, before any encode, when something in the cache makes publishing ``job`` impossible.

    A directory at the entry path, or a directory or symlink at its lock path, survives every warm; the result
    names it and the fix. A valid entry next to a broken lock path is still a hit (read without the lock).
    """
    if store.mode != "readwrite":
        return None
    problem = store.obstacle(job.key)
    if problem is None or store.cached(job.key) is not None:
        return None
    return job_result(job, "failed", worker, error=f"{problem}; {PRUNE_HINT}")


def _failed(job: LookupJob, worker: int, exc: BaseException, seconds: float) -> JobResult:
    return job_result(job, "failed", worker, seconds=seconds, error=describe(exc))


def _loaded_result(job: LookupJob, loaded: LoadResult, store: CacheStore, worker: int, seconds: float) -> JobResult:
    if loaded.hit:  # another process published it meanwhile
        return job_result(job, "hit", worker, path=str(loaded.path), seconds=seconds, proxy_error=loaded.proxy_error)
    size = loaded.path.stat().st_size if loaded.path is not None and loaded.path.exists() else 0
    status = "encoded" if (loaded.path is not None or store.mode != "readwrite") else "failed"
    error = "" if status == "encoded" else _publish_failed(loaded.error)
    return job_result(job, status, worker, path=str(loaded.path) if loaded.path else None, seconds=seconds,
                   bytes_=size, proxy_error=loaded.proxy_error, error=error)


class _Prefetcher:
    """Reads and checks the jobs' encoder inputs on a background thread, at most ``depth + 1`` jobs ahead.

    ``next()`` hands them out in job order as ``(job, weight, error)``; a job whose input could not be
    prepared carries the exception instead of a weight.
    """

    def __init__(self, jobs: list[LookupJob], prepare: Callable[[LookupJob], torch.Tensor], depth: int = 1) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(list(jobs), prepare), name="exl3tool-prefetch",
                                        daemon=True)
        self._thread.start()

    def _run(self, jobs: list[LookupJob], prepare: Callable[[LookupJob], torch.Tensor]) -> None:
        for job in jobs:
            if self._stop.is_set():
                return
            try:
                item = (job, prepare(job), None)
            except BaseException as exc:  # becomes that job's failure, reported by the main thread
                item = (job, None, exc)
            while True:
                if self._stop.is_set():
                    return
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def next(self) -> tuple[LookupJob, Optional[torch.Tensor], Optional[BaseException]]:
        while True:
            try:
                return self._queue.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the prefetch thread stopped early") from None

    def close(self) -> None:
        """Stop reading ahead, wait for the thread and drop what it had prepared."""
        self._stop.set()
        while self._thread.is_alive():
            self._drain()
            self._thread.join(0.1)
        self._drain()

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass


class _Inline:
    """Without overlap: the prefetcher and the publisher, done on the calling thread when asked."""

    def __init__(self, jobs: list[LookupJob], prepare: Callable[[LookupJob], torch.Tensor]) -> None:
        self._jobs, self._prepare = iter(jobs), prepare

    def next(self) -> tuple[LookupJob, Optional[torch.Tensor], Optional[BaseException]]:
        job = next(self._jobs)
        try:
            return job, self._prepare(job), None
        except BaseException as exc:  # e.g. an unreadable weight: that job's failure
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return job, None, exc

    def submit(self, fn, *args) -> Future:
        return _done(fn(*args))

    def close(self) -> None:
        pass

    def shutdown(self, wait: bool = True) -> None:
        pass


class _Pipeline:
    """``run_plan``'s loop: with overlap a prefetch thread, encodes on the calling thread, one publishing thread.

    In readwrite mode each job follows ``CacheStore.load_or_encode``'s protocol step by step: the unlocked
    look-up (``cached``), the entry lock and the re-check under it (``try_claim``), the encode, then
    ``publish_claimed`` on the publishing thread, which writes and releases the lock. A lock another process
    holds defers the job (``LockWaits``); it is retried between the next jobs and after the last one. Other modes
    call ``load_or_encode`` itself. Results and callbacks stay on the calling thread.
    """

    MAX_PUBLISHES = 2  # claimed entries in flight (being written or waiting): bounds held locks and memory

    def __init__(self, plan, checkpoint, store, device, worker, dtype, encode, on_start, on_done, on_tiles=None,
                 *, overlap: bool = True, waits: Optional[LockWaits] = None,
                 timer: Optional[StageTimer] = None) -> None:
        self.plan, self.checkpoint, self.store, self.device = plan, checkpoint, store, device
        self.worker, self.dtype, self.encode = worker, dtype, encode
        self.on_start, self.on_done, self.on_tiles = on_start, on_done, on_tiles
        self.overlap = overlap
        self.waits = waits if waits is not None else LockWaits()
        self.pending: deque[tuple[LookupJob, Future]] = deque()
        self.results: list[JobResult] = []
        self.started: set[str] = set()
        self.disk_full: Optional[str] = None  # set (from any thread) at the first ENOSPC: no further encode
        self.timer = timer
        self.shared: dict[str, SharedEncode] = {}  # job digest -> its share group's encode
        self.members_left: dict[int, int] = {}  # id(SharedEncode) -> members not yet reported

    def _prepare(self, job: LookupJob) -> Optional[torch.Tensor]:
        """The job's encoder input; None when its share group's encode already ran (nothing to read)."""
        shared = self.shared.get(job.digest)
        if shared is not None and shared.done:
            return None
        with stage(self.timer, "read"):
            return _prepare_input(job, self.checkpoint, self.dtype)

    def run(self, jobs: list[LookupJob]) -> list[JobResult]:
        for group in group_jobs(jobs):
            shared: SharedEncode = SharedEncode(None)
            self.members_left[id(shared)] = len(group.jobs)
            for member in group.jobs:
                self.shared[member.digest] = shared
        if self.overlap:
            prefetch = _Prefetcher(jobs, self._prepare)
            publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exl3tool-publish")
        else:
            prefetch = publisher = _Inline(jobs, self._prepare)
        try:
            with self.waits.watching():  # a stuck holder is noticed while this thread encodes other jobs
                self._run_jobs(jobs, prefetch, publisher)
        except KeyboardInterrupt:
            publisher.shutdown(wait=True)  # in-flight publishes complete and release their locks,
            self._finish_ready()  # and are reported: an interrupted warm counts every entry it published
            raise
        finally:
            prefetch.close()
            publisher.shutdown(wait=True)  # in-flight publishes complete and release their locks
        return self.results

    def _run_jobs(self, jobs: list[LookupJob], prefetch, publisher) -> None:
        """Every job in order, then the deferred ones until each is a hit, an encode or given up."""
        for job in jobs:
            if self.disk_full is not None:  # fails at once: no weight read, no encode
                self._attempt(job, _given(None, None), publisher)
                continue
            with stage(self.timer, "wait_for_input"):
                got, weight, error = prefetch.next()
            assert got is job, "prefetch out of order"
            self._finish_ready()
            self._attempt(job, _given(weight, error), publisher)
            del weight
            self._finish_ready()
            self._revisit(publisher)
        while self.waits:
            self._finish_ready()
            self.waits.idle_wait()
            self._revisit(publisher)
        self._finish_ready(wait=True)

    def _attempt(self, job: LookupJob, weight_fn: Callable[[], torch.Tensor], publisher) -> None:
        """One try at ``job``: its outcome is queued, or (lock held elsewhere) it waits in ``self.waits``."""
        if job.digest not in self.started:
            self.started.add(job.digest)
            if self.on_start:
                self.on_start(job)
        if self.disk_full is not None:
            outcome = job_result(job, "failed", self.worker, error=self.disk_full)
        elif self.store.mode == "readwrite":
            outcome = self._claim_and_encode(job, weight_fn, publisher)
        else:
            outcome = self._load_or_encode(job, weight_fn)
        if outcome is _BUSY:
            if job not in self.waits:
                log.warning("%s", self.waits.defer(job, lock_path(job.path)))
                return
            reason = self.waits.held_again(job)  # drops the job when it gives up
            if reason is None:
                return
            outcome = job_result(job, "failed", self.worker, error=reason)
        else:
            self.waits.done(job)
        self.pending.append((job, outcome if isinstance(outcome, Future) else _done(outcome)))

    def _revisit(self, publisher) -> None:
        """Report the jobs the lock watcher gave up on, then retry the deferred jobs that are due; each weight is
        read again only once its lock is ours."""
        for job, message in self.waits.given_up():
            self.pending.append((job, _done(job_result(job, "failed", self.worker, error=message))))
            self._finish_ready()
        for job in self.waits.due():
            self._attempt(job, lambda job=job: self._prepare(job), publisher)
            self._finish_ready()

    def _finish_ready(self, wait: bool = False) -> None:
        """Report finished jobs in order (results, ``on_done``), on this thread; ``wait`` for all of them."""
        while self.pending and (wait or self.pending[0][1].done()):
            job, fut = self.pending.popleft()
            result = self._reported(job, fut.result())
            self.results.append(result)
            if self.on_done:
                self.on_done(job, result)

    def _reported(self, job: LookupJob, result: JobResult) -> JobResult:
        """``result`` with ``reused_from`` when another member's encode filled it; the group's tensors are dropped
        once its last member is reported, so memory stays bounded by the groups in flight."""
        shared = self.shared[job.digest]
        source = shared.reused_by(job) if result.status in ("encoded", "failed") else None
        self.members_left[id(shared)] -= 1
        if self.members_left[id(shared)] == 0:
            shared.release()
        return result if source is None else replace(result, reused_from=source)

    def _encode(self, job: LookupJob, weight_fn: Callable[[], Optional[torch.Tensor]]) -> EncodedLinear:
        """The job's share-group encode (run here for ``job`` if no member ran it yet), on the CPU."""
        def run(job: LookupJob) -> EncodedLinear:
            encoded = _call_encode(self.encode, job, weight_fn(), self.plan.bits, self.device, self.on_tiles)
            with stage(self.timer, "to_cpu"):
                return replace(encoded, **encoded.tensors())  # publishing and sharing never touch the device
        return self.shared[job.digest](job, run)

    def _load_or_encode(self, job, weight_fn) -> JobResult:
        return _through_store(job, self.store, self.worker, lambda: self._encode(job, weight_fn))

    def _note_disk_full(self, exc_errno: Optional[int], detail: str) -> None:
        if exc_errno in DISK_FULL and self.disk_full is None:
            self.disk_full = (f"not encoded: the cache's filesystem is full ({detail}); free space under "
                              f"{self.store.root} and re-run the warm (published entries are kept)")
            log.warning("The cache's filesystem is full (%s): no further layer is encoded; the jobs left fail", detail)

    def _claim_and_encode(self, job, weight_fn, publisher):
        """Hit, blocked, ``_BUSY`` (lock held elsewhere), a failure, or the publish's future after the encode."""
        store, worker = self.store, self.worker
        start = time.perf_counter()
        try:
            hit = store.cached(job.key)
            blocked = None if hit is not None else _blocked(job, store, worker)
        except Exception as exc:
            return _failed(job, worker, exc, time.perf_counter() - start)
        if hit is not None:
            return _loaded_result(job, hit, store, worker, time.perf_counter() - start)
        if blocked is not None:
            return blocked
        try:
            got = store.try_claim(job.key, cross_thread=True)
        except OSError as exc:  # no lock, so no publish: encoding would be wasted
            self._note_disk_full(exc.errno, describe(exc))
            return job_result(job, "failed", worker, seconds=time.perf_counter() - start,
                              error=f"not encoded: the entry lock cannot be taken "
                                    f"({store.unpublished_reason(job.path, exc)})")
        if got is None:
            return _BUSY
        if isinstance(got, LoadResult):  # another process published it meanwhile
            return _loaded_result(job, got, store, worker, time.perf_counter() - start)
        claimed: Claim = got
        try:
            encoded = self._encode(job, weight_fn)
            check_fresh_encode(job.key, encoded.tensors(), encoded.proxy_error)
        except Exception as exc:
            claimed.release()
            return _failed(job, worker, exc, time.perf_counter() - start)
        except BaseException:
            claimed.release()
            raise
        encode_seconds = time.perf_counter() - start
        try:
            self._wait_for_publish_slot()
            return publisher.submit(self._publish, job, claimed, encoded, encode_seconds)
        except BaseException:  # an on_done callback or an interrupt: the entry lock is never left held
            claimed.release()
            raise

    def _wait_for_publish_slot(self) -> None:
        """Block until fewer than ``MAX_PUBLISHES`` publishes are in flight.

        Each pass takes one snapshot of the unfinished futures: a publish may finish on its own thread at any
        moment, so counting and then searching in two passes could find none left to wait on.
        """
        while True:
            waiting = [f for _, f in self.pending if not f.done()]
            if len(waiting) < self.MAX_PUBLISHES:
                return
            waiting[0].result()
            self._finish_ready()

    def _publish(self, job: LookupJob, claimed: Claim, encoded: EncodedLinear, encode_seconds: float) -> JobResult:
        """On the publishing thread: write and release; never raises."""
        start = time.perf_counter()
        try:
            with stage(self.timer, "publish"):
                loaded = self.store.publish_claimed(claimed, encoded)
            if loaded.path is None:
                self._note_disk_full(loaded.errno, loaded.error or "")
            return _loaded_result(job, loaded, self.store, self.worker, encode_seconds + time.perf_counter() - start)
        except BaseException as exc:  # e.g. releasing the lock failed; the claim is released either way
            claimed.release()
            return job_result(job, "failed", self.worker, seconds=encode_seconds + time.perf_counter() - start,
                           proxy_error=encoded.proxy_error, error=_publish_failed(describe(exc)))


def _given(weight: Optional[torch.Tensor], error: Optional[BaseException]) -> Callable[[], torch.Tensor]:
    """The prefetched weight as a call that gives it, or raises the error met while reading it."""
    def get() -> torch.Tensor:
        if error is not None:
            raise error
        return weight
    return get


def _done(result: JobResult) -> Future:
    fut: Future = Future()
    fut.set_result(result)
    return fut
