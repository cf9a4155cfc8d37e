"""The fleet benchmark's checkpoints plan as the real models do (no encode: the figures the README quotes)."""

from __future__ import annotations

import sys
from pathlib import Path

from exl3tool.checkpoint import open_checkpoint, plan_layers
from exl3tool.plan.sharing import plan_sharing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from fleet_models import QWEN38_OVERLAY, layer_of, write_model  # noqa: E402


def test_qwen38_27b_plan_and_holes(tmp_path):
    model = write_model(tmp_path / "q", "qwen38-27b", real_layers=[3])
    plan = plan_layers(open_checkpoint(str(model)), overlay=QWEN38_OVERLAY)
    # 48 gated-delta-net layers x (in_proj_qkvz, out_proj) + 16 full-attention layers x (qkv_proj, o_proj)
    assert len(plan.layers) == 128
    figures = plan_sharing(plan, (1, 2, 4, 8))
    assert (figures["entries"], figures["encodes"], figures["tiles"]) == (1920, 1920, 113_377_280)
    blocks = {f.name: f.stat().st_blocks for f in model.glob("*.safetensors")}
    assert sum(blocks.values()) * 512 < 2 * 10**9  # one layer's data, the other 63 are holes
    assert layer_of("model.language_model.layers.12.linear_attn.out_proj.weight") == 12


def test_glm53_flash_shares_g_a_proj(tmp_path):
    model = write_model(tmp_path / "f", "glm53-flash", real_layers=[])
    plan = plan_layers(open_checkpoint(str(model)), overlay='{"linear": "mxfp8", "shared_experts": "mxfp8"}')
    figures = plan_sharing(plan, (2,))
    assert (figures["entries"], figures["encodes"], figures["tiles"]) == (452, 418, 10_772_480)
    assert figures["encodes_saved"] == 34  # the 34 KDA layers' g_a_proj, once for both ranks
