"""The whole warm as one library call (what ``exl3tool encode`` and ``exl3tool cache warm`` run).

``warm`` prepares the plan (``exl3tool.plan.prepare``), runs it on this process's device, under torchrun on its
share, and returns the summary on worker 0.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch

from exl3tool.cache.entry import entry_bytes
from exl3tool.operations.warm.distributed import (
    DistributedContext, agreed_todo, distributed_context, gather_results, host_threads, worker_stats,
)
from exl3tool.operations.parity import EncoderParity
from exl3tool.operations.warm.pipeline import run_plan
from exl3tool.operations.warm.results import JobResult, WarmSummary, job_result, summarize
from exl3tool.operations.warm.unchecked import UncheckedHit, check_unchecked
from exl3tool.plan.plan import LookupJob, LookupPlan
from exl3tool.plan.request import ServerRequest, prepare, resolve_device, serving_torch_dtype
from exl3tool.timing import StageTimer

__all__ = ["warm"]


def _memory_budget(device: torch.device, gib: Optional[float]) -> Optional[int]:
    """This worker's GPU memory budget in bytes (``device_budget``); None on the CPU."""
    if device.type != "cuda":
        if gib is not None:
            from exl3tool.errors import ConfigError

            raise ConfigError(f"--gpu-memory {gib}: this warm runs on {device}; drop the option or use a CUDA device")
        return None
    from exl3tool.encode.memory import device_budget

    return device_budget(device, gib)


def warm(
    request: ServerRequest,
    *,
    environ: Optional[dict] = None,
    on_start: Optional[Callable[[LookupJob], None]] = None,
    on_done: Optional[Callable[[LookupJob, JobResult], None]] = None,
    on_plan: Optional[Callable[[LookupPlan, DistributedContext, list[LookupJob]], None]] = None,
    on_tiles: Optional[Callable[[LookupJob, int], None]] = None,
    on_checked: Optional[Callable[[UncheckedHit], None]] = None,
    on_parity: Optional[Callable[[EncoderParity], None]] = None,
    command: str = "cache warm",
) -> Optional[WarmSummary]:
    """Plan and run a warm; under torchrun each process runs its share and worker 0 returns the summary.

    With ``request.check_unchecked`` worker 0 then checks every hit without exl3tool's checksum exactly and
    replaces those that differ (``check_unchecked``; ``on_checked`` hears of each); a replaced one is reported
    ``encoded``.

    Under torchrun, which sets OMP_NUM_THREADS=1, host-side torch ops get cpu_count / LOCAL_WORLD_SIZE threads
    per process; EXL3TOOL_THREADS=N sets the count (see ``host_threads``). In readwrite mode the entries written or
    found are recorded with their provenance (``exl3tool.cache.records``), as ``command`` (``cache warm``, ``encode``).

    Args:
        request: what to warm (``exl3tool.plan.ServerRequest``).
        environ: the environment identities and the cache root are read from (None: ``os.environ``).
        on_start, on_done, on_plan, on_tiles, on_checked: progress callbacks (a job starts, ends, the plan is known,
            tiles are quantized, an unchecked hit was checked).
        on_parity: hears the encoder parity verdict before the first write (``operations.parity``); a ``differs``
            verdict raises ConfigError (exit 2) instead, unless ``request.trust_encoder_identity``.
        command: the command recorded in the entries' provenance.

    Returns:
        The ``WarmSummary`` (counts, per-job results, worker stats) on worker 0; None on the other torchrun workers.
    """
    start = time.perf_counter()
    ctx = distributed_context()
    threads = host_threads(ctx.initialised)
    if threads is not None:
        torch.set_num_threads(threads)
    checkpoint, plan, store = prepare(request, environ=environ, check_hits=ctx.worker == 0)  # worker 0's plan rules
    if store.mode == "readwrite":  # no write where the root or the plan depends on a release nothing named
        from exl3tool.operations.release_rules import refuse_undetermined, release_rules

        refuse_undetermined(request, release_rules(request, checkpoint.config, environ, writes=True)[0],
                            f"what this {command} writes")
    device = resolve_device(request.device, ctx.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # kernels and allocations of this process go to its own GPU
    dtype = serving_torch_dtype(request.dtype)
    budget = _memory_budget(device, request.gpu_memory_gib)
    todo = agreed_todo(ctx, plan)
    parity = None
    if todo and store.mode == "readwrite":
        parity = _parity(plan, request, device)  # before anything is written: may we write under this identity?
        if on_parity and parity is not None:
            on_parity(parity)
        store.check_writable()  # fail in a second, not after encoding every layer
        from exl3tool.encode.online import encoder_platform

        platform = encoder_platform(device)  # recorded in each entry's header
        store.check_free_space(sum(entry_bytes(j.key, platform) for j in todo), len(todo))  # all workers' share: one disk
    if on_plan:
        on_plan(plan, ctx, todo)
    timer = StageTimer()
    run_start = time.perf_counter()
    results = run_plan(plan, checkpoint, store, device=device, worker=ctx.worker, workers=ctx.workers, todo=todo,
                       dtype=dtype, on_start=on_start, on_done=on_done, overlap=request.overlap,
                       on_tiles=on_tiles, lock_timeout=request.lock_timeout, memory_budget=budget, timer=timer)
    run_seconds = time.perf_counter() - run_start
    unchecked = None
    if request.check_unchecked and ctx.worker == 0 and store.mode == "readwrite":
        unchecked = check_unchecked(plan, checkpoint, store, device=device, dtype=dtype, on_done=on_checked)
        results = _with_replaced(results, plan, unchecked)
    stats = worker_stats(ctx, device, time.perf_counter() - start, stages=timer.as_dict(), run_seconds=run_seconds)
    if budget is not None:
        stats["gpu_budget_mib"] = round(budget / 2**20, 1)
    gathered = gather_results(ctx, results, stats)
    if ctx.initialised:
        import torch.distributed as dist

        dist.destroy_process_group()
    if gathered is None:
        return None
    everything, stats = gathered
    summary = summarize(plan, everything, device=str(device), workers=ctx.workers, seconds=time.perf_counter() - start,
                        unchecked=unchecked)
    summary = replace(summary, worker_stats=stats, encoder_parity=parity.as_json() if parity is not None else None)
    if store.mode == "readwrite":  # provenance of what this warm wrote or found, beside the entries (``command``)
        from exl3tool.operations.warm.provenance import record_warm

        summary = record_warm(summary, plan, checkpoint, request, store, command=command)
    return summary


def _parity(plan: LookupPlan, request: ServerRequest, device: torch.device) -> Optional[EncoderParity]:
    """The encoder parity of the plan's encoder identity (every worker decides it before writing, same verdict);
    ConfigError on ``differs`` unless trusted."""
    if plan.identities is None:
        return None
    from exl3tool.operations.parity import check_parity, encoder_parity

    eid = plan.identities.encoder
    view = request.server_view  # a launch's filesystem: where the server's encoder root is here, if anywhere
    root_here = view.to_host(eid.root) if view is not None else eid.root
    parity = encoder_parity(eid, bits=plan.bits, device=str(device), encoder_source=request.encoder_source,
                            image=request.encoder_image, runner=request.encoder_image_runner, root_here=root_here)
    check_parity(parity, request.trust_encoder_identity)
    return parity


def _with_replaced(results: list[JobResult], plan: LookupPlan, checked: list[UncheckedHit]) -> list[JobResult]:
    """``results`` with each replaced unchecked hit reported ``encoded`` (its new file's size, the time taken) and
    each hit whose check could not run ``failed`` (the entry is kept; the error says why)."""
    by_digest = {c.digest: c for c in checked if c.action == "replaced" or c.verdict == "error"}
    jobs = {j.digest: j for j in plan.jobs}
    out = []
    for r in results:
        c = by_digest.get(r.digest)
        if c is None or r.status != "hit":
            out.append(r)
        elif c.verdict == "error":
            out.append(job_result(jobs[r.digest], "failed", r.worker, path=c.path, seconds=c.seconds,
                                  error=f"--check-unchecked could not check this entry (kept): {c.detail}"))
        else:
            size = Path(c.path).stat().st_size if Path(c.path).exists() else 0
            out.append(job_result(jobs[r.digest], "encoded", r.worker, path=c.path, seconds=c.seconds, bytes_=size))
    return out
