"""The server's linear-layer prefixes per architecture (spec 6.5), and where their weights live in a HF checkpoint.

A family lists module templates relative to ``model.layers.{i}``. Each template names the vLLM module
(the cache key's prefix), its parallel style, and the checkpoint modules fused into it, in fused order.
Only modules that vLLM builds *with* the quant config are listed: routed experts, Qwen2-MoE's router
``mlp.gate`` and ``mlp.shared_expert_gate``, ``lm_head`` and embeddings never are.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModuleTemplate", "Family", "FAMILIES", "SUPPORTED_ARCHITECTURES", "family_for"]


@dataclass(frozen=True)
class ModuleTemplate:
    """One vLLM linear module in a decoder layer, and the checkpoint modules it is loaded from."""

    name: str  # vLLM module path inside the layer, e.g. "self_attn.qkv_proj"
    parallel: str  # "qkv" | "merged_column" | "column" | "row" | "replicated"
    sources: tuple[str, ...]  # checkpoint module paths inside the layer, fused order
    required: bool = True  # False: present only in some layers or variants (MoE MLPs, shared experts)
    shared_expert: bool = False  # covered by the `shared_experts` spec only, never by `linear`


@dataclass(frozen=True)
class Family:
    """An architecture's decoder-layer linears; ``layers_prefix`` is the vLLM (and HF) layer list path."""

    architectures: tuple[str, ...]
    modules: tuple[ModuleTemplate, ...]
    layers_prefix: str = "model.layers"


_ATTN = (
    ModuleTemplate("self_attn.qkv_proj", "qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ModuleTemplate("self_attn.o_proj", "row", ("self_attn.o_proj",)),
)
_DENSE_MLP = (
    ModuleTemplate("mlp.gate_up_proj", "merged_column", ("mlp.gate_proj", "mlp.up_proj")),
    ModuleTemplate("mlp.down_proj", "row", ("mlp.down_proj",)),
)
# MoE models: dense MLP only in `mlp_only_layers` / off-step layers, so optional per layer.
_MOE_DENSE_MLP = tuple(
    ModuleTemplate(m.name, m.parallel, m.sources, required=False) for m in _DENSE_MLP
)
_SHARED_EXPERT = (
    ModuleTemplate("mlp.shared_expert.gate_up_proj", "merged_column",
                   ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"), required=False, shared_expert=True),
    ModuleTemplate("mlp.shared_expert.down_proj", "row", ("mlp.shared_expert.down_proj",),
                   required=False, shared_expert=True),
)
# Qwen3-MoE builds its router with the quant config (ReplicatedLinear), so it is eligible; Qwen2-MoE does not.
_QWEN3_ROUTER = (ModuleTemplate("mlp.gate", "replicated", ("mlp.gate",), required=False),)

FAMILIES: tuple[Family, ...] = (
    Family(("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"), _ATTN + _DENSE_MLP),
    Family(("Qwen2MoeForCausalLM",), _ATTN + _MOE_DENSE_MLP + _SHARED_EXPERT),
    Family(("Qwen3MoeForCausalLM",), _ATTN + _MOE_DENSE_MLP + _SHARED_EXPERT + _QWEN3_ROUTER),
)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(a for f in FAMILIES for a in f.architectures)


def family_for(architecture: str | None) -> Family | None:
    """The family for ``config.architectures[0]``, or None when we do not know its prefixes."""
    for family in FAMILIES:
        if architecture in family.architectures:
            return family
    return None
