"""A warm's plan: one job per (layer, TP size, TP rank) with its cache key, entry path and state.

Planning costs only look-ups (hit, miss, invalid, skipped), so ``--dry-run`` is cheap; ``share_jobs`` splits the
pending jobs between workers the same way on every process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from exl3tool.cache import CacheKey, CacheStore, entry_path
from exl3tool.checkpoint import Checkpoint, FetchInfo, LayerPlan, RankJob

__all__ = ["WarmJob", "WarmPlan", "build_plan", "share_jobs"]


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
    identity_warnings: tuple[str, ...] = ()  # from server_identities: e.g. a branch revision, an unmappable link

    def count(self, state: str) -> int:
        return sum(1 for j in self.jobs if j.state == state)

    @property
    def todo(self) -> list[WarmJob]:
        """Jobs that need an encode (missing or invalid entries), largest first."""
        pending = [j for j in self.jobs if j.state in ("miss", "invalid")]
        return sorted(pending, key=lambda j: (-j.tiles, j.digest))



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
