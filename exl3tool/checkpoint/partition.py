"""vLLM's tensor-parallel partition rules that both the layer plan (``checkpoint.plan``) and the fork's slicing of
stored modules (``checkpoint.slicing``) follow: the 128 block and how ``QKVParallelLinear`` splits heads. Its own
module so that neither imports the other (``plan`` builds the stored modules ``slicing`` judges)."""

from __future__ import annotations

from typing import Any

from exl3tool.errors import ConfigError

__all__ = ["ALIGN", "qkv_partition"]

ALIGN = 128  # the Hadamard block: K_r and N_r must both be multiples of it (docs/layer-plan.md §2)


def qkv_partition(layer: Any, tp_size: int, tp_rank: int) -> tuple[int, int, int, int]:
    """``(heads_r, kv_r, replicas, kr)`` for a qkv layer as vLLM's QKVParallelLinear computes them (6.4)."""
    heads, kv = layer.num_heads, layer.num_kv_heads
    assert heads is not None and kv is not None, "qkv layer without head counts"
    if heads % tp_size:
        raise ConfigError(
            f"{layer.prefix}: {heads} attention heads are not divisible by tensor-parallel size {tp_size}; "
            "vLLM cannot shard this model at that size"
        )
    if tp_size >= kv:
        if tp_size % kv:
            raise ConfigError(
                f"{layer.prefix}: tensor-parallel size {tp_size} is not a multiple of {kv} KV heads; "
                "vLLM cannot replicate KV heads evenly"
            )
        kv_r, replicas = 1, tp_size // kv
    else:
        if kv % tp_size:
            raise ConfigError(
                f"{layer.prefix}: {kv} KV heads are not divisible by tensor-parallel size {tp_size}; "
                "vLLM cannot shard this model at that size"
            )
        kv_r, replicas = kv // tp_size, 1
    return heads // tp_size, kv_r, replicas, tp_rank // replicas
