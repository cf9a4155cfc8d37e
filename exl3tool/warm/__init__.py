"""Plan and run the encoding of a model's eligible layers into the cache, for one or many TP layouts.

One module per job: ``plan`` (jobs, keys, states, the split between workers), ``pipeline`` (encode and publish,
with prefetch and publishing threads), ``results`` (per-job results and the summary), ``distributed`` (torchrun)
and ``request`` (the whole warm as one call: ``prepare`` and ``warm``).
"""

from exl3tool.warm.distributed import (
    DistributedContext, agreed_todo, distributed_context, gather_results, host_threads, worker_stats,
)
from exl3tool.warm.pipeline import EncodeFn, run_plan
from exl3tool.warm.plan import WarmJob, WarmPlan, build_plan, share_jobs
from exl3tool.warm.request import SERVING_DTYPES, WarmRequest, prepare, resolve_device, serving_torch_dtype, warm
from exl3tool.warm.results import JobResult, WarmSummary, job_result, summarize

__all__ = [
    "WarmJob", "WarmPlan", "JobResult", "WarmSummary", "EncodeFn", "build_plan", "run_plan", "share_jobs",
    "distributed_context", "DistributedContext", "gather_results", "agreed_todo", "worker_stats", "host_threads",
    "resolve_device", "WarmRequest", "prepare", "warm", "summarize", "job_result", "SERVING_DTYPES", "serving_torch_dtype",
]
