"""A warm's plan: one job per (layer, TP size, TP rank) with its cache key, entry path and state.

Planning costs only look-ups (hit, miss, invalid, skipped): headers, plus our checksum of every hit hashed from
the file (no encode, no weights read), so ``--dry-run`` shows exactly what the run will do. ``share_jobs``
(``sharing``) splits the pending jobs between workers the same way on every process, a share group at a time.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from exl3tool.cache import CacheKey, CacheStore, ServerIdentities, entry_path
from exl3tool.cache.store import PRUNE_HINT
from exl3tool.checkpoint import Checkpoint, FetchInfo, LayerPlan, RankJob
from exl3tool.plan.job import LookupJob  # data only: shards and sharing read it without importing this module
from exl3tool.plan.sharing import reused_from, share_jobs, sharing_figures  # whole share groups per worker
from exl3tool.plan.shards import Shard, ShardInfo, shard_info, shard_slice

__all__ = ["LookupJob", "LookupPlan", "build_plan", "share_jobs"]


@dataclass(frozen=True)
class LookupPlan:
    """Every job of a warm, with the identities and settings that went into their keys."""

    model: str
    model_identity: str
    encoder_identity: str
    bits: int
    tp_sizes: tuple[int, ...]
    cache_root: Path
    mode: str
    jobs: tuple[LookupJob, ...]
    layer_plan: Optional[LayerPlan] = field(default=None, compare=False, repr=False)  # overlay, kind, excluded
    fetch: Optional[FetchInfo] = None  # what a selective Hub download fetched
    identity_warnings: tuple[str, ...] = ()  # from server_identities: e.g. a branch revision, an unmappable link
    identities: Optional[ServerIdentities] = field(default=None, compare=False, repr=False)  # payloads, for records
    shard: Optional[ShardInfo] = None  # ``cache warm --shard``: ``jobs`` are this shard's slice (``shards``)

    def count(self, state: str) -> int:
        return sum(1 for j in self.jobs if j.state == state)

    def header_json(self) -> dict[str, Any]:
        """What the plan was made with, as the ``--json`` of `cache check` and `--dry-run` give it (docs/cache.md):
        the overlay, the checkpoint kind, whether the server looks entries up, notes, a Hub fetch."""
        lp = self.layer_plan
        return {
            "quantization_config": lp.overlay.as_json() if lp is not None and lp.overlay is not None else None,
            "checkpoint_kind": lp.kind.kind if lp is not None and lp.kind is not None else None,
            "architecture": lp.architecture if lp is not None else None,
            "server_lookup": lp.server_lookup if lp is not None else True,
            "notes": list(lp.notes) if lp is not None else [],
            "identity_warnings": list(self.identity_warnings),
            "fetch": None if self.fetch is None else {
                "shards": list(self.fetch.shards), "shards_total": self.fetch.shards_total,
                "bytes_fetched": self.fetch.bytes_fetched, "index_total_bytes": self.fetch.index_total_bytes},
        }

    def as_json(self) -> dict[str, Any]:
        """The ``--dry-run --json`` document of `encode` and `cache warm` (fields in docs/cache.md)."""
        looked_up = [j for j in self.jobs if j.state != "skipped"]
        todo = self.todo
        shares, sharing = reused_from(todo), sharing_figures(todo)
        excluded = self.layer_plan.excluded if self.layer_plan is not None else ()
        return {
            "model": self.model, "model_identity": self.model_identity, "encoder_identity": self.encoder_identity,
            "bits": self.bits, "tp_sizes": list(self.tp_sizes), "cache_root": str(self.cache_root), "mode": self.mode,
            **self.header_json(),
            "tiles": {"total": sum(j.tiles for j in looked_up), "to_encode": sum(j.tiles for j in todo)},
            "jobs": [{"prefix": j.prefix, "tp_size": j.tp_size, "tp_rank": j.tp_rank, "input_size": j.input_size,
                      "output_size": j.output_size, "tiles": j.tiles, "state": j.state, "reason": j.reason,
                      "why": j.why, "planned_by": j.rank_job.layer.spec if j.rank_job is not None else None,
                      "digest": j.digest, "path": str(j.path),
                      **({"reused_from": shares[j.digest]} if j.digest in shares else {})} for j in self.jobs],
            "not_planned": [{"prefix": e.prefix, "reason": e.reason, "why": e.detail} for e in excluded],
            "encodes": sharing["encodes"], "sharing": sharing,
            **({"shard": self.shard.as_json()} if self.shard is not None else {}),
        }

    @property
    def all_skipped(self) -> bool:
        """Whether the server looks no entry of the whole plan up (every shard's jobs skipped)."""
        if self.shard is not None:
            return self.shard.plan_entries == 0
        return all(j.state == "skipped" for j in self.jobs)

    @property
    def todo(self) -> list[LookupJob]:
        """Jobs that need an encode (missing or invalid entries), largest first."""
        pending = [j for j in self.jobs if j.state in ("miss", "invalid")]
        return sorted(pending, key=lambda j: (-j.tiles, j.digest))



WarmJob, WarmPlan = LookupJob, LookupPlan  # their names before 0.2 (CHANGELOG "Renamed"), kept for one release

def _state(store: CacheStore, key: CacheKey, check_hits: bool) -> tuple[str, str]:
    """(state, reason) of one job's entry: a look-up with our checksum, and what would stop a publish."""
    if store.mode == "off":
        return "miss", ""
    found = store.lookup(key, quick=True, checksum=check_hits)  # the trellis is hashed from the file, not loaded
    if found.status != "hit" and store.mode == "readwrite":
        problem = store.obstacle(key)  # what the warm will fail the job on, not the re-encode it cannot do
        if problem:
            also = f" (the entry is also invalid: {found.reason})" if found.status == "invalid" else ""
            return "invalid", f"{problem}{also}; {PRUNE_HINT}"
    return found.status, found.reason or ""


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
    check_hits: bool = True,
    threads: Optional[int] = None,
    shard: Optional[Shard] = None,
) -> LookupPlan:
    """One job per (layer, TP size, rank), each looked up in the store (read-only) to learn its state.

    ``check_hits`` (default) hashes every present entry's tensor bytes against its ``exl3tool_sha256``, so an
    entry whose bytes changed after publishing is ``invalid`` and gets re-encoded; entries without that
    checksum (server-written) are hits the server would load. The look-ups run on ``threads`` threads
    (default: up to 8, one per core), since hashing releases the GIL. ``check_hits=False`` skips only
    the trellis hash (``judge_entry(hash_tensors=False)``; what workers other than 0 use under torchrun, where
    worker 0's plan rules).

    ``shard`` keeps only that shard's slice of the jobs (``shards.shard_slice``, decided before any look-up, from
    the plan alone) and looks up only those; the plan's ``shard`` holds its figures beside the whole plan's.
    """
    tp_sizes = tuple(sorted(set(int(t) for t in tp_sizes)))
    wanted = None if tp_ranks is None else set(tp_ranks)
    rows: list[tuple[RankJob, int, CacheKey, str]] = []
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
            rows.append((rj, tp, key, reasons.get((rj.prefix, rj.tp_rank), "")))
    info = None
    if shard is not None:  # the slice from the plan alone (states unknown yet: looked-up jobs as "miss")
        unlooked = [LookupJob(rj.prefix, tp, rj.tp_rank, rj.input_size, rj.output_size, key, entry_path(key, store.root),
                            "miss" if rj.aligned else "skipped", reason, rj) for rj, tp, key, reason in rows]
        mine = shard_slice(unlooked, shard)
        info = shard_info(shard, unlooked, mine)
        kept = {j.digest for j in mine}
        rows = [row for row in rows if row[2].digest() in kept]
    present = [key for rj, _, key, _ in rows if rj.aligned]
    workers = threads or max(1, min(8, os.cpu_count() or 1))
    if workers > 1 and len(present) > 1:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="exl3tool-plan") as pool:
            states = dict(zip((k.digest() for k in present), pool.map(lambda k: _state(store, k, check_hits), present)))
    else:
        states = {k.digest(): _state(store, k, check_hits) for k in present}
    jobs: list[LookupJob] = []
    for rj, tp, key, reason in rows:
        state = "skipped"
        if rj.aligned:
            state, reason = states[key.digest()]
        jobs.append(LookupJob(rj.prefix, tp, rj.tp_rank, rj.input_size, rj.output_size, key,
                            entry_path(key, store.root), state, reason, rj))
    return LookupPlan(
        model=checkpoint.model, model_identity=model_identity, encoder_identity=encoder_identity, bits=bits,
        tp_sizes=tp_sizes, cache_root=store.root, mode=store.mode, jobs=tuple(jobs), layer_plan=layer_plan,
        fetch=checkpoint.fetch, shard=info,
    )
