"""What a `cache prune` planned and did, as one report: the files (entries, leftovers, locks) and the provenance
records it removes, and once run, what it freed, kept or could not remove."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from exl3tool.cache.records import RecordPrune
from exl3tool.cache.scan import PrunePlan, PruneResult

__all__ = ["PruneReport"]


@dataclass(frozen=True)
class PruneReport:
    """A prune's plan and, once executed (``done``), its outcome; a dry run or a declined prompt removes nothing."""

    root: Path
    plan: PrunePlan
    records: RecordPrune
    dry_run: bool
    freed: int = 0
    errors: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    records_removed: int = 0

    def done(self, files: PruneResult, records: tuple[int, list[str], list[str]]) -> "PruneReport":
        """This report with what ``execute_prune`` and ``execute_record_prune`` did."""
        removed, errors, kept = records
        return replace(self, freed=files.freed, errors=tuple(files.errors) + tuple(errors),
                       kept=tuple(files.kept) + tuple(kept), records_removed=removed)

    def as_json(self) -> dict[str, Any]:
        """The `cache prune --json` document (docs/cache.md)."""
        return {
            "root": str(self.root),
            "dry_run": self.dry_run,
            "planned": [{**i.as_json(), "why": why} for i, why in self.plan.items],
            "skipped": [{**i.as_json(), "why": why} for i, why in self.plan.skipped],
            "bytes_planned": self.plan.bytes_freed,
            "records_planned": [{"path": str(sr.path), "why": why} for sr, why in self.records.items],
            "bytes_freed": self.freed,
            "errors": list(self.errors),
            "kept": list(self.kept),
            "records_removed": self.records_removed,
        }
