"""``LookupJob``: one look-up of a plan (layer, TP size, rank) with its key, entry path and state.

Data only, so that ``plan`` (which builds the jobs), ``sharing`` and ``shards`` (which group and split them) all
read it without importing each other in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from exl3tool.cache.key import CacheKey
    from exl3tool.checkpoint.plan import RankJob

__all__ = ["LookupJob"]


@dataclass(frozen=True)
class LookupJob:
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

    @property
    def why(self) -> str:
        """Why the job is in the plan (or, skipped or invalid, its reason), as the dry-run's ``why`` says it."""
        if self.state == "skipped" or self.state == "invalid":
            return self.reason
        spec = self.rank_job.layer.spec if self.rank_job is not None else "linear"
        return "--layers glob (the server does not look this entry up)" if spec == "generic" else f"planned ({spec} spec)"
