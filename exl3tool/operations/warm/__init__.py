"""Run a plan: encode a model's missing entries into the cache, for one or many TP layouts.

One module per job: ``pipeline`` (encode and publish, with prefetch and publishing threads), ``results`` (per-job
results and the summary), ``distributed`` (torchrun), ``lockwait`` (entries another process holds), ``unchecked``
(``--check-unchecked``), ``provenance`` (the records a warm writes) and ``run`` (the whole warm as one call:
``warm``). The plan it runs is ``exl3tool.plan`` 's.
"""

from exl3tool.lazy import lazy_exports

# Each name is imported from its module on first use (exl3tool.lazy): importing the package imports none.
__getattr__, __dir__ = lazy_exports(__name__, {
    "exl3tool.operations.warm.distributed": ("DistributedContext", "agreed_todo", "distributed_context",
                                             "gather_results", "host_threads", "worker_stats"),
    "exl3tool.operations.warm.pipeline": ("EncodeFn", "run_plan"),
    "exl3tool.operations.warm.results": ("JobResult", "WarmSummary", "job_result", "summarize"),
    "exl3tool.operations.warm.run": ("warm",),
})

__all__ = [
    "JobResult", "WarmSummary", "EncodeFn", "run_plan", "distributed_context", "DistributedContext",
    "gather_results", "agreed_todo", "worker_stats", "host_threads", "warm", "summarize", "job_result",
]
