"""Tiny EXL3 checkpoints of the families the fork serves, with realistic config.json and tensor names.

The tests build their checkpoints here, and ``exl3tool synth DIR --family F`` writes the same ones for a person
who wants to see the served flow (overlay, families, TP) on their own machine without downloading a model.
Each builder returns the checkpoint directory. Routed experts (and whatever else the builder says) are stored as
EXL3: trellis/suh/svh/mcg tensors plus a ``tensor_storage`` record; everything else ships BF16 under the official
HF names. Sizes are chosen so most planned layers are 128-aligned at TP 2 with few tiles. Weights are random
(``seed``): the entries are real EXL3 encodes of them, the model says nothing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from exl3tool.errors import ConfigError, InputError

__all__ = ["TinyFamily", "TINY_FAMILIES", "write_tiny", "QWEN38_OVERLAY", "EXL3_SUMMARY", "Builder",
           "write_mla", "write_glm5", "write_qwen35", "write_glm53", "write_qwen3_next", "write_glm4_moe",
           "write_mla_from_config", "mla_config", "mla_attention", "qwen35_config", "glm53_text",
           "qwen3_next_config", "glm4_moe_config"]

EXL3_SUMMARY = {"quant_method": "exl3", "version": "0.0.43", "bits": 4.0, "head_bits": 16, "codebook": "mcg"}

# The Qwen3.8-27B EXL3 recipe of the fork's deployments (issue 11), exactly as the server is started with.
QWEN38_OVERLAY = ('{"linear":{"weight":"mxfp8"},"ignore":["re:.*visual\\\\..*","re:.*in_proj_a$",'
                  '"re:.*in_proj_b$","re:.*in_proj_ba$","re:.*mtp\\\\..*","lm_head"]}')


def _exl3_record(module: str, in_features: int, out_features: int) -> dict:
    """checkpoint.synthetic's record. The writers there (torch) are imported only when a checkpoint is written:
    `synth --help` reads TINY_FAMILIES without torch."""
    from exl3tool.checkpoint.synthetic import exl3_record

    return exl3_record(module, in_features, out_features)


class Builder:
    """Collects tensors and tensor_storage records, then writes the checkpoint."""

    def __init__(self) -> None:
        self.tensors: list[tuple] = []
        self.storage: dict[str, dict] = {}

    def bf16(self, name: str, *shape: int) -> None:
        self.tensors.append((f"{name}.weight" if len(shape) == 2 or name.endswith("norm") else name, shape))

    def linear(self, module: str, out_features: int, in_features: int, *, exl3: bool = False,
               record: str | None = None) -> None:
        """A linear ``module``: BF16 ``.weight``, or EXL3 tensors with a storage record under ``record`` (a spelling)."""
        if exl3:
            from exl3tool.checkpoint.synthetic import exl3_tensors

            self.tensors += exl3_tensors(module, in_features, out_features)
            self.storage[record or module] = _exl3_record(module, in_features, out_features)
        else:
            self.tensors.append((f"{module}.weight", (out_features, in_features)))

    def write(self, path: Path, config: dict, *, shards: int = 1, seed: int = 0, inline_storage: bool = False,
              storage: bool = True, **kw) -> Path:
        from exl3tool.checkpoint.synthetic import write_checkpoint

        config = copy.deepcopy(config)
        quant = None
        if storage and not inline_storage:
            quant = {**config.get("quantization_config", EXL3_SUMMARY), "tensor_storage": self.storage}
        elif inline_storage:
            config["quantization_config"]["tensor_storage"] = self.storage
        return write_checkpoint(path, config, self.tensors, shards=shards, seed=seed, quantization_config=quant, **kw)


def _experts(b: Builder, layer: str, n: int, hidden: int, inter: int) -> None:
    b.bf16(f"{layer}.mlp.gate", n, hidden)  # the router (GateLinear / ReplicatedLinear(quant_config=None))
    for e in range(n):
        for proj, (o, i) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            b.linear(f"{layer}.mlp.experts.{e}.{proj}", o, i, exl3=True)


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V3 MLA (deepseek_v2.py): hidden 128, 4 heads, nope 64 / rope 64 / v 64, q_lora 128, kv_lora 128; routed
# experts of 256 (each rank of a TP 2 server slices 128 of them: the fork slices stored experts in 128-blocks), one
# shared expert of 256 (as DeepSeek-V3's n_shared_experts 1)

MLA = dict(hidden=128, heads=4, nope=64, rope=64, v=64, q_lora=128, kv_lora=128, inter=256, moe_inter=256,
           n_shared=1, experts=4)


def mla_config(*, q_lora: bool = True, arch: str = "DeepseekV3ForCausalLM", layers: int = 2, **extra) -> dict:
    m = MLA
    cfg = {"architectures": [arch], "model_type": "deepseek_v3", "hidden_size": m["hidden"],
           "num_hidden_layers": layers, "num_attention_heads": m["heads"], "num_key_value_heads": m["heads"],
           "q_lora_rank": m["q_lora"] if q_lora else None, "kv_lora_rank": m["kv_lora"],
           "qk_nope_head_dim": m["nope"], "qk_rope_head_dim": m["rope"], "v_head_dim": m["v"],
           "intermediate_size": m["inter"], "moe_intermediate_size": m["moe_inter"],
           "n_routed_experts": m["experts"], "n_shared_experts": m["n_shared"], "num_experts_per_tok": 2,
           "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_nextn_predict_layers": 1, "vocab_size": 64,
           "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "topk_method": "noaux_tc", "quantization_config": dict(EXL3_SUMMARY)}
    cfg.update(extra)
    return cfg


def mla_attention(b: Builder, p: str, cfg: dict, *, stored_q_b: bool = False, indexer: bool = False) -> None:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v, kv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    q = cfg.get("q_lora_rank")
    if q:
        b.linear(f"{p}.self_attn.q_a_proj", q, h)
        b.bf16(f"{p}.self_attn.q_a_layernorm", q)
        # stored as EXL3 under a spelling without the leading "model." (``_storage_entry`` tries it)
        b.linear(f"{p}.self_attn.q_b_proj", heads * (nope + rope), q, exl3=stored_q_b,
                 record=f"{p}.self_attn.q_b_proj".removeprefix("model."))
    else:
        b.linear(f"{p}.self_attn.q_proj", heads * (nope + rope), h)
    b.linear(f"{p}.self_attn.kv_a_proj_with_mqa", kv + rope, h)
    b.bf16(f"{p}.self_attn.kv_a_layernorm", kv)
    b.linear(f"{p}.self_attn.kv_b_proj", heads * (nope + v), kv)
    b.linear(f"{p}.self_attn.o_proj", h, heads * v)
    if indexer:
        ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
        b.linear(f"{p}.self_attn.indexer.wq_b", ih * idim, q)
        b.linear(f"{p}.self_attn.indexer.wk", idim, h)
        b.linear(f"{p}.self_attn.indexer.weights_proj", ih, h)
        b.bf16(f"{p}.self_attn.indexer.k_norm.weight", idim)


def _mla_mlp(b: Builder, p: str, *, dense: bool) -> None:
    """Layer ``p``'s MLP tensors in the MLA models: a dense MLP, or routed experts plus the shared experts."""
    m = MLA
    if dense:
        b.linear(f"{p}.mlp.gate_proj", m["inter"], m["hidden"])
        b.linear(f"{p}.mlp.up_proj", m["inter"], m["hidden"])
        b.linear(f"{p}.mlp.down_proj", m["hidden"], m["inter"])
        return
    _experts(b, p, m["experts"], m["hidden"], m["moe_inter"])
    s = m["moe_inter"] * m["n_shared"]
    b.linear(f"{p}.mlp.shared_experts.gate_proj", s, m["hidden"])
    b.linear(f"{p}.mlp.shared_experts.up_proj", s, m["hidden"])
    b.linear(f"{p}.mlp.shared_experts.down_proj", m["hidden"], s)


def write_mla(path: Path, *, q_lora: bool = True, seed: int = 0, **extra) -> Path:
    """DeepSeek-V3-style: layer 0 dense MLP, layer 1 MoE (EXL3 routed experts, BF16 shared experts), layer 1's
    q_b_proj stored as EXL3, MTP layer 2 present in the checkpoint (the draft's, never the served model's)."""
    cfg = mla_config(q_lora=q_lora, **extra)
    m, b = MLA, Builder()
    b.bf16("model.embed_tokens", 64, m["hidden"])
    for i in range(cfg["num_hidden_layers"] + 1):  # + the MTP layer
        p = f"model.layers.{i}"
        b.bf16(f"{p}.input_layernorm", m["hidden"])
        mla_attention(b, p, cfg, stored_q_b=(i == 1 and q_lora))
        b.bf16(f"{p}.post_attention_layernorm", m["hidden"])
        _mla_mlp(b, p, dense=i < cfg["first_k_dense_replace"])
        if i == cfg["num_hidden_layers"]:
            b.linear(f"{p}.eh_proj", m["hidden"], 2 * m["hidden"])
    b.bf16("model.norm", m["hidden"])
    b.linear("lm_head", 64, m["hidden"])
    return b.write(path, cfg, seed=seed, shards=2)


# ---------------------------------------------------------------------------------------------------------------
# GLM-5 / 5.2 (GlmMoeDsaForCausalLM, vllm/models/deepseek_v32): MLA + DSA indexer

def write_glm5(path: Path, *, layers: int = 4, seed: int = 0, **extra) -> Path:
    cfg = mla_config(arch="GlmMoeDsaForCausalLM", layers=layers, model_type="glm_moe_dsa", index_topk=64,
                     index_n_heads=2, index_head_dim=64, first_k_dense_replace=1, num_nextn_predict_layers=0)
    cfg.update(extra)
    m, b = MLA, Builder()
    b.bf16("model.embed_tokens", 64, m["hidden"])
    for i in range(layers):
        p = f"model.layers.{i}"
        mla_attention(b, p, cfg, indexer=True)  # GLM-5 ships indexer weights for every layer
        _mla_mlp(b, p, dense=i < cfg["first_k_dense_replace"])
    b.linear("lm_head", 64, m["hidden"])
    return b.write(path, cfg, seed=seed)


# ---------------------------------------------------------------------------------------------------------------
# Qwen3.5 / Qwen3.8 hybrid (Qwen3_5ForConditionalGeneration): 4 layers, 3 gated-delta-net + 1 gated full attention;
# 2 linear key heads of 128 (Qwen3.5's linear_key_head_dim), so a TP 2 rank slices 128 rows of each stored q and k

QWEN35 = dict(hidden=128, nk=2, nv=4, hk=128, hv=64, heads=4, kv=2, hd=64, inter=256)


def qwen35_config(**extra) -> dict:
    q = QWEN35
    text = {"model_type": "qwen3_5_text", "hidden_size": q["hidden"], "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "full_attention_interval": 4, "linear_num_key_heads": q["nk"], "linear_num_value_heads": q["nv"],
            "linear_key_head_dim": q["hk"], "linear_value_head_dim": q["hv"], "linear_conv_kernel_dim": 4,
            "num_attention_heads": q["heads"], "num_key_value_heads": q["kv"], "head_dim": q["hd"],
            "attn_output_gate": True, "intermediate_size": q["inter"], "hidden_act": "silu", "vocab_size": 64,
            "rms_norm_eps": 1e-6, "dtype": "bfloat16", "mtp_num_hidden_layers": 1}
    text.update(extra)
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "vision_config": {"depth": 1, "hidden_size": 128, "intermediate_size": 256, "out_hidden_size": 128},
            "torch_dtype": "bfloat16", "quantization_config": dict(EXL3_SUMMARY, bits=5.0)}


def write_qwen35(path: Path, *, bf16_linear_layers: tuple[int, ...] = (2,), bf16_mlp_layers: tuple[int, ...] = (0,),
                 mixed_in_proj: bool = False, seed: int = 0, **extra) -> Path:
    """An EXL3 K5 build whose full attention ships BF16 (as in the fork's Qwen3.8-27B deployments); the GDN
    projections of ``bf16_linear_layers`` and the MLPs of ``bf16_mlp_layers`` ship BF16 too, the rest is EXL3."""
    cfg = qwen35_config(**extra)
    q, b = QWEN35, Builder()
    key, value = q["nk"] * q["hk"], q["nv"] * q["hv"]
    base = "model.language_model"
    b.bf16(f"{base}.embed_tokens", 64, q["hidden"])
    for i, kind in enumerate(cfg["text_config"]["layer_types"]):
        p = f"{base}.layers.{i}"
        if kind == "linear_attention":
            exl3 = i not in bf16_linear_layers
            b.linear(f"{p}.linear_attn.in_proj_qkv", 2 * key + value, q["hidden"], exl3=exl3)
            b.linear(f"{p}.linear_attn.in_proj_z", value, q["hidden"], exl3=exl3 and not mixed_in_proj)
            b.linear(f"{p}.linear_attn.in_proj_b", q["nv"], q["hidden"])  # tiny: BF16 in real builds too
            b.linear(f"{p}.linear_attn.in_proj_a", q["nv"], q["hidden"])
            b.linear(f"{p}.linear_attn.out_proj", q["hidden"], value, exl3=exl3)
            b.bf16(f"{p}.linear_attn.A_log", q["nv"])
        else:
            b.linear(f"{p}.self_attn.q_proj", 2 * q["heads"] * q["hd"], q["hidden"])  # q and its gate
            b.linear(f"{p}.self_attn.k_proj", q["kv"] * q["hd"], q["hidden"])
            b.linear(f"{p}.self_attn.v_proj", q["kv"] * q["hd"], q["hidden"])
            b.linear(f"{p}.self_attn.o_proj", q["hidden"], q["heads"] * q["hd"])
        exl3 = i not in bf16_mlp_layers
        b.linear(f"{p}.mlp.gate_proj", q["inter"], q["hidden"], exl3=exl3)
        b.linear(f"{p}.mlp.up_proj", q["inter"], q["hidden"], exl3=exl3)
        b.linear(f"{p}.mlp.down_proj", q["hidden"], q["inter"], exl3=exl3)
    b.linear("model.visual.blocks.0.attn.qkv", 384, 128)
    b.linear("model.visual.blocks.0.mlp.linear_fc1", 256, 128)
    b.linear("mtp.fc", q["hidden"], 2 * q["hidden"])
    b.linear("lm_head", 64, q["hidden"])
    return b.write(path, cfg, seed=seed)


# ---------------------------------------------------------------------------------------------------------------
# GLM-5.3 (Glm5NextForConditionalGeneration): KDA layers 0-2, an MLA layer 3; layer 0 dense MLP, 1-3 MoE

GLM53 = dict(hidden=128, kda_heads=2, kda_dim=128, inter=256, moe_inter=256, experts=4)


def glm53_text(**extra) -> dict:
    g = GLM53
    text = {"model_type": "glm5_next_text", "hidden_size": g["hidden"], "num_hidden_layers": 4,
            "num_nextn_predict_layers": 1, "first_k_dense_replace": 1, "n_routed_experts": g["experts"],
            "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": g["moe_inter"],
            "intermediate_size": g["inter"], "num_attention_heads": 2, "q_lora_rank": 64, "kv_lora_rank": 64,
            "qk_nope_head_dim": 64, "qk_rope_head_dim": 0, "v_head_dim": 64, "mla_use_nope": True,
            "index_n_heads": 2, "index_head_dim": 64, "index_topk": 64, "index_kpool": 4,
            "layer_types": ["linear_attention"] * 3 + ["deepseek_sparse_attention"],
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "linear_attn_config": {"num_heads": g["kda_heads"], "head_dim": g["kda_dim"], "short_conv_kernel_size": 4,
                                   "full_attn_layers": [3]},
            "hc_mult": 4, "mhc": True, "hidden_act": "silu", "vocab_size": 64, "rms_norm_eps": 1e-5}
    text.update(extra)
    return text


def write_glm53(path: Path, *, scope: bool = False, text: dict | None = None, **kw) -> Path:
    """GLM-5.3 with routed experts stored as EXL3: a standard tensor_storage map, or (``scope``) the
    ``glm53_routed_experts_only`` metadata and no map at all. ``text`` overrides the text config."""
    t = text or glm53_text()
    qc = (dict(EXL3_SUMMARY, bits=4, scope="glm53_routed_experts_only", non_routed_dtype_policy="official_source_native")
          if scope else dict(EXL3_SUMMARY))
    cfg = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": t,
           "vision_config": {"depth": 1, "hidden_size": 128}, "torch_dtype": "bfloat16", "quantization_config": qc}
    g, b = GLM53, Builder()
    h, p_size = t["hidden_size"], t["linear_attn_config"]["num_heads"] * t["linear_attn_config"]["head_dim"]
    heads, hd = t["linear_attn_config"]["num_heads"], t["linear_attn_config"]["head_dim"]
    base = "model.language_model"
    b.bf16(f"{base}.embed_tokens", 64, h)
    for i in range(t["num_hidden_layers"]):
        p = f"{base}.layers.{i}"
        if t["layer_types"][i] == "linear_attention":
            for proj in ("q_proj", "k_proj", "v_proj"):
                b.linear(f"{p}.self_attn.{proj}", p_size, h)
            b.linear(f"{p}.self_attn.b_proj", heads, h)
            b.linear(f"{p}.self_attn.forget_gate.f_a_proj", hd, h)  # the checkpoint's forget_gate grouping
            b.linear(f"{p}.self_attn.forget_gate.f_b_proj", p_size, hd)
            b.linear(f"{p}.self_attn.g_a_proj", hd, h)
            b.linear(f"{p}.self_attn.g_b_proj", p_size, hd)
            b.linear(f"{p}.self_attn.o_proj", h, p_size)
        else:
            mla_attention(b, p, {**t, "q_lora_rank": t["q_lora_rank"]}, indexer=True)
        if t["mlp_layer_types"][i] == "dense":
            b.linear(f"{p}.mlp.gate_proj", t["intermediate_size"], h)
            b.linear(f"{p}.mlp.up_proj", t["intermediate_size"], h)
            b.linear(f"{p}.mlp.down_proj", h, t["intermediate_size"])
        else:
            _experts(b, p, min(t["n_routed_experts"], g["experts"]), h, t["moe_intermediate_size"])
            s = t["moe_intermediate_size"] * t["n_shared_experts"]
            b.linear(f"{p}.mlp.shared_experts.gate_proj", s, h)
            b.linear(f"{p}.mlp.shared_experts.up_proj", s, h)
            b.linear(f"{p}.mlp.shared_experts.down_proj", h, s)
    b.linear("lm_head", 64, h)
    return b.write(path, cfg, storage=not scope, **kw)


def write_mla_from_config(path: Path, config: dict, *, header_only: bool = True, shards: int = 8) -> Path:
    """A DeepSeek-V2/V3-style EXL3 checkpoint of ``config``'s real size: BF16 attention, dense MLPs and shared
    experts as header-only shards; every routed expert stored as EXL3 (tensor_storage records only)."""
    cfg = copy.deepcopy(config)
    cfg["quantization_config"] = dict(EXL3_SUMMARY)
    b = Builder()
    h = cfg["hidden_size"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        mla_attention(b, p, cfg, indexer=bool(cfg.get("index_topk")))  # DSA models (GLM-5): the indexer's tensors
        if i < cfg["first_k_dense_replace"]:
            for proj, shape in (("gate_proj", (cfg["intermediate_size"], h)), ("up_proj", (cfg["intermediate_size"], h)),
                                ("down_proj", (h, cfg["intermediate_size"]))):
                b.linear(f"{p}.mlp.{proj}", *shape)
        else:
            s = cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
            b.linear(f"{p}.mlp.shared_experts.gate_proj", s, h)
            b.linear(f"{p}.mlp.shared_experts.up_proj", s, h)
            b.linear(f"{p}.mlp.shared_experts.down_proj", h, s)
            m = cfg["moe_intermediate_size"]
            for e in range(cfg["n_routed_experts"]):
                for proj, (o, k) in (("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m))):
                    b.storage[f"{p}.mlp.experts.{e}.{proj}"] = _exl3_record(f"{p}.mlp.experts.{e}.{proj}", k, o)
    return b.write(path, cfg, shards=shards, header_only=header_only)


# ---------------------------------------------------------------------------------------------------------------
# Qwen3-Next (Qwen3NextForCausalLM, models/qwen3_next.py): 4 layers, 3 gated-delta-net + 1 gated full attention;
# layer 0 a dense MLP (mlp_only_layers), 1-3 sparse MoE with a shared expert. The GDN input projections ship as
# one interleaved in_proj_qkvz and one in_proj_ba per layer, as the HF Qwen3-Next checkpoints do.

QWEN3_NEXT = dict(hidden=128, nk=2, nv=4, hk=64, hv=64, heads=4, kv=2, hd=64, inter=256, moe_inter=256,
                  shared=256, experts=4)  # routed experts of 256: a TP 2 rank slices 128 of each (128-blocks)


def qwen3_next_config(**extra) -> dict:
    q = QWEN3_NEXT
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": q["hidden"],
           "num_hidden_layers": 4, "full_attention_interval": 4, "linear_num_key_heads": q["nk"],
           "linear_num_value_heads": q["nv"], "linear_key_head_dim": q["hk"], "linear_value_head_dim": q["hv"],
           "linear_conv_kernel_dim": 4, "num_attention_heads": q["heads"], "num_key_value_heads": q["kv"],
           "head_dim": q["hd"], "intermediate_size": q["inter"], "num_experts": q["experts"],
           "num_experts_per_tok": 2, "moe_intermediate_size": q["moe_inter"],
           "shared_expert_intermediate_size": q["shared"], "decoder_sparse_step": 1, "mlp_only_layers": [0],
           "norm_topk_prob": True, "hidden_act": "silu", "vocab_size": 64, "rms_norm_eps": 1e-6,
           "partial_rotary_factor": 0.25, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
           "quantization_config": dict(EXL3_SUMMARY)}
    cfg.update(extra)
    return cfg


def write_qwen3_next(path: Path, *, exl3_linear_layers: tuple[int, ...] = (1,), seed: int = 0, **extra) -> Path:
    """Routed experts EXL3; the GDN projections of ``exl3_linear_layers`` EXL3; everything else BF16. The MTP
    layer ships under ``mtp.`` (the draft's, dropped by the model's mapper)."""
    cfg = qwen3_next_config(**extra)
    q, b = QWEN3_NEXT, Builder()
    key, value, h = q["nk"] * q["hk"], q["nv"] * q["hv"], q["hidden"]
    b.bf16("model.embed_tokens", 64, h)
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                       for i in range(cfg["num_hidden_layers"])]
    for i, kind in enumerate(types):
        p = f"model.layers.{i}"
        if kind == "linear_attention":
            exl3 = i in exl3_linear_layers
            b.linear(f"{p}.linear_attn.in_proj_qkvz", 2 * key + 2 * value, h, exl3=exl3)
            b.linear(f"{p}.linear_attn.in_proj_ba", 2 * q["nv"], h)
            b.linear(f"{p}.linear_attn.out_proj", h, value, exl3=exl3)
            b.bf16(f"{p}.linear_attn.A_log", q["nv"])
        else:
            b.linear(f"{p}.self_attn.q_proj", 2 * q["heads"] * q["hd"], h)  # q and its gate, per head
            b.linear(f"{p}.self_attn.k_proj", q["kv"] * q["hd"], h)
            b.linear(f"{p}.self_attn.v_proj", q["kv"] * q["hd"], h)
            b.linear(f"{p}.self_attn.o_proj", h, q["heads"] * q["hd"])
        if i in cfg["mlp_only_layers"]:
            b.linear(f"{p}.mlp.gate_proj", q["inter"], h)
            b.linear(f"{p}.mlp.up_proj", q["inter"], h)
            b.linear(f"{p}.mlp.down_proj", h, q["inter"])
        else:
            _experts(b, p, q["experts"], h, q["moe_inter"])
            b.linear(f"{p}.mlp.shared_expert_gate", 1, h)
            b.linear(f"{p}.mlp.shared_expert.gate_proj", q["shared"], h)
            b.linear(f"{p}.mlp.shared_expert.up_proj", q["shared"], h)
            b.linear(f"{p}.mlp.shared_expert.down_proj", h, q["shared"])
    b.linear("mtp.fc", h, 2 * h)
    b.linear("mtp.layers.0.self_attn.o_proj", h, q["heads"] * q["hd"])
    b.bf16("model.norm", h)
    b.linear("lm_head", 64, h)
    return b.write(path, cfg, seed=seed)


# ---------------------------------------------------------------------------------------------------------------
# GLM-4.5 / 4.6 MoE (Glm4MoeForCausalLM, models/glm4_moe.py): 3 layers, layer 0 dense (first_k_dense_replace 1),
# 1-2 MoE with 2 shared experts; q/k/v with biases (attention_bias); the nextn/MTP layer 3 in the checkpoint.

GLM4_MOE = dict(hidden=128, heads=4, kv=2, hd=64, inter=256, moe_inter=128, n_shared=2, experts=4)


def glm4_moe_config(**extra) -> dict:
    g = GLM4_MOE
    cfg = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": g["hidden"],
           "num_hidden_layers": 3, "num_attention_heads": g["heads"], "num_key_value_heads": g["kv"],
           "head_dim": g["hd"], "attention_bias": True, "use_qk_norm": False, "partial_rotary_factor": 0.5,
           "intermediate_size": g["inter"], "moe_intermediate_size": g["moe_inter"], "n_routed_experts": g["experts"],
           "n_shared_experts": g["n_shared"], "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1,
           "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1,
           "hidden_act": "silu", "vocab_size": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
           "torch_dtype": "bfloat16", "tie_word_embeddings": False, "quantization_config": dict(EXL3_SUMMARY)}
    cfg.update(extra)
    return cfg


def write_glm4_moe(path: Path, *, exl3_attn_layers: tuple[int, ...] = (2,), seed: int = 0, **extra) -> Path:
    """Routed experts EXL3, the attention of ``exl3_attn_layers`` EXL3, everything else BF16."""
    cfg = glm4_moe_config(**extra)
    g, b = GLM4_MOE, Builder()
    h, qn, kvn = g["hidden"], g["heads"] * g["hd"], g["kv"] * g["hd"]
    b.bf16("model.embed_tokens", 64, h)
    for i in range(cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{i}"
        exl3 = i in exl3_attn_layers
        for proj, n in (("q_proj", qn), ("k_proj", kvn), ("v_proj", kvn)):
            b.linear(f"{p}.self_attn.{proj}", n, h, exl3=exl3)
            b.bf16(f"{p}.self_attn.{proj}.bias", n)
        b.linear(f"{p}.self_attn.o_proj", h, qn, exl3=exl3)
        if i < cfg["first_k_dense_replace"]:
            b.linear(f"{p}.mlp.gate_proj", g["inter"], h)
            b.linear(f"{p}.mlp.up_proj", g["inter"], h)
            b.linear(f"{p}.mlp.down_proj", h, g["inter"])
        else:
            _experts(b, p, g["experts"], h, g["moe_inter"])
            b.bf16(f"{p}.mlp.gate.e_score_correction_bias", g["experts"])
            s = g["moe_inter"] * g["n_shared"]
            b.linear(f"{p}.mlp.shared_experts.gate_proj", s, h)
            b.linear(f"{p}.mlp.shared_experts.up_proj", s, h)
            b.linear(f"{p}.mlp.shared_experts.down_proj", h, s)
        if i == cfg["num_hidden_layers"]:  # the nextn layer (the draft's)
            b.linear(f"{p}.eh_proj", h, 2 * h)
    b.bf16("model.norm", h)
    b.linear("lm_head", 64, h)
    return b.write(path, cfg, seed=seed)


# ---------------------------------------------------------------------------------------------------------------
# `exl3tool synth`: the builders above as named families, each with the overlay the server would be started with


@dataclass(frozen=True)
class TinyFamily:
    """One family ``exl3tool synth`` writes: the builder, the architecture it declares, the overlay to serve it."""

    name: str
    architecture: str
    write: Callable[[Path, int], Path]  # (directory, seed) -> the checkpoint directory
    overlay: Optional[str]  # the --quantization-config its deployments use; None: exl3tool's default overlay
    about: str

    def checkpoint_json(self, path: Path, seed: int) -> dict:
        """The `synth --json` document of this family's checkpoint written to ``path`` with ``seed`` (docs/cache.md):
        its files (names, sorted) and their bytes, and the overlay to serve it with."""
        files = sorted(p for p in Path(path).iterdir() if p.is_file())
        return {"path": str(path), "family": self.name, "architecture": self.architecture, "seed": seed,
                "files": [p.name for p in files], "bytes": sum(p.stat().st_size for p in files),
                "quantization_config": self.overlay, "about": self.about}


TINY_FAMILIES: dict[str, TinyFamily] = {f.name: f for f in (
    TinyFamily("qwen3.5", "Qwen3_5ForConditionalGeneration", lambda p, s: write_qwen35(p, seed=s), QWEN38_OVERLAY,
               "Qwen3.5/3.8 hybrid: 3 gated-delta-net layers and 1 gated full-attention layer, EXL3 K5 build "
               "whose full attention and some projections ship BF16, a vision tower and an MTP layer"),
    TinyFamily("glm5.3", "Glm5NextForConditionalGeneration", lambda p, s: write_glm53(p, seed=s), None,
               "GLM-5.3: 3 KDA layers and 1 MLA layer, dense MLP on layer 0, MoE with EXL3 routed experts"),
    TinyFamily("deepseek-v3", "DeepseekV3ForCausalLM", lambda p, s: write_mla(p, seed=s), None,
               "DeepSeek-V3 MLA: layer 0 dense, layer 1 MoE (EXL3 routed experts), an MTP layer in the checkpoint"),
    TinyFamily("glm5", "GlmMoeDsaForCausalLM", lambda p, s: write_glm5(p, seed=s), None,
               "GLM-5 / 5.2 DSA: MLA with the sparse-attention indexer on every layer, MoE from layer 1"),
    TinyFamily("qwen3-next", "Qwen3NextForCausalLM", lambda p, s: write_qwen3_next(p, seed=s), None,
               "Qwen3-Next: 3 gated-delta-net layers and 1 full-attention layer, MoE with a shared expert"),
    TinyFamily("glm4.5", "Glm4MoeForCausalLM", lambda p, s: write_glm4_moe(p, seed=s), None,
               "GLM-4.5/4.6 MoE: layer 0 dense, layers 1-2 MoE with 2 shared experts, a nextn layer"),
    TinyFamily("llama", "LlamaForCausalLM",
               lambda p, s: _write_llama(p, hidden=128, heads=4, kv_heads=2, head_dim=64, intermediate=256, layers=2,
                                                   vocab=512, seed=s, shards=1), None,
               "Llama: 2 decoder layers, every linear BF16, lm_head stored as EXL3"),
)}


def _write_llama(path: Path, **kw) -> Path:
    from exl3tool.checkpoint.synthetic import write_llama_checkpoint

    return write_llama_checkpoint(path, **kw)


def write_tiny(path: str | Path, family: str, *, seed: int = 0) -> Path:
    """Write the tiny EXL3 checkpoint of ``family`` (a ``TINY_FAMILIES`` name) into the new or empty ``path``.

    Refuses a non-empty directory (a checkpoint written over another would mix their shards) and an unknown
    family (ConfigError naming the known ones). The same family and seed give the same bytes.
    Example: ``write_tiny("./tiny-qwen3.5", "qwen3.5")``, then ``exl3tool cache warm ./tiny-qwen3.5 ...``.
    """
    if family not in TINY_FAMILIES:
        raise ConfigError(f"--family {family!r}: not one of {', '.join(TINY_FAMILIES)}")
    import os
    import shutil
    import tempfile

    root = Path(path)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise InputError(f"{root}: exists and is not an empty directory; give a new folder (a checkpoint written "
                         "over another would mix their files)")
    root.parent.mkdir(parents=True, exist_ok=True)
    # written beside it and renamed into place: a full disk or Ctrl-C leaves no partial checkpoint
    temp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", suffix=".partial", dir=root.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temp, 0o777 & ~umask)  # a folder as mkdir makes it (mkdtemp's is private)
    try:
        TINY_FAMILIES[family].write(temp, seed)
        os.replace(temp, root)  # over a new or empty folder
    except BaseException as exc:
        shutil.rmtree(temp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise InputError(f"{root}: cannot write the checkpoint ({exc.strerror or exc}); nothing was left "
                             "behind") from None
        raise
    return root
