"""The plans of the families the fork serves, against tables written here from the fork's code (issue 11).

Each table lists, at TP 2, every module the model builds with the quant config: its prefix, parallel style,
rank-local ``(K_r, N_r)`` and what the server does with it ("job": encoded and looked up; "skip": not 128-aligned;
or the reason it is not encoded). The tables come from reading the model files, not from our planner.
"""

from __future__ import annotations

import json
import shutil

import pytest

from exl3tool.checkpoint import open_checkpoint, plan_layers, storage_candidates
from exl3tool.checkpoint.synthetic import exl3_record
from exl3tool.errors import ConfigError

from exl3tool.checkpoint.tiny import (QWEN38_OVERLAY, glm53_text, write_glm4_moe, write_glm5, write_glm53, write_mla, write_qwen3_next,
                         write_qwen35)
from exl3tool.releases import newest
from helpers import BOTH
GLM52_RECIPE = ('{"linear": "mxfp8", "shared_experts": "mxfp8", "ignore": ["re:.*q_a_proj$", '
                '"re:.*kv_a_proj_with_mqa$", "re:.*mlp\\\\.gate$", "re:.*eh_proj$", "lm_head"]}')


def table(plan, tp: int = 2) -> dict[str, tuple]:
    """prefix -> (parallel, K_r, N_r, "job" | "skip") for planned layers, prefix -> reason for the others."""
    out: dict[str, tuple] = {}
    skipped = {p for p, _, _ in plan.skipped(tp)}
    for job in plan.for_tp(tp, include_skipped=True):
        if job.tp_rank == 0:
            out[job.prefix] = (job.layer.parallel, job.input_size, job.output_size,
                               "skip" if job.prefix in skipped else "job")
    for e in plan.excluded:
        out[e.prefix] = (e.reason,)
    return out


# DeepSeek-V3 MLA, q_lora_rank 128 (deepseek_v2.py): fused_qkv_a_proj = q_a | kv_a_with_mqa, replicated (disable_tp),
# 128 + 128 + 64 = 320 rows: unaligned, like DeepSeek-V3's own 2112. Layer 0 dense, layer 1 MoE with shared experts.
MLA_TP2 = {
    "model.layers.0.self_attn.fused_qkv_a_proj": ("replicated", 128, 320, "skip"),
    "model.layers.0.self_attn.q_b_proj": ("column", 128, 256, "job"),
    "model.layers.0.self_attn.kv_b_proj": ("column", 128, 256, "job"),
    "model.layers.0.self_attn.o_proj": ("row", 128, 128, "job"),
    "model.layers.0.mlp.gate_up_proj": ("merged_column", 128, 256, "job"),
    "model.layers.0.mlp.down_proj": ("row", 128, 128, "job"),
    "model.layers.1.self_attn.fused_qkv_a_proj": ("replicated", 128, 320, "skip"),
    "model.layers.1.self_attn.q_b_proj": ("stored_exl3",),
    "model.layers.1.self_attn.kv_b_proj": ("column", 128, 256, "job"),
    "model.layers.1.self_attn.o_proj": ("row", 128, 128, "job"),
    "model.layers.1.mlp.shared_experts.gate_up_proj": ("merged_column", 128, 256, "job"),
    "model.layers.1.mlp.shared_experts.down_proj": ("row", 128, 128, "job"),
}


def test_mla_with_q_lora(tmp_path):
    plan = plan_layers(open_checkpoint(str(write_mla(tmp_path / "m"))), overlay=BOTH, release=newest())
    assert table(plan) == MLA_TP2
    assert plan.kind.kind == "exl3" and plan.server_lookup
    fused = plan.layers[0]
    assert fused.sources == ("model.layers.0.self_attn.q_a_proj.weight",
                             "model.layers.0.self_attn.kv_a_proj_with_mqa.weight")
    assert fused.part_sizes == (128, 192)
    # the default overlay has no shared_experts spec
    assert table(plan_layers(open_checkpoint(str(tmp_path / "m")), release=newest()))[
        "model.layers.1.mlp.shared_experts.down_proj"] == ("no_spec",)
    # TP 4: 4 heads still shard; TP 8 does not (vLLM asserts num_heads % tp == 0)
    assert table(plan, 4)["model.layers.0.self_attn.q_b_proj"] == ("column", 128, 128, "job")
    with pytest.raises(ConfigError, match="4 attention heads are not divisible by tensor-parallel size 8"):
        plan.for_tp(8)


def test_mla_without_q_lora(tmp_path):
    plan = plan_layers(open_checkpoint(str(write_mla(tmp_path / "m", q_lora=False))), overlay=BOTH, release=newest())
    got = table(plan)
    assert {k: v for k, v in got.items() if ".layers.0.self_attn" in k} == {
        "model.layers.0.self_attn.q_proj": ("column", 128, 256, "job"),
        "model.layers.0.self_attn.kv_a_proj_with_mqa": ("replicated", 128, 192, "skip"),
        "model.layers.0.self_attn.kv_b_proj": ("column", 128, 256, "job"),
        "model.layers.0.self_attn.o_proj": ("row", 128, 128, "job"),
    }
    assert not any("fused_qkv_a" in k or "q_b_proj" in k for k in got)


# GLM-5 (GlmMoeDsaForCausalLM -> vllm/models/deepseek_v32): the DSA indexer's wq_b is a ReplicatedLinear built with
# the quant config (q_lora 128 -> 2 heads x 64); wk_weights_proj never (quant_config=None).
def _mlp_expected(p: str, *, dense: bool) -> dict:
    """Layer ``p``'s MLP rows: the dense MLP below first_k_dense_replace (= 1 here), else the shared experts."""
    mlp = f"{p}.mlp" if dense else f"{p}.mlp.shared_experts"
    return {f"{mlp}.gate_up_proj": ("merged_column", 128, 256, "job"), f"{mlp}.down_proj": ("row", 128, 128, "job")}


def _glm5_expected(indexer_layers, fused="skip"):
    out = {}
    for i in range(4):
        p = f"model.layers.{i}"
        out[f"{p}.self_attn.fused_qkv_a_proj"] = ("replicated", 128, 320, "skip") if fused == "skip" else (fused,)
        out[f"{p}.self_attn.q_b_proj"] = ("column", 128, 256, "job")
        out[f"{p}.self_attn.kv_b_proj"] = ("column", 128, 256, "job")
        out[f"{p}.self_attn.o_proj"] = ("row", 128, 128, "job")
        if i in indexer_layers:
            out[f"{p}.self_attn.indexer.wq_b"] = ("replicated", 128, 128, "job")
        out.update(_mlp_expected(p, dense=(i == 0)))
    return out


def test_glm5_indexer_pattern_and_recipe(tmp_path):
    d = write_glm5(tmp_path / "g", index_topk_pattern=["F", "S", "F", "S"])
    plan = plan_layers(open_checkpoint(str(d)), overlay=BOTH, release=newest())
    assert table(plan) == _glm5_expected({0, 2})
    # the GLM-5.2 recipe ignores q_a_proj / kv_a_proj_with_mqa: fused_qkv_a_proj is ignored through its sources
    recipe = plan_layers(open_checkpoint(str(d)), overlay=GLM52_RECIPE, release=newest())
    assert table(recipe) == _glm5_expected({0, 2}, fused="ignored")
    assert not any("wk_weights_proj" in x.prefix or x.prefix.endswith("mlp.gate") for x in recipe.layers)


def test_indexer_freq_rules_differ_between_model_files(tmp_path):
    # deepseek_v32 (GLM-5): no pattern, index_topk_freq 2 (offset 2): skip when max(i - 1, 0) % 2 != 0 -> layer 2
    d = write_glm5(tmp_path / "g", index_topk_freq=2)
    assert table(plan_layers(open_checkpoint(str(d)), overlay=BOTH, release=newest())) == _glm5_expected({0, 1, 3})
    # deepseek_v2 (DeepseekV3ForCausalLM) applies the freq rule only with use_index_cache
    for cache, layers in ((False, {0, 1, 2, 3}), (True, {0, 1, 3})):
        d2 = tmp_path / f"v3{cache}"
        shutil.copytree(d, d2)
        cfg = json.loads((d2 / "config.json").read_text())
        cfg.update(architectures=["DeepseekV3ForCausalLM"], use_index_cache=cache)
        (d2 / "config.json").write_text(json.dumps(cfg))
        got = table(plan_layers(open_checkpoint(str(d2)), overlay=BOTH, release=newest()))
        assert {k for k in got if k.endswith("indexer.wq_b")} == {f"model.layers.{i}.self_attn.indexer.wq_b"
                                                                for i in layers}


# Qwen3.8-style hybrid (Qwen3_5ForConditionalGeneration) with the fork's recipe overlay: layers 0-2 gated delta net,
# layer 3 gated full attention. in_proj_qkvz = [key 256, key 256, value 256, value 256] / 2 per rank (2 key heads
# of 128, as Qwen3.5's linear_key_head_dim; 4 value heads of 64);
# qkv_proj = QKVParallelLinear(8 "heads" (4 + 4 gates), 2 KV heads) -> 4*64 + 64 + 64 at TP 2.
L = "language_model.model.layers"
QWEN38_TP2 = {
    f"{L}.0.linear_attn.in_proj_qkvz": ("stored_exl3",),
    f"{L}.0.linear_attn.in_proj_ba": ("ignored",),
    f"{L}.0.linear_attn.out_proj": ("stored_exl3",),
    f"{L}.0.mlp.gate_up_proj": ("merged_column", 128, 256, "job"),
    f"{L}.0.mlp.down_proj": ("row", 128, 128, "job"),
    f"{L}.1.linear_attn.in_proj_qkvz": ("stored_exl3",),
    f"{L}.1.linear_attn.in_proj_ba": ("ignored",),
    f"{L}.1.linear_attn.out_proj": ("stored_exl3",),
    f"{L}.1.mlp.gate_up_proj": ("stored_exl3",),
    f"{L}.1.mlp.down_proj": ("stored_exl3",),
    f"{L}.2.linear_attn.in_proj_qkvz": ("merged_column", 128, 512, "job"),
    f"{L}.2.linear_attn.in_proj_ba": ("ignored",),
    f"{L}.2.linear_attn.out_proj": ("row", 128, 128, "job"),
    f"{L}.2.mlp.gate_up_proj": ("stored_exl3",),
    f"{L}.2.mlp.down_proj": ("stored_exl3",),
    f"{L}.3.self_attn.qkv_proj": ("qkv", 128, 384, "job"),
    f"{L}.3.self_attn.o_proj": ("row", 128, 128, "job"),
    f"{L}.3.mlp.gate_up_proj": ("stored_exl3",),
    f"{L}.3.mlp.down_proj": ("stored_exl3",),
}


def test_qwen38_hybrid_with_the_recipe(tmp_path):
    plan = plan_layers(open_checkpoint(str(write_qwen35(tmp_path / "q"))), overlay=QWEN38_OVERLAY, release=newest())
    assert table(plan) == QWEN38_TP2
    qkvz = next(x for x in plan.layers if x.prefix.endswith("in_proj_qkvz"))
    assert qkvz.sources == ("model.language_model.layers.2.linear_attn.in_proj_qkv.weight",
                            "model.language_model.layers.2.linear_attn.in_proj_z.weight")
    assert qkvz.part_sizes == (256, 256, 256, 256) and qkvz.part_sources == ((0, 0), (0, 256), (0, 512), (1, 0))
    assert not any("visual" in x.prefix or "mtp" in x.prefix for x in plan.layers)
    # without the ignore list in_proj_ba is planned, and unaligned (N_r = 2 x 4 value heads / 2)
    plain = table(plan_layers(open_checkpoint(str(tmp_path / "q")), release=newest()))
    assert plain[f"{L}.2.linear_attn.in_proj_ba"] == ("merged_column", 128, 4, "skip")
    # 2 linear key heads: TP 4 cannot shard the gated delta net
    with pytest.raises(ConfigError, match="2 linear key heads are not divisible by tensor-parallel size 4"):
        plan.for_tp(4)


def test_qwen38_vision_tower_without_an_ignore_is_named_not_silently_missed(tmp_path):
    """qwen3_5.py builds Qwen3_VisionTransformer with the quant config: an overlay that does not ignore visual.*
    has the server encode the tower online; exl3tool has no table for it and must say so (note + not_planned)."""
    ckpt = open_checkpoint(str(write_qwen35(tmp_path / "q")))
    plain = plan_layers(ckpt, release=newest())  # the default overlay: linear spec, no ignore list
    assert [(e.prefix, e.reason) for e in plain.excluded if e.prefix.startswith("visual")] == [
        ("visual.*", "not_modelled")]
    assert any("vision tower (visual.*)" in n and "re:.*visual" in n for n in plain.notes)
    assert not any(x.prefix.startswith("visual") for x in plain.layers)
    recipe = plan_layers(ckpt, overlay=QWEN38_OVERLAY, release=newest())
    assert not any(e.prefix.startswith("visual") for e in recipe.excluded)
    assert not any("vision tower" in n for n in recipe.notes)
    only_text = plan_layers(ckpt, overlay=r'{"linear": "mxfp8", "ignore": ["re:visual\\..*"]}', release=newest())
    assert not any("vision tower" in n for n in only_text.notes)


def test_qwen38_mixed_in_proj_sources_refused(tmp_path):
    ckpt = open_checkpoint(str(write_qwen35(tmp_path / "q", mixed_in_proj=True)))
    with pytest.raises(ConfigError, match="in_proj_qkvz' mixes EXL3 and BF16 source shards"):
        plan_layers(ckpt, overlay=QWEN38_OVERLAY, release=newest())


# GLM-5.3 (Glm5NextForConditionalGeneration): KDA layers build in_proj_qkvgfab (q|k|v|b column, f_a replicated:
# 3 x 256/2 + 2/2 + 128 = 513 rows, unaligned like the real model's 12448), f_b/g_b (column), g_a (replicated),
# o_proj (row) with the quant config; the MLA layer 3 builds nothing with it.
def _glm53_expected():
    out = {}
    for i in range(4):
        p = f"{L}.{i}"
        if i < 3:
            out[f"{p}.self_attn.in_proj_qkvgfab"] = ("merged_column", 128, 513, "skip")
            out[f"{p}.self_attn.f_b_proj"] = ("column", 128, 128, "job")
            out[f"{p}.self_attn.g_a_proj"] = ("replicated", 128, 128, "job")
            out[f"{p}.self_attn.g_b_proj"] = ("column", 128, 128, "job")
            out[f"{p}.self_attn.o_proj"] = ("row", 128, 128, "job")
        out.update(_mlp_expected(p, dense=(i == 0)))
    return out


def test_glm53_family(tmp_path):
    plan = plan_layers(open_checkpoint(str(write_glm53(tmp_path / "g"))), overlay=BOTH, release=newest())
    assert table(plan) == _glm53_expected()
    fused = plan.layers[0]
    assert fused.sources[-1] == "model.language_model.layers.0.self_attn.forget_gate.f_a_proj.weight"
    assert fused.part_sizes == (256, 256, 256, 2, 128) and fused.replicated_parts == (4,)


def test_glm53_scope_refusals_follow_the_later_exl3_py(tmp_path):
    # a tiny model with the scope: the later exl3.py checks the GLM-5.3-Flash geometry and refuses anything else
    ckpt = open_checkpoint(str(write_glm53(tmp_path / "g", scope=True)))
    with pytest.raises(ConfigError, match="GLM-5.3 routed-only EXL3 architecture mismatch"):
        plan_layers(ckpt, release=newest())
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 6
    (tmp_path / "g" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="GLM-5.3 routed-only EXL3 metadata is unsupported"):
        plan_layers(open_checkpoint(str(tmp_path / "g")), release=newest())


def glm53_flash_text() -> dict:
    """GLM-5.3-Flash's text geometry as the later exl3.py checks it (+ Glm5NextTextConfig defaults)."""
    return glm53_text(hidden_size=4096, num_hidden_layers=45, first_k_dense_replace=3, n_routed_experts=288,
                      moe_intermediate_size=2048, intermediate_size=12288, num_attention_heads=64, q_lora_rank=1536,
                      kv_lora_rank=512, qk_nope_head_dim=256, qk_rope_head_dim=0, v_head_dim=256,
                      index_n_heads=32, index_head_dim=128, index_topk=2048, index_kpool=4,
                      index_kpool_compress=True, index_kpool_always_select_tail=True,
                      layer_types=["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention"
                                   for i in range(45)],
                      mlp_layer_types=["dense"] * 3 + ["sparse"] * 42,
                      linear_attn_config={"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4,
                                          "full_attn_layers": list(range(3, 45, 4))})


def test_glm53_flash_scope_header_only(tmp_path):
    """The Flash geometry with the scope, planned from header-only shards: TP 2 only, every dense layer BF16."""
    d = write_glm53(tmp_path / "f", scope=True, text=glm53_flash_text(), header_only=True, shards=4)
    plan = plan_layers(open_checkpoint(str(d)), overlay=BOTH, release=newest())
    assert plan.kind.kind == "glm53_routed_experts_only" and not plan.excluded
    jobs = plan.for_tp(2)
    # 34 KDA layers x (f_b, g_a, g_b, o_proj) + 3 dense MLPs x 2 + 42 shared experts x 2; in_proj_qkvgfab is
    # 3 x 4096 + 32 + 128 = 12448 rows per rank: unaligned, the server keeps it MXFP8
    assert len(plan.layers) == 34 * 5 + 3 * 2 + 42 * 2 and len(jobs) == 2 * (34 * 4 + 3 * 2 + 42 * 2)
    assert {p for p, _, _ in plan.skipped(2)} == {f"{L}.{i}.self_attn.in_proj_qkvgfab" for i in range(45) if i % 4 != 3}
    with pytest.raises(ConfigError, match="checkpoint=2, runtime=4"):
        plan.for_tp(4)


def test_storage_spellings_follow_storage_entry():
    """``_storage_entry``'s candidates, in the server's order (written from exl3.py)."""
    assert storage_candidates("model.layers.0.mlp.down_proj") == ["model.layers.0.mlp.down_proj",
                                                                  "layers.0.mlp.down_proj"]
    assert storage_candidates("language_model.model.layers.0.o_proj") == [
        "language_model.model.layers.0.o_proj", "model.language_model.model.layers.0.o_proj",
        "language_model.layers.0.o_proj", "model.language_model.layers.0.o_proj", "model.layers.0.o_proj",
        "model.model.layers.0.o_proj", "layers.0.o_proj"]
    assert storage_candidates("lm_head") == ["lm_head", "model.lm_head"]


def test_llama_variant_spellings_first_record_decides_and_no_trellis_test(tiny_hub, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(tiny_hub[2], d)
    quant = json.loads((d / "quantization_config.json").read_text())
    st = quant["tensor_storage"]
    for x in "qkv":  # all three sources under "layers.0..." (no "model."): qkv_proj is stored
        st[f"layers.0.self_attn.{x}_proj"] = exl3_record(f"model.layers.0.self_attn.{x}_proj", 256, 256)
    st["model.model.layers.1.mlp.down_proj"] = exl3_record("x", 512, 256)  # not a spelling of the prefix
    # the exact name holds a bf16 record: it is found first and decides, the later exl3 spelling does not count
    st["model.layers.1.self_attn.o_proj"] = {"quant_format": "bf16"}
    st["layers.1.self_attn.o_proj"] = exl3_record("x", 256, 256)
    (d / "quantization_config.json").write_text(json.dumps(quant))
    got = table(plan_layers(open_checkpoint(str(d)), release=newest()))
    assert got["model.layers.0.self_attn.qkv_proj"] == ("stored_exl3",)
    assert got["model.layers.1.mlp.down_proj"] == ("row", 256, 256, "job")
    assert got["model.layers.1.self_attn.o_proj"] == ("row", 128, 256, "job")


# Qwen3-Next (models/qwen3_next.py, qwen_gdn_linear_attn.py with gqa_interleaved_layout=True): in_proj_qkvz is ONE
# part of 2 x key 128 + 2 x value 256 = 768 rows (interleaved per key-head group), in_proj_ba ONE part of 2 x 4 value
# heads = 8 rows (never aligned); out_proj row over value 256. Layer 3: QKVParallelLinear(4 heads x 2 (gate), 2 KV
# heads, 64) = 512 + 128 + 128. Layer 0 is in mlp_only_layers: dense MLP (256); 1-3 MoE: shared expert (256); the
# router and shared_expert_gate are built with quant_config=None. Layer 1's GDN projections are stored as EXL3.
N = "model.layers"
QWEN3_NEXT_TP1 = {
    f"{N}.0.linear_attn.in_proj_qkvz": ("merged_column", 128, 768, "job"),
    f"{N}.0.linear_attn.in_proj_ba": ("merged_column", 128, 8, "skip"),
    f"{N}.0.linear_attn.out_proj": ("row", 256, 128, "job"),
    f"{N}.0.mlp.gate_up_proj": ("merged_column", 128, 512, "job"),
    f"{N}.0.mlp.down_proj": ("row", 256, 128, "job"),
    f"{N}.1.linear_attn.in_proj_qkvz": ("stored_exl3",),
    f"{N}.1.linear_attn.in_proj_ba": ("merged_column", 128, 8, "skip"),
    f"{N}.1.linear_attn.out_proj": ("stored_exl3",),
    f"{N}.1.mlp.shared_expert.gate_up_proj": ("merged_column", 128, 512, "job"),
    f"{N}.1.mlp.shared_expert.down_proj": ("row", 256, 128, "job"),
    f"{N}.2.linear_attn.in_proj_qkvz": ("merged_column", 128, 768, "job"),
    f"{N}.2.linear_attn.in_proj_ba": ("merged_column", 128, 8, "skip"),
    f"{N}.2.linear_attn.out_proj": ("row", 256, 128, "job"),
    f"{N}.2.mlp.shared_expert.gate_up_proj": ("merged_column", 128, 512, "job"),
    f"{N}.2.mlp.shared_expert.down_proj": ("row", 256, 128, "job"),
    f"{N}.3.self_attn.qkv_proj": ("qkv", 128, 768, "job"),
    f"{N}.3.self_attn.o_proj": ("row", 256, 128, "job"),
    f"{N}.3.mlp.shared_expert.gate_up_proj": ("merged_column", 128, 512, "job"),
    f"{N}.3.mlp.shared_expert.down_proj": ("row", 256, 128, "job"),
}
QWEN3_NEXT_TP2 = {
    f"{N}.0.linear_attn.in_proj_qkvz": ("merged_column", 128, 384, "job"),
    f"{N}.0.linear_attn.in_proj_ba": ("merged_column", 128, 4, "skip"),
    f"{N}.0.linear_attn.out_proj": ("row", 128, 128, "job"),
    f"{N}.0.mlp.gate_up_proj": ("merged_column", 128, 256, "job"),
    f"{N}.0.mlp.down_proj": ("row", 128, 128, "job"),
    f"{N}.1.linear_attn.in_proj_qkvz": ("stored_exl3",),
    f"{N}.1.linear_attn.in_proj_ba": ("merged_column", 128, 4, "skip"),
    f"{N}.1.linear_attn.out_proj": ("stored_exl3",),
    f"{N}.1.mlp.shared_expert.gate_up_proj": ("merged_column", 128, 256, "job"),
    f"{N}.1.mlp.shared_expert.down_proj": ("row", 128, 128, "job"),
    f"{N}.2.linear_attn.in_proj_qkvz": ("merged_column", 128, 384, "job"),
    f"{N}.2.linear_attn.in_proj_ba": ("merged_column", 128, 4, "skip"),
    f"{N}.2.linear_attn.out_proj": ("row", 128, 128, "job"),
    f"{N}.2.mlp.shared_expert.gate_up_proj": ("merged_column", 128, 256, "job"),
    f"{N}.2.mlp.shared_expert.down_proj": ("row", 128, 128, "job"),
    f"{N}.3.self_attn.qkv_proj": ("qkv", 128, 384, "job"),
    f"{N}.3.self_attn.o_proj": ("row", 128, 128, "job"),
    f"{N}.3.mlp.shared_expert.gate_up_proj": ("merged_column", 128, 256, "job"),
    f"{N}.3.mlp.shared_expert.down_proj": ("row", 128, 128, "job"),
}


def test_qwen3_next_family(tmp_path):
    d = write_qwen3_next(tmp_path / "q")
    plan = plan_layers(open_checkpoint(str(d)), overlay=BOTH, release=newest())
    assert table(plan, 1) == QWEN3_NEXT_TP1
    assert table(plan, 2) == QWEN3_NEXT_TP2
    qkvz = next(x for x in plan.layers if x.prefix == f"{N}.0.linear_attn.in_proj_qkvz")
    assert qkvz.sources == ("model.layers.0.linear_attn.in_proj_qkvz.weight",) and qkvz.part_sizes == (768,)
    assert not any("mtp" in x.prefix or x.prefix.endswith(("mlp.gate", "shared_expert_gate")) for x in plan.layers)
    # the recipe's ignore list matches in_proj_ba by its own name (packed_modules_mapping maps it to itself)
    ignored = table(plan_layers(open_checkpoint(str(d)), overlay=QWEN38_OVERLAY, release=newest()))
    assert ignored[f"{N}.2.linear_attn.in_proj_ba"] == ("ignored",)
    assert ignored[f"{N}.2.mlp.shared_expert.down_proj"] == ("no_spec",)  # no shared_experts spec in the recipe
    assert ignored[f"{N}.2.linear_attn.in_proj_qkvz"] == ("merged_column", 128, 384, "job")
    # 2 linear key heads: the interleaved layout cannot be cut into 4 groups
    with pytest.raises(ConfigError, match="2 linear key heads are not divisible by tensor-parallel size 4"):
        plan.for_tp(4)


def test_qwen3_next_sparse_step_and_no_experts(tmp_path):
    # decoder_sparse_step 2, no mlp_only_layers: MoE on (i + 1) % 2 == 0 -> layers 1, 3; dense MLP on 0, 2
    got = table(plan_layers(open_checkpoint(str(write_qwen3_next(tmp_path / "s", mlp_only_layers=[0, 2]))),
                            overlay=BOTH, release=newest()))
    assert {k for k in got if ".mlp." in k} == {f"{N}.{i}.mlp.{m}" for i in (0, 2) for m in ("gate_up_proj", "down_proj")} | {
        f"{N}.{i}.mlp.shared_expert.{m}" for i in (1, 3) for m in ("gate_up_proj", "down_proj")}
    d = tmp_path / "s"
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(decoder_sparse_step=2, mlp_only_layers=[])
    (d / "config.json").write_text(json.dumps(cfg))
    got = table(plan_layers(open_checkpoint(str(d)), overlay=BOTH, release=newest()))
    assert {k for k in got if ".mlp." in k} == {f"{N}.{i}.mlp.{m}" for i in (0, 2) for m in ("gate_up_proj", "down_proj")} | {
        f"{N}.{i}.mlp.shared_expert.{m}" for i in (1, 3) for m in ("gate_up_proj", "down_proj")}


# GLM-4.5 / 4.6 MoE (models/glm4_moe.py): QKVParallelLinear(4 heads, 2 KV heads, 64) = 256 + 64 + 64 at TP 2; layer 0
# dense below first_k_dense_replace = 1 (256); layers 1-2 shared experts (128 x 2 = 256); the router is a torch
# nn.Linear (never a job); layer 2's attention is stored as EXL3; nextn layer 3 is the draft's.
GLM4_MOE_TP1 = {
    "model.layers.0.self_attn.qkv_proj": ("qkv", 128, 512, "job"),
    "model.layers.0.self_attn.o_proj": ("row", 256, 128, "job"),
    "model.layers.0.mlp.gate_up_proj": ("merged_column", 128, 512, "job"),
    "model.layers.0.mlp.down_proj": ("row", 256, 128, "job"),
    "model.layers.1.self_attn.qkv_proj": ("qkv", 128, 512, "job"),
    "model.layers.1.self_attn.o_proj": ("row", 256, 128, "job"),
    "model.layers.1.mlp.shared_experts.gate_up_proj": ("merged_column", 128, 512, "job"),
    "model.layers.1.mlp.shared_experts.down_proj": ("row", 256, 128, "job"),
    "model.layers.2.self_attn.qkv_proj": ("stored_exl3",),
    "model.layers.2.self_attn.o_proj": ("stored_exl3",),
    "model.layers.2.mlp.shared_experts.gate_up_proj": ("merged_column", 128, 512, "job"),
    "model.layers.2.mlp.shared_experts.down_proj": ("row", 256, 128, "job"),
}
GLM4_MOE_TP2 = {
    "model.layers.0.self_attn.qkv_proj": ("qkv", 128, 256, "job"),
    "model.layers.0.self_attn.o_proj": ("row", 128, 128, "job"),
    "model.layers.0.mlp.gate_up_proj": ("merged_column", 128, 256, "job"),
    "model.layers.0.mlp.down_proj": ("row", 128, 128, "job"),
    "model.layers.1.self_attn.qkv_proj": ("qkv", 128, 256, "job"),
    "model.layers.1.self_attn.o_proj": ("row", 128, 128, "job"),
    "model.layers.1.mlp.shared_experts.gate_up_proj": ("merged_column", 128, 256, "job"),
    "model.layers.1.mlp.shared_experts.down_proj": ("row", 128, 128, "job"),
    "model.layers.2.self_attn.qkv_proj": ("stored_exl3",),
    "model.layers.2.self_attn.o_proj": ("stored_exl3",),
    "model.layers.2.mlp.shared_experts.gate_up_proj": ("merged_column", 128, 256, "job"),
    "model.layers.2.mlp.shared_experts.down_proj": ("row", 128, 128, "job"),
}


def test_glm4_moe_family(tmp_path):
    d = write_glm4_moe(tmp_path / "g")
    plan = plan_layers(open_checkpoint(str(d)), overlay=BOTH, release=newest())
    assert table(plan, 1) == GLM4_MOE_TP1
    assert table(plan, 2) == GLM4_MOE_TP2
    assert not any(x.prefix.endswith("mlp.gate") or ".layers.3." in x.prefix for x in plan.layers)
    # the default overlay has no shared_experts spec
    assert table(plan_layers(open_checkpoint(str(d)), release=newest()))["model.layers.1.mlp.shared_experts.down_proj"] == ("no_spec",)
    # TP 4: 2 KV heads replicated twice, 1 head of q per rank (64 rows: unaligned); TP 8 cannot split 4 heads
    assert table(plan, 4)["model.layers.0.self_attn.qkv_proj"] == ("qkv", 128, 192, "skip")
    with pytest.raises(ConfigError, match="4 attention heads are not divisible by tensor-parallel size 8"):
        plan.for_tp(8)


def test_glm4_moe_refuses_other_activations(tmp_path):
    with pytest.raises(ConfigError, match="Unsupported activation: gelu"):
        plan_layers(open_checkpoint(str(write_glm4_moe(tmp_path / "g", hidden_act="gelu"))), overlay=BOTH, release=newest())
