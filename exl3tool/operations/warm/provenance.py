"""The provenance record of a warm: its identities' payloads, settings and the entries it wrote or found."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from exl3tool.cache import CacheStore
from exl3tool.cache.records import (
    ProvenanceRecord, RecordEntry, RecordSettings, new_record, overlay_digest, write_record,
)
from exl3tool.errors import describe
from exl3tool.plan.plan import LookupPlan
from exl3tool.operations.warm.results import WarmSummary

__all__ = ["plan_settings", "warm_record", "record_warm"]


def plan_settings(plan: LookupPlan, dtype: Optional[str], checkpoint_dtype: object) -> RecordSettings:
    """The settings a plan was made with; ``dtype`` is the request's (``auto``/None: the checkpoint's serving dtype)."""
    lp = plan.layer_plan
    overlay = lp.overlay.as_json() if lp is not None and lp.overlay is not None else None
    resolved = dtype if dtype not in (None, "auto") else str(checkpoint_dtype).removeprefix("torch.")
    return RecordSettings(
        bits=plan.bits, dtype=resolved, tp_sizes=tuple(plan.tp_sizes),
        quantization_config=None if overlay is None or overlay.get("default") else overlay.get("given"),
        overlay_digest=overlay_digest(overlay), layers_planned=len(lp.layers) if lp is not None else 0,
        server_lookup=lp.server_lookup if lp is not None else True)


def warm_record(summary: WarmSummary, plan: LookupPlan, settings: RecordSettings,
                command: str) -> Optional[ProvenanceRecord]:
    """The record of ``summary``'s entries (encoded: ``written``, hit: ``found``); None when it has none."""
    ids = plan.identities
    if ids is None:
        return None
    entries = [RecordEntry(r.digest, r.prefix, r.tp_size, r.tp_rank, "written" if r.status == "encoded" else "found")
               for r in summary.entries if r.status in ("encoded", "hit") and r.path]
    if not entries:
        return None
    return new_record(command=command, model_name=plan.model, model_identity=ids.model.identity,
                      model_payload=ids.model.payload, encoder_identity=ids.encoder.identity,
                      encoder_payload=ids.encoder.payload, settings=settings, entries=entries,
                      encoder_parity=summary.encoder_parity if any(e.status == "written" for e in entries) else None)


def record_warm(summary: WarmSummary, plan: LookupPlan, checkpoint, request, store: CacheStore, *,
                command: str) -> WarmSummary:
    """Write the warm's record under the cache root; the summary says where, or why not (never fails the warm)."""
    record = warm_record(summary, plan, plan_settings(plan, request.dtype, checkpoint.dtype), command)
    if record is None:
        return summary
    try:
        path, written = write_record(store.root, record, file_mode=store.file_mode)
    except OSError as exc:
        return replace(summary, record_error=f"no provenance record written under {store.root}: {describe(exc)}")
    return replace(summary, record=str(path), record_written=written)
