"""Checkpoints: reading (local or Hub), the server's layer plan, and TP rank-local shards (spec 6)."""

from __future__ import annotations

from exl3tool.checkpoint.families import FAMILIES, SUPPORTED_ARCHITECTURES, Family, ModuleTemplate, family_for
from exl3tool.checkpoint.plan import (
    ALIGN,
    LayerPlan,
    PlannedLayer,
    RankJob,
    is_shared_expert_projection,
    plan_layers,
    qkv_partition,
    rank_sizes,
    server_ignores,
)
from exl3tool.checkpoint.sharding import encoder_input, rank_local_weight, rank_row_ranges
from exl3tool.checkpoint.source import Checkpoint, TensorInfo, hub_cache_dir, open_checkpoint, serving_dtype
from exl3tool.checkpoint.synthetic import write_llama_checkpoint

__all__ = [
    "ALIGN",
    "FAMILIES",
    "SUPPORTED_ARCHITECTURES",
    "Checkpoint",
    "Family",
    "LayerPlan",
    "ModuleTemplate",
    "PlannedLayer",
    "RankJob",
    "TensorInfo",
    "encoder_input",
    "family_for",
    "is_shared_expert_projection",
    "hub_cache_dir",
    "open_checkpoint",
    "plan_layers",
    "qkv_partition",
    "rank_local_weight",
    "rank_row_ranges",
    "rank_sizes",
    "server_ignores",
    "serving_dtype",
    "write_llama_checkpoint",
]
