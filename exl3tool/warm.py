"""Plan and run the encoding of a model's eligible layers into the cache, for one or many TP layouts.

A *plan* lists one job per (layer, TP size, TP rank) with its cache key, entry path and current
state (hit, miss, invalid, skipped), so `--dry-run` costs only look-ups. Running a plan encodes the
misses in order of decreasing tile count and publishes each through the cache store, which makes
concurrent writers (other processes, other hosts on a shared cache) safe. By default reading the next weights
and publishing run on background threads while the calling thread encodes (``run_plan(overlap=True)``). Under torchrun every
process takes a deterministic, tile-balanced share of the jobs and rank 0 gathers the summary.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from filelock import Timeout

from exl3tool.cache import CacheKey, CacheStore, Claim, LoadResult, entry_path
from exl3tool.cache.entry import check_fresh_encode
from exl3tool.checkpoint import Checkpoint, FetchInfo, LayerPlan, RankJob, encoder_input, rank_local_weight
from exl3tool.encode.encoded import EncodedLinear

__all__ = [
    "WarmJob", "WarmPlan", "JobResult", "WarmSummary", "build_plan", "run_plan", "share_jobs",
    "distributed_context", "gather_results", "agreed_todo", "resolve_device", "WarmRequest", "prepare", "warm", "summarize", "host_threads",
]


@dataclass(frozen=True)
class WarmJob:
    """One (layer, TP size, rank) to encode: its rank-local shape, cache key and state before running."""

    prefix: str
    tp_size: int
    tp_rank: int
    input_size: int
    output_size: int
    key: CacheKey
    path: Path
    state: str  # "hit" | "miss" | "invalid" (present but would not load) | "skipped"
    reason: str = ""
    rank_job: Optional[RankJob] = field(default=None, compare=False, repr=False)

    @property
    def tiles(self) -> int:
        return (self.input_size // 16) * (self.output_size // 16)

    @property
    def digest(self) -> str:
        return self.key.digest()


@dataclass(frozen=True)
class WarmPlan:
    """Every job of a warm, with the identities and settings that went into their keys."""

    model: str
    model_identity: str
    encoder_identity: str
    bits: int
    tp_sizes: tuple[int, ...]
    cache_root: Path
    mode: str
    jobs: tuple[WarmJob, ...]
    layer_plan: Optional[LayerPlan] = field(default=None, compare=False, repr=False)  # overlay, kind, excluded
    fetch: Optional[FetchInfo] = None  # what a selective Hub download fetched

    def count(self, state: str) -> int:
        return sum(1 for j in self.jobs if j.state == state)

    @property
    def todo(self) -> list[WarmJob]:
        """Jobs that need an encode (missing or invalid entries), largest first."""
        pending = [j for j in self.jobs if j.state in ("miss", "invalid")]
        return sorted(pending, key=lambda j: (-j.tiles, j.digest))


@dataclass(frozen=True)
class JobResult:
    """What happened to one job: hit, encoded, skipped or failed, with timing and the error if any."""

    prefix: str
    tp_size: int
    tp_rank: int
    input_size: int
    output_size: int
    status: str  # "hit" | "encoded" | "skipped" | "failed"
    digest: str
    path: Optional[str]
    seconds: float = 0.0
    bytes: int = 0
    proxy_error: Optional[float] = None
    error: str = ""
    worker: int = 0


@dataclass(frozen=True)
class WarmSummary:
    """The machine-readable outcome of a warm (the `--json` document)."""

    model: str
    model_identity: str
    encoder_identity: str
    bits: int
    tp_sizes: list[int]
    cache_root: str
    device: str
    workers: int
    counts: dict[str, int]
    bytes_written: int
    seconds: float
    entries: list[JobResult]
    worker_stats: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.counts.get("failed", 0) == 0


def build_plan(
    checkpoint: Checkpoint,
    layer_plan: LayerPlan,
    *,
    tp_sizes: Iterable[int],
    bits: int,
    model_identity: str,
    encoder_identity: str,
    store: CacheStore,
    tp_ranks: Optional[Iterable[int]] = None,
) -> WarmPlan:
    """One job per (layer, TP size, rank), each looked up in the store (read-only) to learn its state."""
    tp_sizes = tuple(sorted(set(int(t) for t in tp_sizes)))
    jobs: list[WarmJob] = []
    wanted = None if tp_ranks is None else set(tp_ranks)
    for tp in tp_sizes:
        reasons = {(prefix, rank): reason for prefix, rank, reason in layer_plan.skipped(tp)}
        for rj in layer_plan.for_tp(tp, include_skipped=True):
            if wanted is not None and rj.tp_rank not in wanted:
                continue
            key = CacheKey.for_layer(
                model_identity=model_identity, encoder_identity=encoder_identity, prefix=rj.prefix,
                bits=bits, tp_world_size=tp, tp_rank=rj.tp_rank, input_size=rj.input_size,
                output_size=rj.output_size,
            )
            reason = reasons.get((rj.prefix, rj.tp_rank), "")
            if not rj.aligned:
                state = "skipped"
            elif store.mode == "off":
                state = "miss"
            else:
                found = store.lookup(key, quick=True)  # headers and scales, not the trellis bytes
                state, reason = found.status, found.reason or ""
            jobs.append(WarmJob(rj.prefix, tp, rj.tp_rank, rj.input_size, rj.output_size, key,
                                entry_path(key, store.root), state, reason, rj))
    return WarmPlan(
        model=checkpoint.model, model_identity=model_identity, encoder_identity=encoder_identity, bits=bits,
        tp_sizes=tp_sizes, cache_root=store.root, mode=store.mode, jobs=tuple(jobs), layer_plan=layer_plan,
        fetch=checkpoint.fetch,
    )


def share_jobs(jobs: list[WarmJob], worker: int, workers: int) -> list[WarmJob]:
    """This worker's share: longest-processing-time-first over tile counts, deterministic on every process.

    Jobs are taken largest first (ties by digest) and each goes to the least-loaded worker (ties to the
    lowest worker index), so every process computes the same assignment without talking to the others.
    """
    if workers <= 1:
        return list(jobs)
    load = [0] * workers
    mine: list[WarmJob] = []
    for job in sorted(jobs, key=lambda j: (-j.tiles, j.digest)):
        target = min(range(workers), key=lambda w: (load[w], w))
        load[target] += job.tiles
        if target == worker:
            mine.append(job)
    return mine


EncodeFn = Callable[[torch.Tensor, int, int, torch.device], EncodedLinear]


def _default_encode(weight: torch.Tensor, bits: int, seed: int, device: torch.device) -> EncodedLinear:
    from exl3tool.encode import encode_linear

    return encode_linear(weight.to(device), bits=bits, seed=seed, device=device)


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
    """
    todo = plan.todo if todo is None else todo
    pending = {j.digest for j in todo}
    results: list[JobResult] = []
    if worker == 0:
        for job in plan.jobs:
            if job.state == "skipped":
                results.append(_result(job, "skipped", worker, error=job.reason))
            elif job.digest not in pending:
                results.append(_result(job, "hit", worker, path=str(job.path)))
    mine = share_jobs(todo, worker, workers)
    if overlap and mine:
        results.extend(_Pipeline(plan, checkpoint, store, device, worker, dtype, encode, on_start, on_done).run(mine))
        return results
    for job in mine:
        if on_start:
            on_start(job)
        result = _run_job(job, plan, checkpoint, store, device, worker, dtype, encode)
        results.append(result)
        if on_done:
            on_done(job, result)
    return results


def _prepare_input(job: WarmJob, checkpoint: Checkpoint, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The encoder's input for ``job``: the rank-local weight, transposed to float32 and checked finite."""
    weight = encoder_input(rank_local_weight(checkpoint, job.rank_job, dtype=dtype))
    if not torch.isfinite(weight).all():
        bad = int((~torch.isfinite(weight)).sum())
        raise ValueError(f"{bad} non-finite weight values in the rank-local weight; nothing was published")
    return weight


def _run_job(job, plan, checkpoint, store, device, worker, dtype, encode) -> JobResult:
    return _through_store(job, store, worker,
                          lambda: encode(_prepare_input(job, checkpoint, dtype), plan.bits, job.key.seed, device))


def _through_store(job: WarmJob, store: CacheStore, worker: int, encode_fn: Callable[[], EncodedLinear]) -> JobResult:
    """``store.load_or_encode`` for one job, as a result: a failed layer never stops the warm."""
    start = time.perf_counter()
    try:
        loaded = store.load_or_encode(job.key, encode_fn)
    except Exception as exc:
        return _failed(job, worker, exc, time.perf_counter() - start)
    return _loaded_result(job, loaded, store, worker, time.perf_counter() - start)


_PUBLISH_FAILED = "encoded, but publishing failed (lock timeout or OS error on the cache); nothing was written"


def _failed(job: WarmJob, worker: int, exc: BaseException, seconds: float) -> JobResult:
    return _result(job, "failed", worker, seconds=seconds, error=f"{type(exc).__name__}: {exc}")


def _loaded_result(job: WarmJob, loaded: LoadResult, store: CacheStore, worker: int, seconds: float) -> JobResult:
    if loaded.hit:  # another process published it meanwhile
        return _result(job, "hit", worker, path=str(loaded.path), seconds=seconds, proxy_error=loaded.proxy_error)
    size = loaded.path.stat().st_size if loaded.path is not None and loaded.path.exists() else 0
    status = "encoded" if (loaded.path is not None or store.mode != "readwrite") else "failed"
    error = "" if status == "encoded" else _PUBLISH_FAILED
    return _result(job, status, worker, path=str(loaded.path) if loaded.path else None, seconds=seconds,
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

    def __init__(self, plan, checkpoint, store, device, worker, dtype, encode, on_start, on_done) -> None:
        self.plan, self.checkpoint, self.store, self.device = plan, checkpoint, store, device
        self.worker, self.dtype, self.encode = worker, dtype, encode
        self.on_start, self.on_done = on_start, on_done
        self.pending: deque[tuple[WarmJob, Future]] = deque()
        self.results: list[JobResult] = []

    def run(self, jobs: list[WarmJob]) -> list[JobResult]:
        prefetch = _Prefetcher(jobs, lambda job: _prepare_input(job, self.checkpoint, self.dtype))
        publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exl3tool-publish")
        try:
            for job in jobs:
                got, weight, error = prefetch.next()
                assert got is job, "prefetch out of order"
                self._finish_ready()
                if self.on_start:
                    self.on_start(job)
                if self.store.mode == "readwrite":
                    outcome = self._claim_and_encode(job, weight, error, publisher)
                else:
                    outcome = self._load_or_encode(job, weight, error)
                del weight
                if not isinstance(outcome, Future):
                    outcome = _done(outcome)
                self.pending.append((job, outcome))
                self._finish_ready()
            self._finish_ready(wait=True)
        finally:
            prefetch.close()
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

    def _encode(self, job: WarmJob, weight: torch.Tensor) -> EncodedLinear:
        return self.encode(weight, self.plan.bits, job.key.seed, self.device)

    def _load_or_encode(self, job, weight, error) -> JobResult:
        def encode_fn():
            if error is not None:
                raise error
            return self._encode(job, weight)

        return _through_store(job, self.store, self.worker, encode_fn)

    def _claim_and_encode(self, job, weight, error, publisher: ThreadPoolExecutor):
        store, worker = self.store, self.worker
        start = time.perf_counter()
        try:
            hit = store.cached(job.key)
        except Exception as exc:
            return _failed(job, worker, exc, time.perf_counter() - start)
        if hit is not None:
            return _loaded_result(job, hit, store, worker, time.perf_counter() - start)
        claimed: Optional[Claim] = None
        try:
            got = store.claim(job.key, cross_thread=True)
        except (Timeout, OSError) as exc:  # encode without the cache, as load_or_encode does
            store.note_unavailable(job.key, exc)
        else:
            if isinstance(got, LoadResult):  # another process published it meanwhile
                return _loaded_result(job, got, store, worker, time.perf_counter() - start)
            claimed = got
        try:
            if error is not None:
                raise error
            encoded = self._encode(job, weight)
            encoded = replace(encoded, **encoded.tensors())  # copied to the CPU here: publishing never touches the device
            check_fresh_encode(job.key, encoded.tensors(), encoded.proxy_error)
        except Exception as exc:
            if claimed is not None:
                claimed.release()
            return _failed(job, worker, exc, time.perf_counter() - start)
        except BaseException:
            if claimed is not None:
                claimed.release()
            raise
        if claimed is None:
            return _result(job, "failed", worker, seconds=time.perf_counter() - start,
                           proxy_error=encoded.proxy_error, error=_PUBLISH_FAILED)
        encode_seconds = time.perf_counter() - start
        while sum(not f.done() for _, f in self.pending) >= self.MAX_PUBLISHES:
            next(f for _, f in self.pending if not f.done()).result()
            self._finish_ready()
        try:
            return publisher.submit(self._publish, job, claimed, encoded, encode_seconds)
        except BaseException:
            claimed.release()
            raise

    def _publish(self, job: WarmJob, claimed: Claim, encoded: EncodedLinear, encode_seconds: float) -> JobResult:
        """On the publishing thread: write and release; never raises."""
        start = time.perf_counter()
        try:
            loaded = self.store.publish_claimed(claimed, encoded)
            return _loaded_result(job, loaded, self.store, self.worker, encode_seconds + time.perf_counter() - start)
        except BaseException as exc:  # e.g. releasing the lock failed; the claim is released either way
            claimed.release()
            return _result(job, "failed", self.worker, seconds=encode_seconds + time.perf_counter() - start,
                           proxy_error=encoded.proxy_error, error=f"{_PUBLISH_FAILED} ({type(exc).__name__}: {exc})")


def _done(result: JobResult) -> Future:
    fut: Future = Future()
    fut.set_result(result)
    return fut


def _result(job: WarmJob, status: str, worker: int, *, path=None, seconds=0.0, bytes_=0, proxy_error=None, error="") -> JobResult:
    return JobResult(job.prefix, job.tp_size, job.tp_rank, job.input_size, job.output_size, status, job.digest,
                     path, round(seconds, 4), bytes_, proxy_error, error, worker)


def summarize(plan: WarmPlan, results: list[JobResult], *, device: str, workers: int, seconds: float) -> WarmSummary:
    """Counts, bytes and per-entry results in plan order."""
    order = {(j.prefix, j.tp_size, j.tp_rank): i for i, j in enumerate(plan.jobs)}
    results = sorted(results, key=lambda r: order.get((r.prefix, r.tp_size, r.tp_rank), 0))
    counts = {s: sum(1 for r in results if r.status == s) for s in ("hit", "encoded", "skipped", "failed")}
    return WarmSummary(
        model=plan.model, model_identity=plan.model_identity, encoder_identity=plan.encoder_identity,
        bits=plan.bits, tp_sizes=list(plan.tp_sizes), cache_root=str(plan.cache_root), device=device,
        workers=workers, counts=counts, bytes_written=sum(r.bytes for r in results if r.status == "encoded"),
        seconds=round(seconds, 3), entries=results,
    )


# ---------------------------------------------------------------------------------------------------
# torchrun support


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands under torchrun (or alone): its worker index, the count, its local rank."""

    worker: int
    workers: int
    local_rank: int
    initialised: bool


def distributed_context() -> DistributedContext:
    """Join the torchrun group if launched by torchrun (gloo: only small objects are exchanged)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistributedContext(0, 1, int(os.environ.get("LOCAL_RANK", "0")), False)
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    return DistributedContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), True)


def worker_stats(ctx: DistributedContext, device: torch.device, seconds: float) -> dict:
    """This process's peak host memory (RSS) and peak device memory, for the summary."""
    import resource
    import socket

    stats = {"worker": ctx.worker, "host": socket.gethostname(), "device": str(device), "seconds": round(seconds, 3),
             "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if device.type == "cuda":
        stats["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return stats


def gather_results(ctx: DistributedContext, results: list[JobResult], stats: dict) -> Optional[tuple[list[JobResult], list[dict]]]:
    """All workers' results and stats on worker 0 (None elsewhere); a no-op without torchrun."""
    if not ctx.initialised:
        return results, [stats]
    import torch.distributed as dist

    gathered: list = [None] * ctx.workers if ctx.worker == 0 else None
    dist.gather_object((results, stats), gathered, dst=0)
    if ctx.worker != 0:
        return None
    return [r for part, _ in gathered for r in part], [st for _, st in gathered]


def agreed_todo(ctx: DistributedContext, plan: WarmPlan) -> list[WarmJob]:
    """The pending jobs as worker 0 planned them, on every worker.

    Workers start at slightly different times; one that looks the cache up after another has already
    published would otherwise compute a different share and a job could fall between two workers.
    """
    if not ctx.initialised:
        return plan.todo
    import torch.distributed as dist

    box = [[j.digest for j in plan.todo] if ctx.worker == 0 else None]
    dist.broadcast_object_list(box, src=0)
    by_digest = {j.digest: j for j in plan.jobs}
    missing = [d for d in box[0] if d not in by_digest]
    if missing:
        from exl3tool.errors import ConfigError

        raise ConfigError(f"worker {ctx.worker} planned different jobs than worker 0 ({len(missing)} unknown); "
                          "every worker must see the same checkpoint, options and cache directory")
    return [by_digest[d] for d in box[0]]


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """`auto` is this process's GPU (LOCAL_RANK under torchrun) when CUDA is present, else the CPU.

    A bare `cuda` gets the same index as `auto` would, so the result always names one GPU (which
    ``torch.cuda.set_device`` and the per-device kernel caches need).
    """
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError as exc:
        raise ValueError(f"--device {spec!r} is not a device (use auto, cpu, cuda or cuda:N)") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {spec}: CUDA is not available on this machine (use --device cpu)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {spec!r}: only cpu and cuda devices are supported")
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        if dev.index is None:
            return torch.device("cuda", local_rank % count)
        if dev.index >= count:
            raise ValueError(f"--device {spec}: this machine has {count} GPU(s) (cuda:0 to cuda:{count - 1})")
    return dev


# ---------------------------------------------------------------------------------------------------
# The whole job, as one library call (what `exl3tool encode` and `exl3tool cache warm` run)


@dataclass(frozen=True)
class WarmRequest:
    """Everything a warm needs; the CLI fills it from options and environment."""

    model: str
    tp_sizes: tuple[int, ...] = (1,)
    tp_ranks: Optional[tuple[int, ...]] = None
    bits: int = 6
    revision: Optional[str] = None
    layers: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    shared_experts: bool = False
    cache_dir: Optional[str] = None
    mode: str = "readwrite"
    device: str = "auto"
    encoder_root: Optional[str] = None
    encoder_revision: Optional[str] = None
    server_path: Optional[str] = None
    dtype: Optional[str] = None
    file_mode: int = 0o600
    overlap: bool = True
    quantization_config: Optional[str] = None  # the server's --quantization-config JSON (None: the default overlay)


def prepare(request: WarmRequest, *, environ: Optional[dict] = None):
    """Open the checkpoint, resolve both identities, plan the layers and look every job up.

    Returns ``(checkpoint, plan, store)``. Raises ConfigError/InputError with a one-line fix.
    """
    from exl3tool.cache import cache_root, encoder_settings, resolve_encoder_identity, resolve_model_identity
    from exl3tool.checkpoint import open_checkpoint, plan_layers, resolve_overlay, tensors_to_fetch
    from exl3tool.errors import ConfigError

    if not 1 <= request.bits <= 8:
        raise ConfigError(f"--bits {request.bits}: must be from 1 to 8 (the server accepts 3 to 8)")
    if any(t < 1 for t in request.tp_sizes):
        raise ConfigError(f"TP sizes must be positive, got {list(request.tp_sizes)}")
    overlay = resolve_overlay(request.quantization_config, shared_experts=request.shared_experts)
    layers, exclude = list(request.layers) or None, list(request.exclude) or None
    checkpoint = open_checkpoint(  # a Hub download fetches only the shards holding planned tensors
        request.model, revision=request.revision,
        select=lambda root, config, names: tensors_to_fetch(root, config, names, overlay, layers, exclude))
    mode = request.mode
    if mode == "off":
        model_id = encoder_id = "cache-disabled"
    else:
        settings = encoder_settings(request.encoder_root, request.encoder_revision, environ=environ)
        encoder_id = resolve_encoder_identity(settings.root, settings.revision).identity
        model_id = resolve_model_identity(
            request.model, revision=request.revision, server_path=request.server_path,
            commit_hash=checkpoint.commit_hash,
        ).identity
    layer_plan = plan_layers(checkpoint, overlay=overlay, layers=layers, exclude=exclude)
    root_dir = Path(request.cache_dir).expanduser() if request.cache_dir else cache_root(environ)
    store = CacheStore(root_dir, mode, file_mode=request.file_mode)
    plan = build_plan(checkpoint, layer_plan, tp_sizes=request.tp_sizes, bits=request.bits,
                      model_identity=model_id, encoder_identity=encoder_id, store=store, tp_ranks=request.tp_ranks)
    return checkpoint, plan, store


def host_threads(initialised: bool, environ: Optional[dict] = None) -> Optional[int]:
    """How many threads host-side torch ops should use in a warm, or None to leave torch's setting alone.

    ``EXL3TOOL_THREADS=N`` always wins. Otherwise, under torchrun (``initialised``) with ``OMP_NUM_THREADS=1``
    (what torchrun sets when the user did not), each process gets its share of the host's cores:
    ``cpu_count // LOCAL_WORLD_SIZE``, at least 1, so reading and checking weights is not single-threaded.
    """
    env = os.environ if environ is None else environ
    explicit = env.get("EXL3TOOL_THREADS", "").strip()
    if explicit:
        try:
            threads = int(explicit)
        except ValueError:
            threads = 0
        if threads < 1:
            from exl3tool.errors import ConfigError

            raise ConfigError(f"EXL3TOOL_THREADS={explicit!r}: must be a positive integer (threads per process)")
        return threads
    if initialised and env.get("OMP_NUM_THREADS", "").strip() == "1":
        try:
            local_world = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            local_world = 1
        return max(1, (os.cpu_count() or 1) // local_world)
    return None


def warm(
    request: WarmRequest,
    *,
    environ: Optional[dict] = None,
    on_start: Optional[Callable[[WarmJob], None]] = None,
    on_done: Optional[Callable[[WarmJob, JobResult], None]] = None,
    on_plan: Optional[Callable[[WarmPlan, DistributedContext, list[WarmJob]], None]] = None,
) -> Optional[WarmSummary]:
    """Plan and run a warm; under torchrun each process runs its share and worker 0 returns the summary.

    Under torchrun, which sets OMP_NUM_THREADS=1, host-side torch ops get cpu_count / LOCAL_WORLD_SIZE threads
    per process; EXL3TOOL_THREADS=N sets the count (see ``host_threads``).
    """
    start = time.perf_counter()
    ctx = distributed_context()
    threads = host_threads(ctx.initialised)
    if threads is not None:
        torch.set_num_threads(threads)
    checkpoint, plan, store = prepare(request, environ=environ)
    device = resolve_device(request.device, ctx.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # kernels and allocations of this process go to its own GPU
    dtype = getattr(torch, request.dtype) if request.dtype else None
    todo = agreed_todo(ctx, plan)
    if on_plan:
        on_plan(plan, ctx, todo)
    results = run_plan(plan, checkpoint, store, device=device, worker=ctx.worker, workers=ctx.workers, todo=todo,
                       dtype=dtype, on_start=on_start, on_done=on_done, overlap=request.overlap)
    gathered = gather_results(ctx, results, worker_stats(ctx, device, time.perf_counter() - start))
    if ctx.initialised:
        import torch.distributed as dist

        dist.destroy_process_group()
    if gathered is None:
        return None
    everything, stats = gathered
    summary = summarize(plan, everything, device=str(device), workers=ctx.workers, seconds=time.perf_counter() - start)
    return replace(summary, worker_stats=stats)
