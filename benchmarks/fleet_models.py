"""Synthetic EXL3 checkpoints in the real shapes of the models the fork serves, for ``bench_fleet.py``.

Each geometry is the model's config (sources in the docstrings). The BF16 tensors the server encodes online are
written with random data only for the layers a benchmark encodes (``real_layers``); every other tensor is a hole
of a sparse file (zeros, no disk used), so the plan of the whole model is exact while the write stays a few layers.
Routed experts are ``tensor_storage`` records only (never encoded online; the plan reads no tensor of them).
``scale="tiny"`` shrinks hidden sizes and head counts (the structure, fused parts and TP rules stay) for CPU smoke
runs.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from exl3tool.checkpoint.synthetic import exl3_record, write_checkpoint

__all__ = ["MODELS", "write_model", "layer_of"]

EXL3_SUMMARY = {"quant_method": "exl3", "version": "0.0.43", "bits": 4.0, "head_bits": 16, "codebook": "mcg"}


def layer_of(name: str) -> Optional[int]:
    """The decoder layer index in a checkpoint tensor name, or None."""
    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


class _Builder:
    def __init__(self) -> None:
        self.tensors: list[tuple[str, tuple[int, ...]]] = []
        self.storage: dict[str, dict] = {}

    def linear(self, module: str, out_features: int, in_features: int) -> None:
        self.tensors.append((f"{module}.weight", (out_features, in_features)))

    def norm(self, module: str, size: int) -> None:
        self.tensors.append((f"{module}.weight", (size,)))

    def experts(self, layer: str, n: int, hidden: int, inter: int) -> None:
        self.linear(f"{layer}.mlp.gate", n, hidden)  # the router: built without the quant config
        for e in range(n):
            for proj, (o, k) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                 ("down_proj", (hidden, inter))):
                self.storage[f"{layer}.mlp.experts.{e}.{proj}"] = exl3_record(f"{layer}.mlp.experts.{e}.{proj}", k, o)


# ---------------------------------------------------------------------------------------------------------------
# Qwen3.8-27B (Qwen3_5ForConditionalGeneration): 64 layers, every 4th full attention; attention ships BF16 and is
# encoded online, the MLPs are EXL3 (the fork's deployed K5/K6 builds). Geometry: hidden 5120, intermediate 17408,
# 24 heads / 4 KV heads of 256 (gated query), gated-delta-net 16 key / 48 value heads of 128.

def qwen38_config(tiny: bool) -> dict:
    t = dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
             num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
             linear_key_head_dim=128, linear_value_head_dim=128)
    if tiny:
        t.update(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=8, linear_num_value_heads=8,
                 linear_key_head_dim=32, linear_value_head_dim=32)
    n = t["num_hidden_layers"]
    text = {"model_type": "qwen3_5_text", **t,
            "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)],
            "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "attn_output_gate": True, "hidden_act": "silu",
            "vocab_size": 248320, "rms_norm_eps": 1e-6, "dtype": "bfloat16", "mtp_num_hidden_layers": 1}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "torch_dtype": "bfloat16", "quantization_config": dict(EXL3_SUMMARY, bits=6.0)}


def qwen38_tensors(cfg: dict) -> _Builder:
    t, b = cfg["text_config"], _Builder()
    h = t["hidden_size"]
    key = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    value = t["linear_num_value_heads"] * t["linear_value_head_dim"]
    for i, kind in enumerate(t["layer_types"]):
        p = f"model.language_model.layers.{i}"
        if kind == "linear_attention":
            b.linear(f"{p}.linear_attn.in_proj_qkv", 2 * key + value, h)
            b.linear(f"{p}.linear_attn.in_proj_z", value, h)
            b.linear(f"{p}.linear_attn.in_proj_b", t["linear_num_value_heads"], h)
            b.linear(f"{p}.linear_attn.in_proj_a", t["linear_num_value_heads"], h)
            b.linear(f"{p}.linear_attn.out_proj", h, value)
        else:
            heads, kv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
            b.linear(f"{p}.self_attn.q_proj", 2 * heads * hd, h)  # the query and its gate
            b.linear(f"{p}.self_attn.k_proj", kv * hd, h)
            b.linear(f"{p}.self_attn.v_proj", kv * hd, h)
            b.linear(f"{p}.self_attn.o_proj", h, heads * hd)
        for proj, (o, k) in (("gate_proj", (t["intermediate_size"], h)), ("up_proj", (t["intermediate_size"], h)),
                             ("down_proj", (h, t["intermediate_size"]))):
            b.storage[f"{p}.mlp.{proj}"] = exl3_record(f"{p}.mlp.{proj}", k, o)
    return b


QWEN38_OVERLAY = ('{"linear":{"weight":"mxfp8"},"ignore":["re:.*visual\\\\..*","re:.*in_proj_a$","re:.*in_proj_b$",'
                  '"re:.*in_proj_ba$","re:.*mtp\\\\..*","lm_head"]}')


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V3 (its config.json, tests/data) and GLM-5 (zai-org/GLM-5 config.json values: hidden 6144, 78 layers, MLA
# q_lora 2048 / kv_lora 512, nope 192 / rope 64 / v 256, 64 heads, DSA indexer 32 x 128 on every layer).

def _mla_base(tiny: bool) -> dict:
    return {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "topk_method": "noaux_tc", "moe_layer_freq": 1, "num_experts_per_tok": 8, "vocab_size": 129280,
            "quantization_config": dict(EXL3_SUMMARY)}


def deepseek_v3_config(tiny: bool) -> dict:
    cfg = {**_mla_base(tiny), "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
           "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
           "n_shared_experts": 1, "first_k_dense_replace": 3, "num_nextn_predict_layers": 1}
    if tiny:
        cfg.update(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256,
                   kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                   intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=4, n_shared_experts=4)
    return cfg


def glm5_config(tiny: bool) -> dict:
    cfg = {**deepseek_v3_config(tiny), "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"}
    if not tiny:
        cfg.update(hidden_size=6144, num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64,
                   intermediate_size=12288, moe_intermediate_size=2048, n_shared_experts=1, qk_nope_head_dim=192,
                   qk_rope_head_dim=64, v_head_dim=256, q_lora_rank=2048, kv_lora_rank=512)
    cfg.update(index_n_heads=4 if tiny else 32, index_head_dim=64 if tiny else 128, index_topk=2048)
    return cfg


def mla_tensors(cfg: dict) -> _Builder:
    b = _Builder()
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v, kv, q = (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"],
                            cfg["q_lora_rank"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        b.linear(f"{p}.self_attn.q_a_proj", q, h)
        b.norm(f"{p}.self_attn.q_a_layernorm", q)
        b.linear(f"{p}.self_attn.q_b_proj", heads * (nope + rope), q)
        b.linear(f"{p}.self_attn.kv_a_proj_with_mqa", kv + rope, h)
        b.norm(f"{p}.self_attn.kv_a_layernorm", kv)
        b.linear(f"{p}.self_attn.kv_b_proj", heads * (nope + v), kv)
        b.linear(f"{p}.self_attn.o_proj", h, heads * v)
        if cfg.get("index_topk"):
            ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
            b.linear(f"{p}.self_attn.indexer.wq_b", ih * idim, q)
            b.linear(f"{p}.self_attn.indexer.wk", idim, h)
            b.linear(f"{p}.self_attn.indexer.weights_proj", ih, h)
            b.norm(f"{p}.self_attn.indexer.k_norm", idim)
        if i < cfg["first_k_dense_replace"]:
            inter = cfg["intermediate_size"]
            b.linear(f"{p}.mlp.gate_proj", inter, h)
            b.linear(f"{p}.mlp.up_proj", inter, h)
            b.linear(f"{p}.mlp.down_proj", h, inter)
        else:
            s = cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
            b.linear(f"{p}.mlp.shared_experts.gate_proj", s, h)
            b.linear(f"{p}.mlp.shared_experts.up_proj", s, h)
            b.linear(f"{p}.mlp.shared_experts.down_proj", h, s)
            b.experts(p, cfg["n_routed_experts"], h, cfg["moe_intermediate_size"])
    return b


# ---------------------------------------------------------------------------------------------------------------
# GLM-5.3-Flash (Glm5NextForConditionalGeneration, glm53_routed_experts_only scope): the geometry the fork's later
# exl3.py accepts (45 layers, hidden 4096, KDA 64 heads of 128, every 4th layer MLA, 3 dense MLPs of 12288, shared
# expert of 2048). The scope needs exactly this geometry, so there is no tiny scale of it.

def glm53_flash_config(tiny: bool) -> dict:
    n = 45
    text = {"model_type": "glm5_next_text", "hidden_size": 4096, "num_hidden_layers": n, "num_nextn_predict_layers": 1,
            "first_k_dense_replace": 3, "n_routed_experts": 288, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "moe_intermediate_size": 2048, "intermediate_size": 12288, "num_attention_heads": 64, "q_lora_rank": 1536,
            "kv_lora_rank": 512, "qk_nope_head_dim": 256, "qk_rope_head_dim": 0, "v_head_dim": 256,
            "mla_use_nope": True, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048, "index_kpool": 4,
            "index_kpool_compress": True, "index_kpool_always_select_tail": True,
            "layer_types": ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(n)],
            "mlp_layer_types": ["dense"] * 3 + ["sparse"] * (n - 3),
            "linear_attn_config": {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4,
                                   "full_attn_layers": list(range(3, n, 4))},
            "hc_mult": 4, "mhc": True, "hidden_act": "silu", "vocab_size": 154880, "rms_norm_eps": 1e-5}
    qc = dict(EXL3_SUMMARY, bits=4, scope="glm53_routed_experts_only", non_routed_dtype_policy="official_source_native")
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": text,
            "vision_config": {"depth": 1, "hidden_size": 128}, "torch_dtype": "bfloat16", "quantization_config": qc}


def glm53_tensors(cfg: dict) -> _Builder:
    t, b = cfg["text_config"], _Builder()
    h = t["hidden_size"]
    heads, hd = t["linear_attn_config"]["num_heads"], t["linear_attn_config"]["head_dim"]
    p_size = heads * hd
    for i in range(t["num_hidden_layers"]):
        p = f"model.language_model.layers.{i}"
        if t["layer_types"][i] == "linear_attention":
            for proj in ("q_proj", "k_proj", "v_proj"):
                b.linear(f"{p}.self_attn.{proj}", p_size, h)
            b.linear(f"{p}.self_attn.b_proj", heads, h)
            b.linear(f"{p}.self_attn.forget_gate.f_a_proj", hd, h)
            b.linear(f"{p}.self_attn.forget_gate.f_b_proj", p_size, hd)
            b.linear(f"{p}.self_attn.g_a_proj", hd, h)
            b.linear(f"{p}.self_attn.g_b_proj", p_size, hd)
            b.linear(f"{p}.self_attn.o_proj", h, p_size)
        if t["mlp_layer_types"][i] == "dense":
            for proj, (o, k) in (("gate_proj", (t["intermediate_size"], h)), ("up_proj", (t["intermediate_size"], h)),
                                 ("down_proj", (h, t["intermediate_size"]))):
                b.linear(f"{p}.mlp.{proj}", o, k)
        else:
            s = t["moe_intermediate_size"] * t["n_shared_experts"]
            b.linear(f"{p}.mlp.shared_experts.gate_proj", s, h)
            b.linear(f"{p}.mlp.shared_experts.up_proj", s, h)
            b.linear(f"{p}.mlp.shared_experts.down_proj", h, s)
    return b


# ---------------------------------------------------------------------------------------------------------------
# Llama-3.1-8B (the shapes of the end-to-end rate): hidden 4096, 32 / 8 heads of 128, intermediate 14336, 32
# layers; lm_head stored as EXL3, every decoder linear BF16 (what the fork encodes for such a checkpoint).

def llama8b_config(tiny: bool) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 32,
           "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
           "hidden_act": "silu", "torch_dtype": "bfloat16",
           "quantization_config": {**EXL3_SUMMARY, "bits": 6.0, "head_bits": 6}}
    if tiny:
        cfg.update(hidden_size=256, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=8, head_dim=32,
                   num_hidden_layers=4, vocab_size=512)
    return cfg


def llama_tensors(cfg: dict) -> _Builder:
    b, h = _Builder(), cfg["hidden_size"]
    heads, kv, hd, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        b.linear(f"{p}.self_attn.q_proj", heads * hd, h)
        b.linear(f"{p}.self_attn.k_proj", kv * hd, h)
        b.linear(f"{p}.self_attn.v_proj", kv * hd, h)
        b.linear(f"{p}.self_attn.o_proj", h, heads * hd)
        b.linear(f"{p}.mlp.gate_proj", inter, h)
        b.linear(f"{p}.mlp.up_proj", inter, h)
        b.linear(f"{p}.mlp.down_proj", h, inter)
    b.storage["lm_head"] = exl3_record("lm_head", h, cfg["vocab_size"], 6)
    return b


# name -> (config(tiny), tensors(config), storage map written to quantization_config.json)
MODELS: dict[str, tuple[Callable[[bool], dict], Callable[[dict], _Builder], bool]] = {
    "qwen38-27b": (qwen38_config, qwen38_tensors, True),
    "deepseek-v3": (deepseek_v3_config, mla_tensors, True),
    "glm5": (glm5_config, mla_tensors, True),
    "glm53-flash": (glm53_flash_config, glm53_tensors, False),
    "llama-8b": (llama8b_config, llama_tensors, True),
}


def write_model(path: Path, model: str, real_layers: Iterable[int], *, tiny: bool = False, seed: int = 0) -> Path:
    """Write ``model``'s checkpoint at ``path``: random BF16 data for the tensors of ``real_layers``, holes elsewhere."""
    make_config, make_tensors, storage = MODELS[model]
    config = make_config(tiny)
    b = make_tensors(config)
    real = set(real_layers)
    quant = {**config["quantization_config"], "tensor_storage": b.storage} if storage else None
    return write_checkpoint(path, copy.deepcopy(config), b.tensors, dtype=torch.bfloat16, seed=seed, shards=4,
                            quantization_config=quant, header_only=lambda name: layer_of(name) not in real)
