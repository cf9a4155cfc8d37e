"""The server's settings and the look-up plan: the one input every command shares.

``request`` (``WarmRequest``: what the server will run with; ``prepare``: checkpoint + identities + layer plan +
store into a plan), ``plan`` (``WarmPlan``: one job per layer, TP size and rank, each looked up), ``sharing``
(jobs that read the same weights, shared between workers) and ``shards`` (one shard of a static split of the plan).
``launch/`` fills a request; the operations read it.
"""

from exl3tool.plan.plan import WarmJob, WarmPlan, build_plan
from exl3tool.plan.request import (
    SERVING_DTYPES, WarmRequest, nothing_to_do, prepare, resolve_device, serving_torch_dtype,
)
from exl3tool.plan.sharing import share_jobs
from exl3tool.plan.shards import Shard, resolve_shard

__all__ = ["WarmJob", "WarmPlan", "build_plan", "share_jobs", "SERVING_DTYPES", "WarmRequest", "nothing_to_do",
           "prepare", "resolve_device", "serving_torch_dtype", "Shard", "resolve_shard"]
