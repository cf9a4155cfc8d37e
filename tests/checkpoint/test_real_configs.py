"""Plans of real model geometries from header-only shards: the figures the README's sizing table quotes.

DeepSeek-V3 comes from its real config.json (tests/data); GLM-5.3-Flash from the geometry the fork's later exl3.py
checks for the glm53_routed_experts_only scope (no real config.json was available).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exl3tool.checkpoint import open_checkpoint, plan_layers
from exl3tool.plan.sharing import plan_sharing

from test_family_plans import glm53_flash_text
from exl3tool.checkpoint.tiny import write_glm53, write_mla_from_config
from exl3tool.releases import newest
from helpers import BOTH, LINEAR

DATA = Path(__file__).resolve().parent.parent / "data"


def figures(plan, tp: int) -> tuple[int, int]:
    jobs = plan.for_tp(tp)
    return len(jobs), sum((j.input_size // 16) * (j.output_size // 16) for j in jobs)


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> str:
    config = json.loads((DATA / "deepseek_v3_config.json").read_text())
    return str(write_mla_from_config(tmp_path_factory.mktemp("dsv3") / "m", config))


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_deepseek_v3_sizing(deepseek_v3):
    plan = plan_layers(open_checkpoint(deepseek_v3), overlay=LINEAR, release=newest())
    # 61 x (fused_qkv_a_proj, q_b_proj, kv_b_proj, o_proj) + 3 dense MLPs x 2; fused_qkv_a_proj is
    # 1536 + 512 + 64 = 2112 rows, not 128-aligned: the server keeps it MXFP8 at every TP size
    assert len(plan.layers) == 61 * 4 + 3 * 2
    assert {p.rsplit(".", 2)[-2:][1] for p, _, _ in plan.skipped(8)} == {"fused_qkv_a_proj"}
    assert [figures(plan, tp) for tp in (1, 2, 4, 8)] == [(189, 45_621_248), (378, 45_621_248),
                                                          (756, 45_621_248), (1512, 45_621_248)]
    shared = plan_layers(open_checkpoint(deepseek_v3), overlay=BOTH, release=newest())
    assert [figures(shared, tp) for tp in (1, 8)] == [(305, 55_599_104), (2440, 55_599_104)]


def test_glm53_flash_sizing(tmp_path):
    d = write_glm53(tmp_path / "f", scope=True, text=glm53_flash_text(), header_only=True, shards=4)
    assert figures(plan_layers(open_checkpoint(str(d)), overlay=LINEAR, release=newest()), 2) == (284, 6_643_712)
    assert figures(plan_layers(open_checkpoint(str(d)), overlay=BOTH, release=newest()), 2) == (452, 10_772_480)


def glm5_config() -> dict:
    """GLM-5's geometry (zai-org/GLM-5 config.json values as xLLM's glm_moe_dsa defaults record them): 78 layers,
    hidden 6144, MLA with q_lora 2048 / kv_lora 512, nope 192 / rope 64 / v 256, 64 heads, a DSA indexer of 32 x 128
    on every layer (no index_topk_freq / pattern), 3 dense MLPs of 12288, one shared expert of 2048."""
    config = json.loads((DATA / "deepseek_v3_config.json").read_text())
    config.update(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", hidden_size=6144,
                  num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64, intermediate_size=12288,
                  first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048,
                  qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, q_lora_rank=2048, kv_lora_rank=512,
                  index_n_heads=32, index_head_dim=128, index_topk=2048, num_nextn_predict_layers=1,
                  torch_dtype="bfloat16")
    return config


def share(plan, tps) -> tuple[int, int, float]:
    f = plan_sharing(plan, tps)
    return f["entries"], f["encodes"], round(100 * f["tiles_saved_share"], 2)


@pytest.mark.slow
def test_encoding_each_shard_once_saves(deepseek_v3, tmp_path):
    """The share of tiles saved by encoding each distinct shard once (README's figures), per TP size and for a warm
    of TP 1,2,4,8 at once. DeepSeek-V3's only replicated layer (fused_qkv_a_proj) is unaligned, so nothing is
    shared; GLM-5's indexer wq_b (4096 x 2048, replicated) is; GLM-5.3-Flash's KDA g_a_proj is."""
    dsv3 = plan_layers(open_checkpoint(deepseek_v3), overlay=BOTH, release=newest())
    assert [share(dsv3, (tp,)) for tp in (1, 2, 4, 8)] == [(305, 305, 0.0), (610, 610, 0.0), (1220, 1220, 0.0),
                                                           (2440, 2440, 0.0)]
    glm5 = plan_layers(open_checkpoint(str(write_mla_from_config(tmp_path / "glm5", glm5_config()))), overlay=BOTH, release=newest())
    assert {p.rsplit(".", 1)[1] for p, _, _ in glm5.skipped(8)} == {"fused_qkv_a_proj"}  # 2048 + 512 + 64 rows
    figures_glm5 = [share(glm5, (tp,)) for tp in (1, 2, 4, 8)] + [share(glm5, (1, 2, 4, 8))]
    flash = write_glm53(tmp_path / "f", scope=True, text=glm53_flash_text(), header_only=True, shards=4)
    figures_flash = share(plan_layers(open_checkpoint(str(flash)), overlay=BOTH, release=newest()), (2,))
    assert figures_glm5 == [(468, 468, 0.0), (936, 858, 3.98), (1872, 1638, 11.06), (3744, 3198, 22.5),
                            (7020, 5928, 13.03)]
    lin5 = plan_layers(open_checkpoint(str(tmp_path / "glm5")), overlay=LINEAR, release=newest())
    assert [share(lin5, (tp,)) for tp in (1, 2, 4, 8)] + [share(lin5, (1, 2, 4, 8))] == [
        (318, 318, 0.0), (636, 558, 4.81), (1272, 1038, 13.16), (2544, 1998, 26.13), (4770, 3678, 15.53)]
    assert figures_flash == (452, 418, 0.65)
    assert share(plan_layers(open_checkpoint(str(flash)), overlay=LINEAR, release=newest()), (2,)) == (284, 250, 1.05)
