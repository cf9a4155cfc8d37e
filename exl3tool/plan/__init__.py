"""The server's settings and the look-up plan: the one input every command shares.

``request`` (``ServerRequest``: what the server will run with; ``prepare``: checkpoint + identities + layer plan +
store into a plan), ``plan`` (``LookupPlan``: one job per layer, TP size and rank, each looked up), ``sharing``
(jobs that read the same weights, shared between workers) and ``shards`` (one shard of a static split of the plan).
``launch/`` fills a request; the operations read it.
"""

from exl3tool.lazy import lazy_exports

# Each name is imported from its module on first use (exl3tool.lazy): importing the package imports none.
__getattr__, __dir__ = lazy_exports(__name__, {
    "exl3tool.plan.plan": ("LookupJob", "LookupPlan", "build_plan", "WarmJob", "WarmPlan"),
    "exl3tool.plan.request": ("SERVING_DTYPES", "ServerRequest", "nothing_to_do", "prepare", "resolve_device",
                              "serving_torch_dtype", "WarmRequest"),
    "exl3tool.plan.sharing": ("share_jobs",),
    "exl3tool.plan.shards": ("Shard", "resolve_shard"),
})

__all__ = ["LookupJob", "LookupPlan", "build_plan", "share_jobs", "SERVING_DTYPES", "ServerRequest", "nothing_to_do",
           "prepare", "resolve_device", "serving_torch_dtype", "Shard", "resolve_shard"]
