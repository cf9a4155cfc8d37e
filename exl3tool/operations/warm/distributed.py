"""torchrun support: join the group, agree on the pending jobs, gather results on worker 0, share host threads."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch

from exl3tool.plan.plan import LookupJob, LookupPlan
from exl3tool.operations.warm.results import JobResult

__all__ = ["DistributedContext", "distributed_context", "worker_stats", "gather_results", "agreed_todo", "host_threads",
           "group_timeout"]


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands under torchrun (or alone): its worker index, the count, its local rank."""

    worker: int
    workers: int
    local_rank: int
    initialised: bool


def group_timeout(environ: Optional[dict] = None) -> timedelta:
    """How long a worker waits in a collective: ``EXL3TOOL_DIST_TIMEOUT_S`` seconds, by default 24 hours.

    Worker 0 gathers results when its own share is done and then waits for the slowest worker; gloo's
    default (30 minutes) would abort a long warm whose shares finish far apart (mixed GPUs, a busy host).
    A worker that dies is noticed sooner anyway: torchrun stops the whole group.
    """
    from exl3tool.knobs import knob_value

    return timedelta(seconds=knob_value("EXL3TOOL_DIST_TIMEOUT_S", environ))


def distributed_context() -> DistributedContext:
    """Join the torchrun group if launched by torchrun (gloo: only small objects are exchanged)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistributedContext(0, 1, int(os.environ.get("LOCAL_RANK", "0")), False)
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", timeout=group_timeout())
    return DistributedContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), True)


def worker_stats(ctx: DistributedContext, device: torch.device, seconds: float, *,
                 stages: Optional[dict] = None, run_seconds: Optional[float] = None) -> dict:
    """This process's peak host memory (RSS) and peak device memory, for the summary.

    ``stages`` (``StageTimer.as_dict``) are the seconds per pipeline stage, summed over jobs; ``run_seconds`` the
    wall time of encoding and publishing (without planning). Stages on the prefetch and publishing threads overlap
    the calling thread's (``wait_for_input``, ``viterbi``, ``pack``, ``to_cpu``).
    """
    import resource
    import socket

    stats = {"worker": ctx.worker, "host": socket.gethostname(), "device": str(device), "seconds": round(seconds, 3),
             "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
             "peak_cuda_mib": None, "gpu_budget_mib": None}  # always present: null on a CPU worker
    if device.type == "cuda":
        stats["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    if run_seconds is not None:
        stats["run_seconds"] = round(run_seconds, 3)
    if stages is not None:
        stats["stages"] = stages
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


def agreed_todo(ctx: DistributedContext, plan: LookupPlan) -> list[LookupJob]:
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


def host_threads(initialised: bool, environ: Optional[dict] = None) -> Optional[int]:
    """How many threads host-side torch ops should use in a warm, or None to leave torch's setting alone.

    ``EXL3TOOL_THREADS=N`` always wins. Otherwise, under torchrun (``initialised``) with ``OMP_NUM_THREADS=1``
    (what torchrun sets when the user did not), each process gets its share of the host's cores:
    ``cpu_count // LOCAL_WORLD_SIZE``, at least 1, so reading and checking weights is not single-threaded.
    """
    env = os.environ if environ is None else environ
    from exl3tool.knobs import knob_value

    threads = knob_value("EXL3TOOL_THREADS", env)
    if threads is not None:
        return threads
    if initialised and env.get("OMP_NUM_THREADS", "").strip() == "1":
        try:
            local_world = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            local_world = 1
        return max(1, (os.cpu_count() or 1) // local_world)
    return None
