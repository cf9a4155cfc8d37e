"""One encode per distinct shard: the jobs of a warm whose entries an encode of one of them fills.

An entry is a function of the rank-local weight, the bits, the serving dtype and the prefix's seed (the key's other
fields, TP size and rank, are only recorded). Within one warm bits, dtype and identities are fixed, so two jobs
with the same prefix whose rank-local weights are read from the same checkpoint slices (``rank_reads``, the
sharding plan; never a comparison of floats) give the same tensors: every rank and TP size of a replicated layer
(MLA ``fused_qkv_a_proj`` / ``q_a_proj`` / ``kv_a_proj_with_mqa``, the DSA indexer's ``wq_b``, GLM-5.3's
``g_a_proj``, anything built with ``disable_tp``), and any shard the plan makes equal across TP sizes. Such jobs
form a ``ShareGroup``: encoded once, published under each key (each file with its own key and checksum, the bytes a
separate encode writes). ``share_jobs`` hands whole groups to torchrun workers, so the sharing holds there too.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generic, Iterable, Optional, TypeVar

from exl3tool.checkpoint.sharding import rank_reads

if TYPE_CHECKING:
    from exl3tool.checkpoint.plan import LayerPlan, RankJob
    from exl3tool.plan.job import LookupJob

__all__ = ["ShareGroup", "shard_identity", "rank_shard", "group_jobs", "share_jobs", "reused_from", "SharedEncode",
           "sharing_figures", "plan_sharing"]

T = TypeVar("T")


def rank_shard(rank_job: "RankJob") -> tuple:
    """What decides a rank job's entry besides the warm's fixed settings: prefix, rank-local sizes, checkpoint reads."""
    return (rank_job.prefix, rank_job.input_size, rank_job.output_size, rank_reads(rank_job))


def shard_identity(job: "LookupJob") -> tuple:
    """``rank_shard`` of a warm job; a job without a rank job (never the case for planned jobs) shares with nobody."""
    if job.rank_job is None:
        return ("digest", job.digest)
    return rank_shard(job.rank_job)


@dataclass(frozen=True)
class ShareGroup:
    """Jobs filled by one encode; ``jobs[0]`` (the leader) is the one planned to run it."""

    jobs: tuple["LookupJob", ...]

    @property
    def leader(self) -> "LookupJob":
        return self.jobs[0]

    @property
    def tiles(self) -> int:
        """Tiles the encoder quantizes for the whole group (one job's worth)."""
        return self.leader.tiles


def group_jobs(jobs: Iterable["LookupJob"]) -> list[ShareGroup]:
    """``jobs`` grouped by shard identity, groups in order of their first job, members in the given order."""
    groups: dict[tuple, list] = {}
    for job in jobs:
        groups.setdefault(shard_identity(job), []).append(job)
    return [ShareGroup(tuple(members)) for members in groups.values()]


def reused_from(jobs: Iterable["LookupJob"]) -> dict[str, str]:
    """``{digest: leader digest}`` for every job of ``jobs`` another job's encode fills (the plan's view)."""
    return {j.digest: g.leader.digest for g in group_jobs(jobs) for j in g.jobs[1:]}


def share_jobs(jobs: list["LookupJob"], worker: int, workers: int) -> list["LookupJob"]:
    """This worker's jobs, whole share groups at a time, members of a group one after another.

    Groups are taken largest encode first (ties by the leader's digest) and each goes to the least-loaded worker
    (ties to the lowest index); the load is the tiles the encoder quantizes, once per group. Every process computes
    the same assignment without talking to the others, and the jobs of a group always land on one worker.
    """
    groups = sorted(group_jobs(sorted(jobs, key=lambda j: (-j.tiles, j.digest))),
                    key=lambda g: (-g.tiles, g.leader.digest))
    if workers <= 1:
        return [j for g in groups for j in g.jobs]
    load = [0] * workers
    mine: list["LookupJob"] = []
    for group in groups:
        target = min(range(workers), key=lambda w: (load[w], w))
        load[target] += group.tiles
        if target == worker:
            mine.extend(group.jobs)
    return mine


class SharedEncode(Generic[T]):
    """A group's encode, run at most once: the first call runs it for its job, later calls get the same result.

    A failed encode is remembered too, so every member reports the same error instead of encoding again.
    ``owner`` is the digest of the job whose call ran the encode (None before).
    """

    def __init__(self, encode: Optional[Callable[["LookupJob"], T]]) -> None:
        self._encode = encode
        self._lock = threading.Lock()
        self._done = False
        self._result: Optional[T] = None
        self._error: Optional[BaseException] = None
        self.owner: Optional[str] = None
        self._served: set[str] = set()

    @property
    def done(self) -> bool:
        """Whether the encode ran (or failed): a member that asks now gets its result without reading a weight."""
        return self._done

    def __call__(self, job: "LookupJob", encode: Optional[Callable[["LookupJob"], T]] = None) -> T:
        """The group's result; ``encode`` (else the one given at construction) runs it if no member did yet."""
        with self._lock:
            self._served.add(job.digest)
            if not self._done:
                try:
                    result = (encode or self._encode)(job)
                except Exception as exc:
                    self.owner, self._error, self._done = job.digest, exc, True
                    raise
                self.owner, self._result, self._done = job.digest, result, True  # an interrupt leaves it unrun
            elif self._error is not None:
                raise self._error
            assert self._result is not None
            return self._result

    def reused_by(self, job: "LookupJob") -> Optional[str]:
        """The owner's digest when ``job`` asked for the encode and got another job's, else None."""
        if job.digest not in self._served or not self._done or self._error is not None or self.owner == job.digest:
            return None
        return self.owner

    def release(self) -> None:
        """Drop the result (the group's last member is through): memory stays bounded by the groups in flight."""
        self._result = None


def sharing_figures(jobs: Iterable["LookupJob"]) -> dict[str, int]:
    """Entries, encodes and tiles of ``jobs`` with and without sharing (the ``--dry-run`` figures)."""
    jobs = list(jobs)
    groups = group_jobs(jobs)
    return {"entries": len(jobs), "encodes": len(groups), "encodes_saved": len(jobs) - len(groups),
            "tiles": sum(j.tiles for j in jobs), "encode_tiles": sum(g.tiles for g in groups),
            "tiles_saved": sum(j.tiles for j in jobs) - sum(g.tiles for g in groups)}


def plan_sharing(layer_plan: "LayerPlan", tp_sizes: Iterable[int]) -> dict[str, float]:
    """What encoding each distinct shard once saves on a cold cache, from the plan alone (no weight is read).

    ``entries``/``tiles`` count every aligned job of ``tp_sizes``; ``encodes``/``encode_tiles`` the distinct
    shards among them; ``tiles_saved_share`` is the share of tiles the encoder no longer quantizes.
    """
    jobs = [rj for tp in tp_sizes for rj in layer_plan.for_tp(tp)]
    tiles = {rank_shard(rj): (rj.input_size // 16) * (rj.output_size // 16) for rj in jobs}
    total = sum((rj.input_size // 16) * (rj.output_size // 16) for rj in jobs)
    encode_tiles = sum(tiles.values())
    return {"entries": len(jobs), "encodes": len(tiles), "encodes_saved": len(jobs) - len(tiles), "tiles": total,
            "encode_tiles": encode_tiles, "tiles_saved": total - encode_tiles,
            "tiles_saved_share": round((total - encode_tiles) / total, 6) if total else 0.0}
