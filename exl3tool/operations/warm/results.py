"""What a warm reports: one result per job and the summary (the ``--json`` document)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from exl3tool.jsontext import to_jsonable
from exl3tool.plan.plan import LookupJob, LookupPlan
from exl3tool.operations.warm.unchecked import UncheckedHit, unchecked_hits

__all__ = ["JobResult", "WarmSummary", "job_result", "summarize"]


@dataclass(frozen=True)
class JobResult:
    """What happened to one job: hit, encoded, skipped or failed, with timing and the error if any."""

    prefix: str
    tp_size: int
    tp_rank: int
    input_size: int
    output_size: int
    status: str  # "hit" | "encoded" | "skipped" | "failed"
    digest: str
    path: Optional[str]
    seconds: float = 0.0
    bytes: int = 0
    proxy_error: Optional[float] = None
    error: str = ""
    worker: int = 0
    # the digest of the entry whose encode this one's tensors came from (a share group); absent when encoded itself
    reused_from: Optional[str] = field(default=None, metadata={"omit_none": True})


@dataclass(frozen=True)
class WarmSummary:
    """The machine-readable outcome of a warm (the `--json` document)."""

    model: str
    model_identity: str
    encoder_identity: str
    bits: int
    tp_sizes: list[int]
    cache_root: str
    device: str
    workers: int
    counts: dict[str, int]
    encodes: int  # encoder runs: entries encoded minus those filled by another job's encode (``reused_from``)
    bytes_written: int
    seconds: float
    entries: list[JobResult]
    worker_stats: list[dict] = field(default_factory=list)
    unchecked_hits: int = 0  # how many hits carry no exl3tool_sha256 (server-written); named in ``unchecked``
    quantization_config: Optional[dict] = None  # the resolved overlay the plan was made with
    server_lookup: bool = True  # False: generic --layers mode, entries the server never looks up
    unchecked: list[UncheckedHit] = field(default_factory=list)  # those hits by name; checked with --check-unchecked
    record: Optional[str] = None  # the provenance record of this warm's entries (exl3tool.cache.records)
    record_written: bool = False  # False: the same record was already there (or none was written)
    record_error: str = ""  # why no record could be written (the entries are complete without one)
    # ``cache warm --shard``: this shard's index, count, source, jobs and cost beside the whole plan's (absent unsharded)
    shard: Optional[dict] = field(default=None, metadata={"omit_none": True})
    encoder_parity: Optional[dict] = None  # operations.parity's verdict before the first write (None: none written)

    @property
    def encodes_saved(self) -> int:
        """Entries published from another job's encode (a share group) instead of an encode of their own."""
        return sum(1 for r in self.entries if r.reused_from is not None)

    @property
    def ok(self) -> bool:
        return self.counts.get("failed", 0) == 0

    def as_json(self) -> dict[str, Any]:
        """The `cache warm --json` / `encode --json` document: every field, in order (docs/cache.md)."""
        return to_jsonable(self)


def job_result(job: LookupJob, status: str, worker: int, *, path=None, seconds=0.0, bytes_=0, proxy_error=None, error="",
               reused_from: Optional[str] = None) -> JobResult:
    return JobResult(job.prefix, job.tp_size, job.tp_rank, job.input_size, job.output_size, status, job.digest,
                     path, round(seconds, 4), bytes_, proxy_error, error, worker, reused_from)


def summarize(plan: LookupPlan, results: list[JobResult], *, device: str, workers: int, seconds: float,
              unchecked: Optional[list[UncheckedHit]] = None) -> WarmSummary:
    """Counts, bytes and per-entry results in plan order; ``unchecked`` (default: the plan's, not checked) names
    the hits without exl3tool's checksum."""
    order = {(j.prefix, j.tp_size, j.tp_rank): i for i, j in enumerate(plan.jobs)}
    results = sorted(results, key=lambda r: order.get((r.prefix, r.tp_size, r.tp_rank), 0))
    counts = {s: sum(1 for r in results if r.status == s) for s in ("hit", "encoded", "skipped", "failed")}
    lp = plan.layer_plan
    return WarmSummary(
        model=plan.model, model_identity=plan.model_identity, encoder_identity=plan.encoder_identity,
        bits=plan.bits, tp_sizes=list(plan.tp_sizes), cache_root=str(plan.cache_root), device=device,
        workers=workers, counts=counts,
        encodes=sum(1 for r in results if r.status == "encoded" and r.reused_from is None),
        bytes_written=sum(r.bytes for r in results if r.status == "encoded"),
        seconds=round(seconds, 3), entries=results,
        unchecked_hits=len(unchecked if unchecked is not None else unchecked_hits(plan)),
        quantization_config=lp.overlay.as_json() if lp is not None and lp.overlay is not None else None,
        server_lookup=lp.server_lookup if lp is not None else True,
        unchecked=list(unchecked if unchecked is not None else unchecked_hits(plan)),
        shard=plan.shard.as_json() if plan.shard is not None else None,
    )
