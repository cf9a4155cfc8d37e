"""Plans of real model geometries from header-only shards: the figures the README's sizing table quotes.

DeepSeek-V3 comes from its real config.json (tests/data); GLM-5.3-Flash from the geometry the fork's later exl3.py
checks for the glm53_routed_experts_only scope (no real config.json was available).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exl3tool.checkpoint import open_checkpoint, plan_layers

from test_family_plans import glm53_flash_text
from exl3tool.checkpoint.tiny import write_glm53, write_mla_from_config

DATA = Path(__file__).resolve().parent.parent / "data"
LINEAR = '{"linear": "mxfp8"}'
BOTH = '{"linear": "mxfp8", "shared_experts": "mxfp8"}'


def figures(plan, tp: int) -> tuple[int, int]:
    jobs = plan.for_tp(tp)
    return len(jobs), sum((j.input_size // 16) * (j.output_size // 16) for j in jobs)


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> str:
    config = json.loads((DATA / "deepseek_v3_config.json").read_text())
    return str(write_mla_from_config(tmp_path_factory.mktemp("dsv3") / "m", config))


def test_deepseek_v3_sizing(deepseek_v3):
    plan = plan_layers(open_checkpoint(deepseek_v3), overlay=LINEAR)
    # 61 x (fused_qkv_a_proj, q_b_proj, kv_b_proj, o_proj) + 3 dense MLPs x 2; fused_qkv_a_proj is
    # 1536 + 512 + 64 = 2112 rows, not 128-aligned: the server keeps it MXFP8 at every TP size
    assert len(plan.layers) == 61 * 4 + 3 * 2
    assert {p.rsplit(".", 2)[-2:][1] for p, _, _ in plan.skipped(8)} == {"fused_qkv_a_proj"}
    assert [figures(plan, tp) for tp in (1, 2, 4, 8)] == [(189, 45_621_248), (378, 45_621_248),
                                                          (756, 45_621_248), (1512, 45_621_248)]
    shared = plan_layers(open_checkpoint(deepseek_v3), overlay=BOTH)
    assert [figures(shared, tp) for tp in (1, 8)] == [(305, 55_599_104), (2440, 55_599_104)]


def test_glm53_flash_sizing(tmp_path):
    d = write_glm53(tmp_path / "f", scope=True, text=glm53_flash_text(), header_only=True, shards=4)
    assert figures(plan_layers(open_checkpoint(str(d)), overlay=LINEAR), 2) == (284, 6_643_712)
    assert figures(plan_layers(open_checkpoint(str(d)), overlay=BOTH), 2) == (452, 10_772_480)
