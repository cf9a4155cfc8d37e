"""The server's linear modules per architecture, as data: one table of module templates per model file of the fork.

A template names the vLLM module inside decoder layer ``i`` (the cache key's prefix is ``{layers_prefix}.{i}.{name}``),
its parallel style, the checkpoint modules fused into it (in the server's fused order), and the layers that build
it *with the quant config* (``when``: a small named predicate over the text config and the layer index). Modules the
model builds without the quant config are not listed: routers (``GateLinear``, Qwen-MoE's ``gate`` where built with
``quant_config=None``), the DSA indexer's ``wk_weights_proj``, GLM-5.3's MLA projections, ``lm_head``, embeddings and
routed experts are never encoded online.

``packed`` mirrors the model class's ``packed_modules_mapping`` (the server's stored-as-EXL3 and ``ignore`` rules look
a fused module up through it), ``storage_mapper`` the model's ``hf_to_vllm_mapper`` prefix rules (applied to the
``tensor_storage`` keys, as ``Exl3Config.apply_vllm_mapper`` does), ``checkpoint_layers`` where the HF checkpoint
keeps the layers. Fork files read (GitHub local-inference-lab/vllm): ``models/deepseek_v2.py`` @ 23a5fc76,
``vllm/models/deepseek_v32/{nvidia/model.py,attention.py}`` (registry @ 0b33c223 serves ``GlmMoeDsaForCausalLM``
from there), ``vllm/models/glm5next/nvidia/model.py`` @ 00e81699 with ``layers/mamba/gdn/kimi_gdn_linear_attn.py``,
``models/qwen3_5.py`` @ 1af6ac9a with ``layers/mamba/gdn/qwen_gdn_linear_attn.py`` @ 1d6d7dc9, ``models/qwen3_next.py``
@ 786228a7 (and the stored 58cfbebb), ``models/glm4_moe.py`` @ 5626e3a7.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from exl3tool.errors import ConfigError

__all__ = ["ModuleTemplate", "Family", "FAMILIES", "SUPPORTED_ARCHITECTURES", "family_for", "text_config"]

Config = dict[str, Any]
When = Callable[[Config, int], bool]


def text_config(config: Config) -> Config:
    """The text model's config: ``text_config`` for multimodal wrappers, else the config itself."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _get(cfg: Config, name: str, default: Any = None) -> Any:
    value = cfg.get(name, default)
    return default if value is None else value


@dataclass(frozen=True)
class ModuleTemplate:
    """One vLLM linear module in a decoder layer, and the checkpoint modules it is loaded from."""

    name: str  # vLLM module path inside the layer, e.g. "self_attn.qkv_proj"
    parallel: str  # "qkv" | "merged_column" | "column" | "row" | "replicated"
    sources: tuple[str, ...]  # checkpoint module paths inside the layer, fused order
    required: bool = True  # False: may be absent from a layer (families whose MoE layout we do not derive)
    when: Optional[When] = None  # layers that build it with the quant config; None: every layer
    # Expected output rows of each fused part from the config (validation, and splitting a source that holds
    # several parts); None: one part per source, sizes from the tensor shapes.
    parts: Optional[Callable[[Config], tuple[int, ...]]] = None
    source_parts: Optional[tuple[int, ...]] = None  # how many fused parts each source holds, e.g. (3, 1)
    replicated_parts: tuple[int, ...] = ()  # parts every rank holds whole (a merged layer's replicated shard)
    # Expected input width from the config where the module reads a low-rank latent, not the hidden state
    # (validation: a weight whose shape contradicts config.json is refused). None: ``hidden_size`` for every style
    # but "row", whose *output* is ``hidden_size`` instead.
    inputs: Optional[Callable[[Config], int]] = None


@dataclass(frozen=True)
class Family:
    """An architecture's decoder-layer linears, as the fork's model file builds them."""

    name: str
    architectures: tuple[str, ...]
    modules: tuple[ModuleTemplate, ...]
    layers_prefix: str = "model.layers"  # vLLM prefix of the decoder layers
    checkpoint_layers: tuple[str, ...] = ("model.layers",)  # where HF checkpoints keep them, first present wins
    packed: Callable[[Config], dict[str, tuple[str, ...]]] = field(
        default=lambda cfg: {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")})
    storage_mapper: tuple[tuple[str, Optional[str]], ...] = ()
    # (q heads as QKVParallelLinear counts them, kv heads, head dim) for "qkv" modules
    heads: Callable[[Config], tuple[int, int, int]] = field(default=lambda cfg: _llama_heads(cfg))
    check: Optional[Callable[[Config], None]] = None  # refuse configs the model code cannot build / we do not model
    tp_check: Optional[Callable[[Config, int], Optional[str]]] = None  # why vLLM cannot shard it at TP W
    aliases: tuple[tuple[str, str], ...] = ()  # (source, alternative checkpoint path) tried when a source is absent
    source: str = ""  # the fork file that builds it
    # vLLM prefix of one linear of a vision tower the model builds with the quant config and exl3tool does not plan
    # (the server encodes the tower online unless the overlay ignores it); "" when there is none
    unplanned_vision: str = ""


def _int(cfg: Config, name: str, arch: str = "") -> int:
    value = cfg.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json: field {name!r} must be a positive integer to plan {arch or 'this model'}, "
                          f"got {value!r}")
    return value


def _llama_heads(cfg: Config) -> tuple[int, int, int]:
    heads = _int(cfg, "num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (_int(cfg, "hidden_size") // heads)
    return heads, kv, head_dim


# ------------------------------------------------------------------------------------------------------------
# Llama / Mistral / Qwen2 / Qwen3 and the Qwen MoE families (upstream vLLM llama.py, qwen2_moe.py, qwen3_moe.py)

_ATTN = (
    ModuleTemplate("self_attn.qkv_proj", "qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ModuleTemplate("self_attn.o_proj", "row", ("self_attn.o_proj",)),
)
_DENSE_MLP = (
    ModuleTemplate("mlp.gate_up_proj", "merged_column", ("mlp.gate_proj", "mlp.up_proj")),
    ModuleTemplate("mlp.down_proj", "row", ("mlp.down_proj",)),
)
# MoE models: dense MLP only in `mlp_only_layers` / off-step layers, so optional per layer.
_MOE_DENSE_MLP = tuple(ModuleTemplate(m.name, m.parallel, m.sources, required=False) for m in _DENSE_MLP)
_SHARED_EXPERT = (
    ModuleTemplate("mlp.shared_expert.gate_up_proj", "merged_column",
                   ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"), required=False),
    ModuleTemplate("mlp.shared_expert.down_proj", "row", ("mlp.shared_expert.down_proj",), required=False),
)
# Qwen3-MoE builds its router with the quant config (ReplicatedLinear), so it is eligible; Qwen2-MoE does not.
_QWEN3_ROUTER = (ModuleTemplate("mlp.gate", "replicated", ("mlp.gate",), required=False),)


# ------------------------------------------------------------------------------------------------------------
# DeepSeek-V2/V3 MLA (deepseek_v2.py) and the DSA models served by vllm/models/deepseek_v32 (GLM-5 / 5.2)

def q_lora(cfg: Config, i: int) -> bool:
    """MLA with a low-rank query: fused_qkv_a_proj + q_b_proj."""
    return cfg.get("q_lora_rank") is not None


def no_q_lora(cfg: Config, i: int) -> bool:
    """MLA without ``q_lora_rank``: q_proj + kv_a_proj_with_mqa."""
    return cfg.get("q_lora_rank") is None


def ds_moe_layer(cfg: Config, i: int) -> bool:
    """DeepseekV2DecoderLayer: MoE when routed experts exist, ``i >= first_k_dense_replace``, on the freq step."""
    return (cfg.get("n_routed_experts") is not None and i >= _get(cfg, "first_k_dense_replace", 0)
            and i % _get(cfg, "moe_layer_freq", 1) == 0)


def ds_dense_layer(cfg: Config, i: int) -> bool:
    """Dense MLP below ``first_k_dense_replace`` (and off the MoE step)."""
    return not ds_moe_layer(cfg, i)


def ds_shared_experts(cfg: Config, i: int) -> bool:
    """``mlp.shared_experts`` in MoE layers when ``n_shared_experts`` is set."""
    return ds_moe_layer(cfg, i) and cfg.get("n_shared_experts") is not None


def _pattern_skip(cfg: Config, i: int) -> Optional[bool]:
    pattern = cfg.get("index_topk_pattern")
    if pattern is None:
        return None
    return pattern[i] == "S" if 0 <= i < len(pattern) else False


def _freq_skip(cfg: Config, i: int) -> bool:
    freq = _get(cfg, "index_topk_freq", 1)
    return max(i - _get(cfg, "index_skip_topk_offset", 2) + 1, 0) % freq != 0


def v2_indexer_layer(cfg: Config, i: int) -> bool:
    """deepseek_v2.py builds ``self_attn.indexer`` when ``index_topk > 0``, unless IndexCache skips the layer:
    ``index_topk_pattern[i] == "S"``, or (only with ``use_index_cache``) the ``index_topk_freq`` rule."""
    if _get(cfg, "index_topk", 0) <= 0:
        return False
    skip = _pattern_skip(cfg, i)
    if skip is None:
        skip = bool(cfg.get("use_index_cache")) and cfg.get("index_topk_freq") is not None and _freq_skip(cfg, i)
    return not skip


def v32_indexer_layer(cfg: Config, i: int) -> bool:
    """deepseek_v32/attention.py: an indexer unless ``index_topk_pattern[i] == "S"`` or, without a pattern, the
    ``index_topk_freq`` rule skips the layer (freq defaults to 1: every layer has one)."""
    skip = _pattern_skip(cfg, i)
    return not (_freq_skip(cfg, i) if skip is None else skip)


def _mla_heads_tp(cfg: Config, w: int) -> Optional[str]:
    heads = _int(cfg, "num_attention_heads")
    return None if heads % w == 0 else f"{heads} attention heads are not divisible by tensor-parallel size {w}"


def _mla_q_rows(cfg: Config) -> tuple[int, ...]:
    return (_int(cfg, "num_attention_heads") * (_get(cfg, "qk_nope_head_dim", 0) + _get(cfg, "qk_rope_head_dim", 0)),)


def _mla_kv_b_rows(cfg: Config) -> tuple[int, ...]:
    return (_int(cfg, "num_attention_heads") * (_get(cfg, "qk_nope_head_dim", 0) + _get(cfg, "v_head_dim", 0)),)


def _mla_a_rows(cfg: Config) -> tuple[int, ...]:
    return (_int(cfg, "q_lora_rank"), _int(cfg, "kv_lora_rank") + _get(cfg, "qk_rope_head_dim", 0))


def _mla_kv_a_rows(cfg: Config) -> tuple[int, ...]:
    return (_int(cfg, "kv_lora_rank") + _get(cfg, "qk_rope_head_dim", 0),)


def _ds_packed(cfg: Config) -> dict[str, tuple[str, ...]]:
    packed = {"gate_up_proj": ("gate_proj", "up_proj")}
    if cfg.get("q_lora_rank") is not None:
        packed["fused_qkv_a_proj"] = ("q_a_proj", "kv_a_proj_with_mqa")
    return packed


def _ds_check(cfg: Config) -> None:
    if cfg.get("model_type") == "deepseek" or (not cfg.get("qk_nope_head_dim") and not cfg.get("qk_rope_head_dim")):
        raise ConfigError("DeepSeek-V1-style MHA (model_type 'deepseek' or no MLA head dims) is not modelled; "
                          "select its linears with --layers")
    if _get(cfg, "index_topk", 0) > 0 and cfg.get("q_lora_rank") is None:
        raise ConfigError("config.json: the DSA indexer needs q_lora_rank (its wq_b reads the low-rank query)")


def _dsa_check(cfg: Config) -> None:
    _ds_check(cfg)
    if cfg.get("q_lora_rank") is None or cfg.get("index_topk") is None:
        raise ConfigError("config.json: the DSA model (vllm/models/deepseek_v32) needs q_lora_rank and index_topk")


_MLA_ATTN = (
    ModuleTemplate("self_attn.fused_qkv_a_proj", "replicated", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
                   when=q_lora, parts=_mla_a_rows),
    ModuleTemplate("self_attn.q_b_proj", "column", ("self_attn.q_b_proj",), when=q_lora, parts=_mla_q_rows,
                   inputs=lambda cfg: _int(cfg, "q_lora_rank")),
    ModuleTemplate("self_attn.q_proj", "column", ("self_attn.q_proj",), when=no_q_lora, parts=_mla_q_rows),
    ModuleTemplate("self_attn.kv_a_proj_with_mqa", "replicated", ("self_attn.kv_a_proj_with_mqa",), when=no_q_lora,
                   parts=_mla_kv_a_rows),
    ModuleTemplate("self_attn.kv_b_proj", "column", ("self_attn.kv_b_proj",), parts=_mla_kv_b_rows,
                   inputs=lambda cfg: _int(cfg, "kv_lora_rank")),
    ModuleTemplate("self_attn.o_proj", "row", ("self_attn.o_proj",)),
)


def _indexer(when: When) -> ModuleTemplate:
    return ModuleTemplate("self_attn.indexer.wq_b", "replicated", ("self_attn.indexer.wq_b",), when=when,
                          inputs=lambda cfg: _int(cfg, "q_lora_rank"),
                          parts=lambda cfg: (_int(cfg, "index_n_heads") * _int(cfg, "index_head_dim"),))


def _dense_and_shared_experts(dense: When, shared: When) -> tuple[ModuleTemplate, ...]:
    """The DeepSeek-style MLPs (DeepSeek-V2/V3, GLM-4.5 MoE): a dense MLP where ``dense``, and where ``shared``
    ``n_shared_experts`` experts of ``moe_intermediate_size`` fused into one ``mlp.shared_experts`` MLP."""
    return (
        ModuleTemplate("mlp.gate_up_proj", "merged_column", ("mlp.gate_proj", "mlp.up_proj"), when=dense,
                       parts=lambda cfg: (_int(cfg, "intermediate_size"),) * 2),
        ModuleTemplate("mlp.down_proj", "row", ("mlp.down_proj",), when=dense),
        ModuleTemplate("mlp.shared_experts.gate_up_proj", "merged_column",
                       ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"), when=shared,
                       parts=lambda cfg: (_int(cfg, "moe_intermediate_size") * _int(cfg, "n_shared_experts"),) * 2),
        ModuleTemplate("mlp.shared_experts.down_proj", "row", ("mlp.shared_experts.down_proj",), when=shared),
    )


_DS_MLP = _dense_and_shared_experts(ds_dense_layer, ds_shared_experts)


# ------------------------------------------------------------------------------------------------------------
# GLM-5.3 (vllm/models/glm5next): KDA linear-attention layers and MLP/shared experts with the quant config; its MLA
# layers (and their indexer) are built with quant_config=None unless the checkpoint is modelopt_mixed.

def kda_layer(cfg: Config, i: int) -> bool:
    """``Glm5NextTextConfig.is_kda_layer``: ``layer_types[i] == "linear_attention"`` (no layer_types: none)."""
    types = cfg.get("layer_types")
    return isinstance(types, list) and i < len(types) and types[i] == "linear_attention"


def _glm5next_mlp_type(cfg: Config, i: int) -> str:
    types = cfg.get("mlp_layer_types")
    if types is None:
        first = cfg.get("first_k_dense_replace", 0)
        n = _int(cfg, "num_hidden_layers")
        types = ["dense"] * first + ["sparse"] * (n - first) if first is not None else ["sparse"] * n
    return types[i] if i < len(types) else (types[-1] if types else "sparse")


def glm5next_moe_layer(cfg: Config, i: int) -> bool:
    """Glm5NextDecoderLayer: MoE when ``n_routed_experts`` is set and ``mlp_layer_types[i] == "sparse"``."""
    return cfg.get("n_routed_experts", 288) is not None and _glm5next_mlp_type(cfg, i) == "sparse"


def glm5next_dense_layer(cfg: Config, i: int) -> bool:
    return not glm5next_moe_layer(cfg, i)


def glm5next_shared_experts(cfg: Config, i: int) -> bool:
    return glm5next_moe_layer(cfg, i) and cfg.get("n_shared_experts", 1) is not None


def _kda(cfg: Config) -> tuple[int, int]:
    lin = cfg.get("linear_attn_config") or {}
    heads = lin.get("num_heads", _get(cfg, "linear_num_heads", 64))
    head_dim = lin.get("head_dim", _get(cfg, "linear_head_dim", 128))
    return heads, head_dim


def _glm5next_check(cfg: Config) -> None:
    lin = cfg.get("linear_attn_config") or {}
    if lin.get("use_full_rank_gate"):
        raise ConfigError("GLM-5.3 KDA with use_full_rank_gate (padded in_proj, no g_a/g_b) is not modelled; "
                          "select its linears with --layers")


def _glm5next_tp(cfg: Config, w: int) -> Optional[str]:
    heads, _ = _kda(cfg)
    if any(kda_layer(cfg, i) for i in range(_int(cfg, "num_hidden_layers"))) and heads % w:
        return (f"{heads} KDA heads are not divisible by tensor-parallel size {w} (VLLM_GLM53_TP_HEAD_PAD padding "
                "is not modelled)")
    return _mla_heads_tp(cfg, w)


def _kda_in_rows(cfg: Config) -> tuple[int, ...]:
    heads, hd = _kda(cfg)
    return (heads * hd,) * 3 + (heads, hd)


def _glm5next_shared_rows(cfg: Config) -> tuple[int, ...]:
    size = cfg.get("shared_expert_intermediate_size") or (
        _get(cfg, "moe_intermediate_size", 2048) * _get(cfg, "n_shared_experts", 1))
    return (size, size)


_GLM5NEXT = (
    ModuleTemplate("self_attn.in_proj_qkvgfab", "merged_column",
                   ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.b_proj",
                    "self_attn.f_a_proj"), when=kda_layer, parts=_kda_in_rows, replicated_parts=(4,)),
    ModuleTemplate("self_attn.f_b_proj", "column", ("self_attn.f_b_proj",), when=kda_layer, inputs=lambda cfg: _kda(cfg)[1],
                   parts=lambda cfg: (_kda(cfg)[0] * _kda(cfg)[1],)),
    ModuleTemplate("self_attn.g_a_proj", "replicated", ("self_attn.g_a_proj",), when=kda_layer,
                   parts=lambda cfg: (_kda(cfg)[1],)),
    ModuleTemplate("self_attn.g_b_proj", "column", ("self_attn.g_b_proj",), when=kda_layer, inputs=lambda cfg: _kda(cfg)[1],
                   parts=lambda cfg: (_kda(cfg)[0] * _kda(cfg)[1],)),
    ModuleTemplate("self_attn.o_proj", "row", ("self_attn.o_proj",), when=kda_layer),
    ModuleTemplate("mlp.gate_up_proj", "merged_column", ("mlp.gate_proj", "mlp.up_proj"), when=glm5next_dense_layer,
                   parts=lambda cfg: (_get(cfg, "intermediate_size", 12288),) * 2),
    ModuleTemplate("mlp.down_proj", "row", ("mlp.down_proj",), when=glm5next_dense_layer),
    ModuleTemplate("mlp.shared_experts.gate_up_proj", "merged_column",
                   ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"), when=glm5next_shared_experts,
                   parts=_glm5next_shared_rows),
    ModuleTemplate("mlp.shared_experts.down_proj", "row", ("mlp.shared_experts.down_proj",),
                   when=glm5next_shared_experts),
)
_GLM5NEXT_PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvgfab": ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
# The checkpoint groups the KDA decay projections under ``forget_gate`` (the loader strips that segment).
_GLM5NEXT_ALIASES = (("self_attn.f_a_proj", "self_attn.forget_gate.f_a_proj"),
                     ("self_attn.f_b_proj", "self_attn.forget_gate.f_b_proj"))


# ------------------------------------------------------------------------------------------------------------
# Qwen3.5 / Qwen3.8 hybrids (qwen3_5.py): gated-delta-net linear_attn layers beside gated full-attention layers.

def _layer_types(cfg: Config) -> list[str]:
    types = cfg.get("layer_types")
    if isinstance(types, list):
        return types
    interval = _get(cfg, "full_attention_interval", 4)
    return ["linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(_int(cfg, "num_hidden_layers"))]


def linear_attention_layer(cfg: Config, i: int) -> bool:
    """Qwen3_5DecoderLayer: ``layer_types[i] == "linear_attention"`` builds ``linear_attn`` (gated delta net)."""
    return _layer_types(cfg)[i] == "linear_attention"


def full_attention_layer(cfg: Config, i: int) -> bool:
    return _layer_types(cfg)[i] == "full_attention"


def qwen35_dense_mlp(cfg: Config, i: int) -> bool:
    """``qwen3_5_text``: every layer has a dense MLP."""
    return cfg.get("model_type") == "qwen3_5_text"


def qwen35_shared_expert(cfg: Config, i: int) -> bool:
    """``qwen3_5_moe_text``: Qwen3NextSparseMoeBlock in every layer, its shared expert when its size is > 0."""
    return cfg.get("model_type") == "qwen3_5_moe_text" and _get(cfg, "shared_expert_intermediate_size", 0) > 0


def _gdn(cfg: Config) -> tuple[int, int, int, int]:
    return (_int(cfg, "linear_num_key_heads"), _int(cfg, "linear_num_value_heads"),
            _int(cfg, "linear_key_head_dim"), _int(cfg, "linear_value_head_dim"))


def _qwen35_heads(cfg: Config) -> tuple[int, int, int]:
    heads, kv, head_dim = _llama_heads(cfg)
    gate = 1 if cfg.get("attn_output_gate", True) else 0
    return heads * (1 + gate), kv, head_dim  # QKVParallelLinear(total_num_heads * (1 + attn_output_gate))


def _qwen35_check(cfg: Config) -> None:
    if cfg.get("model_type") not in ("qwen3_5_text", "qwen3_5_moe_text"):
        raise ConfigError(f"Invalid model_type {cfg.get('model_type')!r} for a Qwen3.5 text model (the server "
                          "expects qwen3_5_text or qwen3_5_moe_text)")
    bad = [t for t in _layer_types(cfg) if t not in ("linear_attention", "full_attention")]
    if bad:
        raise ConfigError(f"Invalid layer_type {bad[0]!r} (the server expects linear_attention / full_attention)")


def _qwen35_tp(cfg: Config, w: int) -> Optional[str]:
    nk, nv, _, _ = _gdn(cfg)
    if any(linear_attention_layer(cfg, i) for i in range(_int(cfg, "num_hidden_layers"))):
        for what, n in (("linear key", nk), ("linear value", nv)):
            if n % w:
                return f"{n} {what} heads are not divisible by tensor-parallel size {w}"
    return None


def _hybrid_attention_and_mlps(dense: When, shared: When,
                               shared_size: Callable[[Config], int]) -> tuple[ModuleTemplate, ...]:
    """What the Qwen3.5 and Qwen3-Next decoder layers share beside their gated-delta-net projections: full
    attention (on ``full_attention`` layers), a dense MLP where ``dense``, a shared expert where ``shared``."""
    return (
        ModuleTemplate("self_attn.qkv_proj", "qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                       when=full_attention_layer),
        ModuleTemplate("self_attn.o_proj", "row", ("self_attn.o_proj",), when=full_attention_layer),
        ModuleTemplate("mlp.gate_up_proj", "merged_column", ("mlp.gate_proj", "mlp.up_proj"), when=dense,
                       parts=lambda cfg: (_int(cfg, "intermediate_size"),) * 2),
        ModuleTemplate("mlp.down_proj", "row", ("mlp.down_proj",), when=dense),
        ModuleTemplate("mlp.shared_expert.gate_up_proj", "merged_column",
                       ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"), when=shared,
                       parts=lambda cfg: (shared_size(cfg),) * 2),
        ModuleTemplate("mlp.shared_expert.down_proj", "row", ("mlp.shared_expert.down_proj",), when=shared),
    )


_QWEN35 = (
    # in_proj_qkvz = MergedColumnParallelLinear([key_dim, key_dim, value_dim, value_dim]): the checkpoint's
    # in_proj_qkv holds the first three parts, in_proj_z the fourth; each part is sliced per rank.
    ModuleTemplate("linear_attn.in_proj_qkvz", "merged_column", ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
                   when=linear_attention_layer, source_parts=(3, 1),
                   parts=lambda cfg: (_gdn(cfg)[0] * _gdn(cfg)[2],) * 2 + (_gdn(cfg)[1] * _gdn(cfg)[3],) * 2),
    ModuleTemplate("linear_attn.in_proj_ba", "merged_column", ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
                   when=linear_attention_layer, parts=lambda cfg: (_gdn(cfg)[1],) * 2),
    ModuleTemplate("linear_attn.out_proj", "row", ("linear_attn.out_proj",), when=linear_attention_layer),
    *_hybrid_attention_and_mlps(qwen35_dense_mlp, qwen35_shared_expert,
                                lambda cfg: _int(cfg, "shared_expert_intermediate_size")),
)
_QWEN35_PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
# Qwen3VLForConditionalGeneration / Glm4vForConditionalGeneration hf_to_vllm_mapper prefixes.
_VL_MAPPER: tuple[tuple[str, Optional[str]], ...] = (
    ("model.visual.", "visual."), ("lm_head.", "language_model.lm_head."),
    ("model.language_model.", "language_model.model."),
)

# ------------------------------------------------------------------------------------------------------------
# Qwen3-Next (models/qwen3_next.py): the same gated-delta-net layer class as Qwen3.5, built with the interleaved GQA
# layout. Its checkpoint keeps in_proj_qkvz and in_proj_ba as one tensor each, grouped per key head (q, k, v, z of a
# group side by side; b, a likewise), and the server builds each as a merged column layer of ONE output part: a rank
# takes a contiguous run of whole key-head groups, not a slice of every q/k/v/z part as in Qwen3.5.

def qwen3_next_moe_layer(cfg: Config, i: int) -> bool:
    """Qwen3NextDecoderLayer: sparse MoE unless ``i in mlp_only_layers``; needs ``num_experts > 0`` and
    ``(i + 1) % decoder_sparse_step == 0``. Defaults are HF ``Qwen3NextConfig``'s."""
    return (i not in (_get(cfg, "mlp_only_layers", []) or []) and _get(cfg, "num_experts", 512) > 0
            and (i + 1) % _get(cfg, "decoder_sparse_step", 1) == 0)


def qwen3_next_dense_layer(cfg: Config, i: int) -> bool:
    return not qwen3_next_moe_layer(cfg, i)


def qwen3_next_shared_expert(cfg: Config, i: int) -> bool:
    """``mlp.shared_expert`` in MoE layers when ``shared_expert_intermediate_size > 0`` (ROCm AITER shared-expert
    fusion, which would fold it into the routed experts, is not modelled)."""
    return qwen3_next_moe_layer(cfg, i) and _get(cfg, "shared_expert_intermediate_size", 512) > 0


def _qwen3_next_check(cfg: Config) -> None:
    bad = [t for t in _layer_types(cfg) if t not in ("linear_attention", "full_attention")]
    if bad:
        raise ConfigError(f"Invalid layer_type {bad[0]!r} (the server expects linear_attention / full_attention)")
    nk, nv, _, _ = _gdn(cfg) if any(t == "linear_attention" for t in _layer_types(cfg)) else (1, 1, 0, 0)
    if nv % nk:
        raise ConfigError(f"config.json: {nv} linear value heads are not a multiple of {nk} linear key heads "
                          "(the interleaved in_proj_qkvz groups value heads per key head)")


def _qwen3_next_tp(cfg: Config, w: int) -> Optional[str]:
    why = _qwen35_tp(cfg, w)
    if why:
        return why
    n = _int(cfg, "num_hidden_layers")
    experts = _get(cfg, "num_experts", 512)
    if any(qwen3_next_moe_layer(cfg, i) for i in range(n)) and w > experts:
        return f"Tensor parallel size {w} is greater than the number of experts {experts}"
    return None


def _qwen3_next_qkvz_rows(cfg: Config) -> tuple[int, ...]:
    nk, nv, hk, hv = _gdn(cfg)
    return (2 * nk * hk + 2 * nv * hv,)


_QWEN3_NEXT = (
    ModuleTemplate("linear_attn.in_proj_qkvz", "merged_column", ("linear_attn.in_proj_qkvz",),
                   when=linear_attention_layer, parts=_qwen3_next_qkvz_rows),
    ModuleTemplate("linear_attn.in_proj_ba", "merged_column", ("linear_attn.in_proj_ba",),
                   when=linear_attention_layer, parts=lambda cfg: (2 * _gdn(cfg)[1],)),
    ModuleTemplate("linear_attn.out_proj", "row", ("linear_attn.out_proj",), when=linear_attention_layer),
    *_hybrid_attention_and_mlps(qwen3_next_dense_layer, qwen3_next_shared_expert,
                                lambda cfg: _get(cfg, "shared_expert_intermediate_size", 512)),
)
_QWEN3_NEXT_PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkvz",),
    "in_proj_ba": ("in_proj_ba",),
}


# ------------------------------------------------------------------------------------------------------------
# GLM-4.5 / 4.6 / 4.7 MoE (models/glm4_moe.py): plain GQA attention, a dense MLP below first_k_dense_replace, then
# routed experts with shared experts. The router is a torch nn.Linear (not a vLLM linear): never encoded.

def glm4_moe_layer(cfg: Config, i: int) -> bool:
    """Glm4MoeDecoderLayer: MoE when ``n_routed_experts`` is set and ``i >= first_k_dense_replace`` (no freq step)."""
    return cfg.get("n_routed_experts") is not None and i >= _get(cfg, "first_k_dense_replace", 0)


def glm4_dense_layer(cfg: Config, i: int) -> bool:
    return not glm4_moe_layer(cfg, i)


def glm4_shared_experts(cfg: Config, i: int) -> bool:
    """``mlp.shared_experts`` (``moe_intermediate_size * n_shared_experts``) in MoE layers when ``n_shared_experts``
    is set (ROCm AITER shared-expert fusion is not modelled)."""
    return glm4_moe_layer(cfg, i) and cfg.get("n_shared_experts") is not None


def _glm4_moe_check(cfg: Config) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"Unsupported activation: {act}. Only silu is supported (the server refuses it too)")


_GLM4_MOE = _ATTN + _dense_and_shared_experts(glm4_dense_layer, glm4_shared_experts)


FAMILIES: tuple[Family, ...] = (
    Family("Llama / Mistral / Qwen2 / Qwen3",
           ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"), _ATTN + _DENSE_MLP,
           source="upstream models/llama.py"),
    Family("Qwen2-MoE", ("Qwen2MoeForCausalLM",), _ATTN + _MOE_DENSE_MLP + _SHARED_EXPERT,
           source="upstream models/qwen2_moe.py"),
    Family("Qwen3-MoE", ("Qwen3MoeForCausalLM",), _ATTN + _MOE_DENSE_MLP + _SHARED_EXPERT + _QWEN3_ROUTER,
           source="upstream models/qwen3_moe.py"),
    Family("DeepSeek-V2/V3 MLA", ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
           _MLA_ATTN + (_indexer(v2_indexer_layer),) + _DS_MLP, packed=_ds_packed, heads=lambda cfg: (0, 0, 0),
           check=_ds_check, tp_check=_mla_heads_tp, source="models/deepseek_v2.py @ 23a5fc76"),
    Family("GLM-5 / DeepSeek-V3.2 DSA", ("GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM"),
           _MLA_ATTN + (_indexer(v32_indexer_layer),) + _DS_MLP, packed=_ds_packed, heads=lambda cfg: (0, 0, 0),
           check=_dsa_check, tp_check=_mla_heads_tp,
           source="vllm/models/deepseek_v32 (nvidia/model.py, attention.py; registry @ 0b33c223)"),
    Family("GLM-5.3", ("Glm5NextForConditionalGeneration",), _GLM5NEXT, layers_prefix="language_model.model.layers",
           checkpoint_layers=("model.language_model.layers", "language_model.model.layers", "model.layers"),
           packed=lambda cfg: _GLM5NEXT_PACKED, storage_mapper=_VL_MAPPER, check=_glm5next_check,
           tp_check=_glm5next_tp, aliases=_GLM5NEXT_ALIASES, source="vllm/models/glm5next/nvidia/model.py @ 00e81699"),
    Family("GLM-5.3 (text)", ("Glm5NextForCausalLM",), _GLM5NEXT, packed=lambda cfg: _GLM5NEXT_PACKED,
           check=_glm5next_check, tp_check=_glm5next_tp, aliases=_GLM5NEXT_ALIASES,
           source="vllm/models/glm5next/nvidia/model.py @ 00e81699"),
    Family("Qwen3.5 / Qwen3.8 hybrid", ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"),
           _QWEN35, layers_prefix="language_model.model.layers",
           checkpoint_layers=("model.language_model.layers", "language_model.model.layers", "model.layers"),
           packed=lambda cfg: _QWEN35_PACKED, storage_mapper=_VL_MAPPER + (("mtp.", None),), heads=_qwen35_heads,
           check=_qwen35_check, tp_check=_qwen35_tp, source="models/qwen3_5.py @ 1af6ac9a",
           unplanned_vision="visual.blocks.0.attn.qkv"),  # Qwen3_VisionTransformer (qwen3_vl.py), quant config on
    Family("Qwen3-Next", ("Qwen3NextForCausalLM",), _QWEN3_NEXT, packed=lambda cfg: _QWEN3_NEXT_PACKED,
           storage_mapper=(("mtp.", None),), heads=_qwen35_heads, check=_qwen3_next_check, tp_check=_qwen3_next_tp,
           source="models/qwen3_next.py @ 786228a7 (and 58cfbebb), qwen_gdn_linear_attn.py @ 1d6d7dc9"),
    Family("GLM-4.5 / 4.6 MoE", ("Glm4MoeForCausalLM",), _GLM4_MOE, check=_glm4_moe_check,
           source="models/glm4_moe.py @ 5626e3a7"),
    Family("Qwen3.5 / Qwen3.8 hybrid (text)", ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"), _QWEN35,
           checkpoint_layers=("model.layers", "model.language_model.layers"), packed=lambda cfg: _QWEN35_PACKED,
           storage_mapper=(("model.language_model.", "model."), ("mtp.", None)), heads=_qwen35_heads,
           check=_qwen35_check, tp_check=_qwen35_tp, source="models/qwen3_5.py @ 1af6ac9a"),
)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(a for f in FAMILIES for a in f.architectures)


def family_for(architecture: str | None) -> Family | None:
    """The family for ``config.architectures[0]``, or None when we do not know its prefixes."""
    for family in FAMILIES:
        if architecture in family.architectures:
            return family
    return None
