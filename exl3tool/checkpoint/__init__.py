"""Checkpoints: reading (local or Hub), the server's view of them (overlay, kinds, layer plan), TP rank-local shards."""

from __future__ import annotations

from exl3tool.lazy import lazy_exports

# Each name is imported from its module on first use (exl3tool.lazy): importing the package imports none.
__getattr__, __dir__ = lazy_exports(__name__, {
    "exl3tool.checkpoint.families": ("FAMILIES", "SUPPORTED_ARCHITECTURES", "Family", "ModuleTemplate", "family_for"),
    "exl3tool.checkpoint.overlay": ("DEFAULT_OVERLAY_JSON", "Overlay", "QuantSpec", "is_shared_expert_projection",
                                    "parse_overlay", "resolve_overlay", "should_ignore_layer"),
    "exl3tool.checkpoint.plan": ("ALIGN", "Excluded", "LayerPlan", "PlannedLayer", "RankJob", "plan_layers",
                                 "qkv_partition", "rank_sizes", "tensors_to_fetch"),
    "exl3tool.checkpoint.routing": ("CheckpointKind", "NotServable", "StorageMap", "serving_kind",
                                    "storage_candidates"),
    "exl3tool.checkpoint.sharding": ("RankReads", "encoder_input", "rank_local_weight", "rank_reads",
                                     "rank_row_ranges"),
    "exl3tool.checkpoint.source": ("Checkpoint", "FetchInfo", "TensorInfo", "hub_cache_dir", "open_checkpoint",
                                   "serving_dtype"),
    "exl3tool.checkpoint.synthetic": ("write_checkpoint", "write_llama_checkpoint"),
})

__all__ = [
    "ALIGN",
    "DEFAULT_OVERLAY_JSON",
    "FAMILIES",
    "SUPPORTED_ARCHITECTURES",
    "Checkpoint",
    "CheckpointKind",
    "Excluded",
    "Family",
    "FetchInfo",
    "LayerPlan",
    "ModuleTemplate",
    "NotServable",
    "Overlay",
    "PlannedLayer",
    "QuantSpec",
    "RankJob",
    "RankReads",
    "StorageMap",
    "TensorInfo",
    "encoder_input",
    "rank_reads",
    "family_for",
    "hub_cache_dir",
    "is_shared_expert_projection",
    "open_checkpoint",
    "parse_overlay",
    "plan_layers",
    "qkv_partition",
    "rank_local_weight",
    "rank_row_ranges",
    "rank_sizes",
    "resolve_overlay",
    "serving_dtype",
    "serving_kind",
    "should_ignore_layer",
    "storage_candidates",
    "tensors_to_fetch",
    "write_checkpoint",
    "write_llama_checkpoint",
]
