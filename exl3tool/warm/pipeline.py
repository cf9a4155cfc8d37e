"""Running a warm plan: encode this worker's share of the pending jobs and publish each through the store.

Misses are encoded in order of decreasing tile count and published through the cache store, which makes
concurrent writers (other processes, other hosts on a shared cache) safe. By default reading the next weights
and publishing run on background threads while the calling thread encodes (``run_plan(overlap=True)``).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Optional

import torch
from filelock import Timeout

from exl3tool.cache import CacheStore, Claim, LoadResult
from exl3tool.cache.store import PRUNE_HINT
from exl3tool.cache.entry import check_fresh_encode
from exl3tool.checkpoint import Checkpoint, encoder_input, rank_local_weight
from exl3tool.encode.encoded import EncodedLinear
from exl3tool.errors import describe
from exl3tool.timing import StageTimer, stage
from exl3tool.warm.plan import WarmJob, WarmPlan
from exl3tool.warm.results import JobResult, job_result
from exl3tool.warm.sharing import ShareGroup, SharedEncode, group_jobs, share_jobs

__all__ = ["EncodeFn", "TilesFn", "run_plan"]


EncodeFn = Callable[..., EncodedLinear]  # (weight, bits, seed, device) [, progress=callable(tiles)]
TilesFn = Callable[[WarmJob, int], None]


def _default_encode(weight: torch.Tensor, bits: int, seed: int, device: torch.device,
                    progress: Optional[Callable[[int], None]] = None, timer: Optional[StageTimer] = None) -> EncodedLinear:
    from exl3tool.encode import encode_linear

    with stage(timer, "h2d", device):
        weight = weight.to(device)
    return encode_linear(weight, bits=bits, seed=seed, device=device, progress=progress, timer=timer)


def _call_encode(encode: EncodeFn, job: WarmJob, weight: torch.Tensor, bits: int, device: torch.device,
                 on_tiles: Optional[TilesFn]) -> EncodedLinear:
    """``encode`` for ``job``; with ``on_tiles`` it also reports tiles as they are quantized (``progress=``)."""
    if on_tiles is None:
        return encode(weight, bits, job.key.seed, device)
    return encode(weight, bits, job.key.seed, device, progress=lambda n: on_tiles(job, n))


def run_plan(
    plan: WarmPlan,
    checkpoint: Checkpoint,
    store: CacheStore,
    *,
    device: torch.device,
    worker: int = 0,
    workers: int = 1,
    todo: Optional[list[WarmJob]] = None,
    dtype: Optional[torch.dtype] = None,
    on_start: Optional[Callable[[WarmJob], None]] = None,
    on_done: Optional[Callable[[WarmJob, JobResult], None]] = None,
    encode: EncodeFn = _default_encode,
    overlap: bool = True,
    on_tiles: Optional[TilesFn] = None,
    timer: Optional[StageTimer] = None,
) -> list[JobResult]:
    """Encode this worker's share of the pending jobs; worker 0 also reports every other job once.

    ``todo`` is the pending list every worker agrees on (worker 0's plan under torchrun, see
    ``agreed_todo``); by default this plan's own. A job that fails (unreadable weight, non-finite values,
    encoder error) is recorded with its error and the others still run; nothing partial is ever
    published (the store writes atomically).

    ``overlap`` (default) keeps the device busy: a background thread reads and checks the next jobs' weights
    (at most two ahead) and another publishes (hash, write, fsync, rename) while the calling thread encodes
    the next job. Encodes still run one at a time, in job order, on the calling thread, and so do the
    callbacks; results and published bytes are the same as without overlap.

    ``on_tiles(job, n)`` (on the calling thread) hears of every n tiles quantized inside a job's encode, for
    progress bars that move during a long layer; ``encode`` must then take a ``progress`` keyword.

    Jobs whose entries one encode fills (``sharing``: a replicated layer on every rank and TP size) run as a group
    on one worker: the weight is read and encoded once, for the first member that needs it, and published under
    each member's key; the others' results carry ``reused_from``.

    ``timer`` collects the seconds of each stage (``worker_stats``' ``stages``). With the default encoder on a CUDA
    device and ``overlap``, reading ahead has two stages: one thread reads the next weights (serving dtype), another
    copies them to the GPU, widens and transposes them there and runs the first half of the encode (regularisation
    and scale search, ``prepare_encode``) on its own CUDA stream; the calling thread runs the Viterbi
    (``finish_encode``), so the GPU always has the next encode's input ready. Same bytes as one thread and stream.
    """
    todo = plan.todo if todo is None else todo
    pending = {j.digest for j in todo}
    results: list[JobResult] = []
    if worker == 0:
        for job in plan.jobs:
            if job.state == "skipped":
                results.append(job_result(job, "skipped", worker, error=job.reason))
            elif job.digest not in pending:
                results.append(job_result(job, "hit", worker, path=str(job.path)))
    groups = group_jobs(share_jobs(todo, worker, workers))
    split = encode is _default_encode and device.type == "cuda"
    if encode is _default_encode and timer is not None:
        encode = functools.partial(_default_encode, timer=timer)
    if overlap and groups:
        pipeline = _Pipeline(plan, checkpoint, store, device, worker, dtype, encode, on_start, on_done, on_tiles,
                             timer=timer, split=split)
        results.extend(pipeline.run(groups))
        return results
    for group in groups:
        shared = SharedEncode(lambda job: _call_encode(encode, job, _prepare_input(job, checkpoint, dtype), plan.bits,
                                                       device, on_tiles))
        for job in group.jobs:
            if on_start:
                on_start(job)
            result = _reused(_through_store(job, store, worker, lambda: shared(job)), shared, job)
            results.append(result)
            if on_done:
                on_done(job, result)
    return results


def _reused(result: JobResult, shared: SharedEncode, job: WarmJob) -> JobResult:
    """``result`` with ``reused_from`` set when ``job``'s tensors came from another member's encode."""
    if result.status not in ("encoded", "failed"):
        return result
    source = shared.reused_by(job)
    return result if source is None else replace(result, reused_from=source)


def _prepare_input(job: WarmJob, checkpoint: Checkpoint, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The encoder's input for ``job``: the rank-local weight, transposed to float32 and checked finite."""
    return _checked_finite(encoder_input(rank_local_weight(checkpoint, job.rank_job, dtype=dtype)))


def _checked_finite(weight: torch.Tensor) -> torch.Tensor:
    if not torch.isfinite(weight).all():
        bad = int((~torch.isfinite(weight)).sum())
        raise ValueError(f"{bad} non-finite weight values in the rank-local weight; nothing was published")
    return weight


def _through_store(job: WarmJob, store: CacheStore, worker: int, encode_fn: Callable[[], EncodedLinear]) -> JobResult:
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
    return f"encoded, but publishing failed ({reason or 'lock timeout or OS error on the cache'}); nothing was written"


def _blocked(job: WarmJob, store: CacheStore, worker: int) -> Optional[JobResult]:
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


def _failed(job: WarmJob, worker: int, exc: BaseException, seconds: float) -> JobResult:
    return job_result(job, "failed", worker, seconds=seconds, error=describe(exc))


def _loaded_result(job: WarmJob, loaded: LoadResult, store: CacheStore, worker: int, seconds: float) -> JobResult:
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

    def __init__(self, jobs: list[WarmJob], prepare: Callable[[WarmJob], torch.Tensor], depth: int = 1) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(list(jobs), prepare), name="exl3tool-prefetch",
                                        daemon=True)
        self._thread.start()

    def _run(self, jobs: list[WarmJob], prepare: Callable[[WarmJob], torch.Tensor]) -> None:
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

    def next(self) -> tuple[WarmJob, Optional[torch.Tensor], Optional[BaseException]]:
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


class _Pipeline:
    """``run_plan`` with overlap: prefetch thread, encodes on the calling thread, one publishing thread.

    In readwrite mode each job follows ``CacheStore.load_or_encode``'s protocol step by step: the unlocked
    look-up (``cached``), the entry lock and the re-check under it (``claim``), the encode, then
    ``publish_claimed`` on the publishing thread, which writes and releases the lock. Other modes call
    ``load_or_encode`` itself. Results and callbacks stay in job order on the calling thread.
    """

    MAX_PUBLISHES = 2  # claimed entries in flight (being written or waiting): bounds held locks and memory

    def __init__(self, plan, checkpoint, store, device, worker, dtype, encode, on_start, on_done, on_tiles=None,
                 *, timer: Optional[StageTimer] = None, split: bool = False) -> None:
        self.plan, self.checkpoint, self.store, self.device = plan, checkpoint, store, device
        self.worker, self.dtype, self.encode = worker, dtype, encode
        self.on_start, self.on_done, self.on_tiles = on_start, on_done, on_tiles
        self.pending: deque[tuple[WarmJob, Future]] = deque()
        self.results: list[JobResult] = []
        self.timer, self.split = timer, split
        self._side = torch.cuda.Stream(device) if split else None  # the prefetch thread's stream

    def _prepare(self, job: WarmJob) -> torch.Tensor:
        """On the prefetch thread: the encoder input (without ``split``)."""
        with stage(self.timer, "read"):
            return _prepare_input(job, self.checkpoint, self.dtype)

    def _read(self, job: WarmJob) -> torch.Tensor:
        """On the reading thread (``split``): the rank-local weight in the serving dtype, as read from the shards."""
        with stage(self.timer, "read"):
            return rank_local_weight(self.checkpoint, job.rank_job, dtype=self.dtype)

    def _prepare_on_gpu(self, job: WarmJob, weight: torch.Tensor):
        """On the GPU thread (``split``), on its own stream: copy the serving-dtype weight (half the bytes of float32),
        transpose and widen it to float32 there (exact: the same values as on the host), check it finite, then the
        first half of the encode (``prepare_encode``)."""
        from exl3tool.encode.online import prepare_encode

        with torch.cuda.device(self.device), torch.cuda.stream(self._side):
            with stage(self.timer, "h2d", self.device):
                weight = _checked_finite(encoder_input(weight.to(self.device)))
            prepared = prepare_encode(weight, bits=self.plan.bits, seed=job.key.seed, device=self.device,
                                      timer=self.timer)
            self._side.synchronize()
        return prepared

    def run(self, groups: list[ShareGroup]) -> list[JobResult]:
        """Each group's weight is read once (its leader's: every member's is the same) and encoded at most once."""
        leaders = [g.leader for g in groups]
        reader: Optional[_Prefetcher] = None
        if self.split:  # two stages: the host reads the next weights while the GPU thread prepares the next encode
            reader = _Prefetcher(leaders, self._read)
            prefetch = _Prefetcher(leaders, lambda job: self._prepare_on_gpu(job, _next_input(reader, job)))
        else:
            prefetch = _Prefetcher(leaders, self._prepare)
        publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exl3tool-publish")
        try:
            for group in groups:
                with stage(self.timer, "wait_for_input"):
                    got, weight, error = prefetch.next()
                assert got is group.leader, "prefetch out of order"
                shared = SharedEncode(lambda job, weight=weight, error=error: self._encode_on_cpu(job, weight, error))
                del weight
                for job in group.jobs:
                    self._finish_ready()
                    if self.on_start:
                        self.on_start(job)
                    if self.store.mode == "readwrite":
                        outcome = self._claim_and_encode(job, shared, publisher)
                    else:
                        outcome = _reused(self._load_or_encode(job, shared), shared, job)
                    if not isinstance(outcome, Future):
                        outcome = _done(outcome)
                    self.pending.append((job, outcome))
                    self._finish_ready()
                shared.release()  # in-flight publishes hold their own reference
                del shared
            self._finish_ready(wait=True)
        finally:
            prefetch.close()
            if reader is not None:
                reader.close()
            publisher.shutdown(wait=True)  # in-flight publishes complete and release their locks
        return self.results

    def _finish_ready(self, wait: bool = False) -> None:
        """Report finished jobs in order (results, ``on_done``), on this thread; ``wait`` for all of them."""
        while self.pending and (wait or self.pending[0][1].done()):
            job, fut = self.pending.popleft()
            result = fut.result()
            self.results.append(result)
            if self.on_done:
                self.on_done(job, result)

    def _encode_on_cpu(self, job: WarmJob, weight, error: Optional[BaseException]) -> EncodedLinear:
        """The group's encode (or the error preparing its weight), copied to the CPU: publishing never touches the device.

        With ``split`` the prefetch thread has done the first half (``weight`` is its ``ScaledWeight``).
        """
        if error is not None:
            raise error
        if self.split:
            from exl3tool.encode.online import finish_encode

            weight.record_stream(torch.cuda.current_stream(self.device))
            progress = None if self.on_tiles is None else (lambda n: self.on_tiles(job, n))
            encoded = finish_encode(weight, progress=progress, timer=self.timer)
        else:
            encoded = _call_encode(self.encode, job, weight, self.plan.bits, self.device, self.on_tiles)
        with stage(self.timer, "to_cpu"):
            return replace(encoded, **encoded.tensors())

    def _load_or_encode(self, job: WarmJob, shared: SharedEncode) -> JobResult:
        return _through_store(job, self.store, self.worker, lambda: shared(job))

    def _claim_and_encode(self, job: WarmJob, shared: SharedEncode, publisher: ThreadPoolExecutor):
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
        claimed: Optional[Claim] = None
        unavailable: Optional[str] = None
        try:
            got = store.claim(job.key, cross_thread=True)
        except (Timeout, OSError) as exc:  # encode without the cache, as load_or_encode does
            store.note_unavailable(job.key, exc)
            unavailable = store.unpublished_reason(job.path, exc)
        else:
            if isinstance(got, LoadResult):  # another process published it meanwhile
                return _loaded_result(job, got, store, worker, time.perf_counter() - start)
            claimed = got
        try:
            encoded = shared(job)
            check_fresh_encode(job.key, encoded.tensors(), encoded.proxy_error)
        except Exception as exc:
            if claimed is not None:
                claimed.release()
            return _failed(job, worker, exc, time.perf_counter() - start)
        except BaseException:
            if claimed is not None:
                claimed.release()
            raise
        reuse = shared.reused_by(job)
        if claimed is None:
            return job_result(job, "failed", worker, seconds=time.perf_counter() - start,
                           proxy_error=encoded.proxy_error, error=_publish_failed(unavailable), reused_from=reuse)
        encode_seconds = time.perf_counter() - start
        try:
            self._wait_for_publish_slot()
            return publisher.submit(self._publish, job, claimed, encoded, encode_seconds, reuse)
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

    def _publish(self, job: WarmJob, claimed: Claim, encoded: EncodedLinear, encode_seconds: float,
                 reuse: Optional[str] = None) -> JobResult:
        """On the publishing thread: write and release; never raises."""
        start = time.perf_counter()
        try:
            with stage(self.timer, "publish"):
                loaded = self.store.publish_claimed(claimed, encoded)
            result = _loaded_result(job, loaded, self.store, self.worker, encode_seconds + time.perf_counter() - start)
        except BaseException as exc:  # e.g. releasing the lock failed; the claim is released either way
            claimed.release()
            result = job_result(job, "failed", self.worker, seconds=encode_seconds + time.perf_counter() - start,
                                proxy_error=encoded.proxy_error, error=_publish_failed(describe(exc)))
        return result if reuse is None or result.status == "hit" else replace(result, reused_from=reuse)


def _next_input(reader: "_Prefetcher", job: WarmJob) -> torch.Tensor:
    """The reading stage's weight for ``job`` (its error re-raised: it becomes that job's failure)."""
    got, weight, error = reader.next()
    assert got is job, "read ahead out of order"
    if error is not None:
        raise error
    return weight


def _done(result: JobResult) -> Future:
    fut: Future = Future()
    fut.set_result(result)
    return fut
