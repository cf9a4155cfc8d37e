"""Hits a warm cannot vouch for: entries without exl3tool's checksum (the server writes none), named, and on request
checked exactly against a fresh encode (``cache warm --check-unchecked``) and replaced when they differ.

A checksum-less entry that passes the server's checks is a hit, as the server would load it; only its weights can
say whether it is right. ``check_unchecked`` re-encodes each one from the checkpoint (same key: same seed and
bits), compares with ``exl3tool.operations.exact.compare_exact`` and, under the entry lock, publishes the fresh encode over an
entry that ``differs``; ``identical``, ``equivalent`` (another platform's encode) and ``unproved`` entries are kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from exl3tool.cache import CacheStore
from exl3tool.cache.store import UNCHECKED_HIT
from exl3tool.checkpoint import Checkpoint, encoder_input, rank_local_weight
from exl3tool.errors import describe
from exl3tool.operations.exact import ExactCheck, compare_exact, fresh_encode
from exl3tool.plan.plan import LookupJob, LookupPlan

__all__ = ["UncheckedHit", "unchecked_jobs", "unchecked_hits", "check_unchecked"]


@dataclass(frozen=True)
class UncheckedHit:
    """One hit without exl3tool's checksum; with ``--check-unchecked`` also what the exact check found and did.

    ``verdict``: None (not checked), or ``identical``/``equivalent``/``differs``/``unproved`` (``exl3tool.operations.exact``)
    or ``error`` (the check could not run; ``detail`` says why). ``action``: None, ``kept`` or ``replaced``.
    """

    prefix: str
    tp_size: int
    tp_rank: int
    digest: str
    path: str
    verdict: Optional[str] = None
    action: Optional[str] = None
    detail: str = ""
    seconds: float = 0.0


def unchecked_jobs(plan: LookupPlan) -> list[LookupJob]:
    """The plan's hits that carry no exl3tool checksum, in plan order."""
    return [j for j in plan.jobs if j.state == "hit" and j.reason == UNCHECKED_HIT]


def unchecked_hits(plan: LookupPlan) -> list[UncheckedHit]:
    """Every unchecked hit of ``plan``, named (not checked)."""
    return [UncheckedHit(j.prefix, j.tp_size, j.tp_rank, j.digest, str(j.path)) for j in unchecked_jobs(plan)]


def _check_one(job: LookupJob, checkpoint: Checkpoint, store: CacheStore, device: torch.device,
               dtype: Optional[torch.dtype]) -> UncheckedHit:
    start = time.perf_counter()
    base = dict(prefix=job.prefix, tp_size=job.tp_size, tp_rank=job.tp_rank, digest=job.digest, path=str(job.path))
    try:
        weight = encoder_input(rank_local_weight(checkpoint, job.rank_job, dtype=dtype))
        fresh, w_r = fresh_encode(weight, job.key, device)
        seen: list[ExactCheck] = []

        def keep(found) -> bool:
            if found.checked:  # replaced meanwhile by an entry with our checksum (another warm): nothing to check
                seen.append(ExactCheck("identical", "now carries exl3tool's checksum (republished meanwhile)", "", ""))
                return True
            seen.append(compare_exact(found.tensors, found.proxy_error, found.metadata or {}, fresh, w_r))
            return seen[-1].verdict != "differs"

        action = store.replace_unless(job.key, keep, fresh)
    except Exception as exc:
        return UncheckedHit(**base, verdict="error", detail=describe(exc), seconds=time.perf_counter() - start)
    check = seen[-1] if seen else None
    if check is None:  # the entry was gone or invalid under the lock: the fresh encode took its place
        return UncheckedHit(**base, verdict="differs", action="replaced", seconds=time.perf_counter() - start,
                            detail="no valid entry under the lock any more; published the fresh encode")
    return UncheckedHit(**base, verdict=check.verdict, action="kept" if action == "kept" else "replaced",
                        detail=check.detail, seconds=time.perf_counter() - start)


def check_unchecked(
    plan: LookupPlan, checkpoint: Checkpoint, store: CacheStore, *, device: torch.device,
    dtype: Optional[torch.dtype] = None, on_done: Optional[Callable[[UncheckedHit], None]] = None,
) -> list[UncheckedHit]:
    """Check every unchecked hit of ``plan`` exactly and replace the ones that differ (one encode each)."""
    out = []
    for job in unchecked_jobs(plan):
        result = _check_one(job, checkpoint, store, device, dtype)
        out.append(result)
        if on_done:
            on_done(result)
    return out
