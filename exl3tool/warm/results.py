"""What a warm reports: one result per job and the summary (the ``--json`` document)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from exl3tool.cache.store import UNCHECKED_HIT
from exl3tool.warm.plan import WarmJob, WarmPlan

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
    bytes_written: int
    seconds: float
    entries: list[JobResult]
    worker_stats: list[dict] = field(default_factory=list)
    unchecked_hits: int = 0  # hits without exl3tool_sha256 (server-written): kept, weights checked only by verify
    quantization_config: Optional[dict] = None  # the resolved overlay the plan was made with
    server_lookup: bool = True  # False: generic --layers mode, entries the server never looks up
    record: Optional[str] = None  # the provenance record of this warm's entries (exl3tool.cache.records)
    record_written: bool = False  # False: the same record was already there (or none was written)
    record_error: str = ""  # why no record could be written (the entries are complete without one)

    @property
    def ok(self) -> bool:
        return self.counts.get("failed", 0) == 0


def job_result(job: WarmJob, status: str, worker: int, *, path=None, seconds=0.0, bytes_=0, proxy_error=None, error="") -> JobResult:
    return JobResult(job.prefix, job.tp_size, job.tp_rank, job.input_size, job.output_size, status, job.digest,
                     path, round(seconds, 4), bytes_, proxy_error, error, worker)


def summarize(plan: WarmPlan, results: list[JobResult], *, device: str, workers: int, seconds: float) -> WarmSummary:
    """Counts, bytes and per-entry results in plan order."""
    order = {(j.prefix, j.tp_size, j.tp_rank): i for i, j in enumerate(plan.jobs)}
    results = sorted(results, key=lambda r: order.get((r.prefix, r.tp_size, r.tp_rank), 0))
    counts = {s: sum(1 for r in results if r.status == s) for s in ("hit", "encoded", "skipped", "failed")}
    lp = plan.layer_plan
    return WarmSummary(
        model=plan.model, model_identity=plan.model_identity, encoder_identity=plan.encoder_identity,
        bits=plan.bits, tp_sizes=list(plan.tp_sizes), cache_root=str(plan.cache_root), device=device,
        workers=workers, counts=counts, bytes_written=sum(r.bytes for r in results if r.status == "encoded"),
        seconds=round(seconds, 3), entries=results,
        unchecked_hits=sum(1 for j in plan.jobs if j.state == "hit" and j.reason == UNCHECKED_HIT),
        quantization_config=lp.overlay.as_json() if lp is not None and lp.overlay is not None else None,
        server_lookup=lp.server_lookup if lp is not None else True,
    )
