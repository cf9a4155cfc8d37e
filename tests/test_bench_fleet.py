"""The fleet benchmark's checkpoints plan as the real models do (no encode: the figures the README quotes)."""

from __future__ import annotations

import sys
from pathlib import Path

from exl3tool.checkpoint import open_checkpoint, plan_layers
from exl3tool.plan.sharing import plan_sharing
from exl3tool.releases import newest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from fleet_models import QWEN38_OVERLAY, layer_of, write_model  # noqa: E402


def test_qwen38_27b_plan_and_holes(tmp_path):
    model = write_model(tmp_path / "q", "qwen38-27b", real_layers=[3])
    plan = plan_layers(open_checkpoint(str(model)), overlay=QWEN38_OVERLAY, release=newest())
    # 48 gated-delta-net layers x (in_proj_qkvz, out_proj) + 16 full-attention layers x (qkv_proj, o_proj)
    assert len(plan.layers) == 128
    figures = plan_sharing(plan, (1, 2, 4, 8))
    assert (figures["entries"], figures["encodes"], figures["tiles"]) == (1920, 1920, 113_377_280)
    blocks = {f.name: f.stat().st_blocks for f in model.glob("*.safetensors")}
    assert sum(blocks.values()) * 512 < 2 * 10**9  # one layer's data, the other 63 are holes
    assert layer_of("model.language_model.layers.12.linear_attn.out_proj.weight") == 12


def test_glm53_flash_shares_g_a_proj(tmp_path):
    model = write_model(tmp_path / "f", "glm53-flash", real_layers=[])
    plan = plan_layers(open_checkpoint(str(model)), overlay='{"linear": "mxfp8", "shared_experts": "mxfp8"}', release=newest())
    figures = plan_sharing(plan, (2,))
    assert (figures["entries"], figures["encodes"], figures["tiles"]) == (452, 418, 10_772_480)
    assert figures["encodes_saved"] == 34  # the 34 KDA layers' g_a_proj, once for both ranks


def test_reference_samples_the_heaviest_shapes_first():
    import bench_fleet

    shapes = {"512x4096x6": 3, "2048x7168x6": 1, "7168x4608x6": 1, "128x4096x4": 2}
    # encode tiles per shape: 24,576 / 57,344 / 129,024 / 4,096
    assert bench_fleet.sample_shapes(shapes) == ["7168x4608x6", "2048x7168x6", "512x4096x6", "128x4096x4"]
    assert bench_fleet.sample_shapes(shapes, cap=1) == ["7168x4608x6"]
    assert bench_fleet.sample_shapes({"256x256x6": 1, "256x256x4": 1}) == ["256x256x4", "256x256x6"]  # ties: the key


def test_reference_budget_goes_to_the_lightest_presets_first_and_rolls_over(monkeypatch):
    """Each preset's reference child gets an equal share of what is left; a light preset's leftover goes on."""
    import time

    import bench_fleet

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    calls = []

    def fake(result, reference, device, timeout, deadline_s=None, cap=None):
        calls.append((result["preset"], round(deadline_s), cap))
        clock[0] += {"small": 5, "mid": 40, "big": 100}[result["preset"]]  # what each child really took
        return {"tiles_per_s": 1, "warm_vs_reference": 1.0}

    monkeypatch.setattr(bench_fleet, "_time_reference", fake)
    monkeypatch.setattr(bench_fleet, "_row", lambda r: "")
    results = [{"preset": name, "measured": {"encode_tiles": tiles}} for name, tiles in
               (("big", 3_000_000), ("small", 10_000), ("mid", 900_000))]
    bench_fleet._references(results, "/ref", "cuda", 900, 1000.0 + 300, 4, {"compile_import_seconds": 1.0})
    # 300 s for three: small gets 100 (90 after its start), leaves 295 for two (147.5 each), big the last 255
    assert calls == [("small", 90, 4), ("mid", 138, 4), ("big", 245, 4)]
    assert all(r["reference"]["compile"] == {"compile_import_seconds": 1.0} for r in results)

    calls.clear()
    clock[0] = 1000.0
    bench_fleet._references(results, "/ref", "cuda", 900, 1000.0 + 50, None, {"compile_import_seconds": 1.0})
    # 50 s for three: at least 30 s each while 30 s are left: small (5 s), mid (40 s), then 5 s: big is not started
    assert calls == [("small", 20, None), ("mid", 20, None)]
    assert results[0]["reference"]["tiles_per_s"] is None and "budget" in results[0]["reference"]["error"]

    bench_fleet._references(results, "/ref", "cuda", 900, None, None, {"error": "compile failed"})
    assert all(r["reference"] == {"tiles_per_s": None, "error": "compile failed"} for r in results)
