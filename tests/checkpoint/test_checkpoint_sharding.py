"""Rank-local weights (docs/layer-plan.md §4) against slices computed here with plain torch indexing."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl3tool.checkpoint import (
    PlannedLayer,
    RankJob,
    encoder_input,
    open_checkpoint,
    plan_layers,
    rank_local_weight,
    rank_row_ranges,
    rank_sizes,
    write_llama_checkpoint,
)
from exl3tool.releases import newest

HEADS, KV, HD, INTER = 4, 2, 64, 512


def oracle(t: dict[str, torch.Tensor], prefix: str, w: int, r: int) -> torch.Tensor:
    """The rank-local weight, derived independently: which heads / rows / columns rank r owns."""
    layer, kind = prefix.rsplit(".", 1)
    if kind == "qkv_proj":
        q, k, v = (t[f"{layer}.{x}_proj.weight"] for x in "qkv")
        qh = HEADS // w
        kv_heads = [r * KV // w] if w >= KV else list(range(r * KV // w, (r + 1) * KV // w))
        kv_rows = torch.cat([torch.arange(h * HD, (h + 1) * HD) for h in kv_heads])
        return torch.cat([q[r * qh * HD:(r + 1) * qh * HD], k[kv_rows], v[kv_rows]])
    if kind == "gate_up_proj":
        g, u = t[f"{layer}.gate_proj.weight"], t[f"{layer}.up_proj.weight"]
        return torch.cat([g.chunk(w)[r], u.chunk(w)[r]])
    full = t[f"{prefix}.weight"]
    return full.chunk(w, dim=1)[r]  # o_proj / down_proj: row-parallel, split the input dim


@pytest.fixture
def tiny(offline_hub):
    ckpt = open_checkpoint("test-org/tiny-llama", revision="v1.0")
    return ckpt, plan_layers(ckpt, release=newest())


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_local_equals_oracle(tiny, tiny_tensors, tp):
    ckpt, plan = tiny
    for job in plan.for_tp(tp, include_skipped=True):
        got = rank_local_weight(ckpt, job)
        assert got.dtype == torch.bfloat16 and got.is_contiguous()
        assert tuple(got.shape) == (job.output_size, job.input_size)
        assert torch.equal(got, oracle(tiny_tensors, job.prefix, tp, job.tp_rank)), (job.prefix, tp, job.tp_rank)


def test_tp4_kv_heads_replicate(tiny, tiny_tensors):
    ckpt, plan = tiny
    qkv = [j for j in plan.for_tp(4, include_skipped=True) if j.prefix == "model.layers.0.self_attn.qkv_proj"]
    w = [rank_local_weight(ckpt, j) for j in qkv]
    k = tiny_tensors["model.layers.0.self_attn.k_proj.weight"]
    v = tiny_tensors["model.layers.0.self_attn.v_proj.weight"]
    for r in range(4):
        head = r // 2  # ranks 0,1 -> KV head 0; ranks 2,3 -> KV head 1
        assert torch.equal(w[r][HD:2 * HD], k[head * HD:(head + 1) * HD])
        assert torch.equal(w[r][2 * HD:], v[head * HD:(head + 1) * HD])
    assert torch.equal(w[0][HD:], w[1][HD:]) and torch.equal(w[2][HD:], w[3][HD:])
    assert not torch.equal(w[0][:HD], w[1][:HD])  # q heads differ
    assert not torch.equal(w[0][HD:], w[2][HD:])


@pytest.mark.parametrize("tp", [2, 4])
def test_ranks_reassemble_full_weight(tiny, tiny_tensors, tp):
    ckpt, plan = tiny
    by_prefix: dict[str, list[torch.Tensor]] = {}
    for job in plan.for_tp(tp, include_skipped=True):
        by_prefix.setdefault(job.prefix, []).append(rank_local_weight(ckpt, job))
    for name in ("model.layers.1.self_attn.o_proj", "model.layers.0.mlp.down_proj"):
        assert torch.equal(torch.cat(by_prefix[name], dim=1), tiny_tensors[name + ".weight"])
    parts = by_prefix["model.layers.1.mlp.gate_up_proj"]
    half = INTER // tp
    assert torch.equal(torch.cat([p[:half] for p in parts]), tiny_tensors["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(torch.cat([p[half:] for p in parts]), tiny_tensors["model.layers.1.mlp.up_proj.weight"])


def test_dtype_cast_and_encoder_input(tiny, tiny_tensors):
    ckpt, plan = tiny
    job = plan.for_tp(2)[3]
    w16 = rank_local_weight(ckpt, job, dtype=torch.float16)
    assert w16.dtype == torch.float16
    assert torch.equal(w16, oracle(tiny_tensors, job.prefix, 2, job.tp_rank).to(torch.float16))
    x = encoder_input(w16)
    assert x.dtype == torch.float32 and x.is_contiguous() and tuple(x.shape) == (job.input_size, job.output_size)
    assert torch.equal(x, w16.float().t())


def test_float32_checkpoint_served_as_bfloat16(tmp_path, seed):
    d = write_llama_checkpoint(tmp_path / "f32", seed=seed, dtype=torch.float32, shards=3)
    ckpt = open_checkpoint(str(d))
    job = plan_layers(ckpt, release=newest()).for_tp(1)[0]
    full = {}
    for f in d.glob("*.safetensors"):
        full.update(load_file(f))
    got = rank_local_weight(ckpt, job)  # default: the serving dtype, bfloat16 for a float32 model
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, oracle(full, job.prefix, 1, 0).to(torch.bfloat16))


def test_prefused_checkpoint_matches_unfused(tiny_hub, tiny_tensors, tmp_path):
    """A checkpoint storing qkv_proj / gate_up_proj already fused yields the same rank-local weights."""
    d = tmp_path / "fused"
    d.mkdir()
    shutil.copy(tiny_hub[2] / "config.json", d / "config.json")
    shutil.copy(tiny_hub[2] / "quantization_config.json", d / "quantization_config.json")
    fused = {}
    for name, t in tiny_tensors.items():
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            stem = name.replace(".q_proj.weight", "")
            fused[f"{stem}.qkv_proj.weight"] = torch.cat([tiny_tensors[f"{stem}.{x}_proj.weight"] for x in "qkv"])
        elif ".gate_proj." in name:
            stem = name.replace(".gate_proj.weight", "")
            fused[f"{stem}.gate_up_proj.weight"] = torch.cat([t, tiny_tensors[f"{stem}.up_proj.weight"]])
        else:
            fused[name] = t
    save_file(fused, str(d / "model.safetensors"))
    ckpt = open_checkpoint(str(d))
    plan = plan_layers(ckpt, release=newest())
    assert plan.layers[0].sources == ("model.layers.0.self_attn.qkv_proj.weight",)
    assert plan.layers[0].part_sizes == (256, 128, 128) and plan.layers[2].part_sizes == (512, 512)
    for tp in (2, 4):
        for job in plan.for_tp(tp, include_skipped=True):
            assert torch.equal(rank_local_weight(ckpt, job), oracle(tiny_tensors, job.prefix, tp, job.tp_rank))


def test_minilm_replicated_weights(minilm_dir):
    ckpt = open_checkpoint(str(minilm_dir))
    plan = plan_layers(ckpt, layers=["encoder.layer.0.*"], release=newest())
    full = load_file(str(minilm_dir / "model.safetensors"))
    for job in plan.for_tp(2):
        got = rank_local_weight(ckpt, job, dtype=torch.float32)
        assert torch.equal(got, full[job.prefix + ".weight"])
    job = plan.for_tp(1)[0]
    assert rank_local_weight(ckpt, job).dtype == torch.bfloat16  # no torch_dtype in config: serve as bfloat16


def test_job_size_mismatch_rejected(tiny):
    ckpt, plan = tiny
    job = dataclasses.replace(plan.for_tp(2)[0], output_size=999)
    with pytest.raises(ValueError, match="N_r=999"):
        rank_local_weight(ckpt, job)


def test_spec_worked_example_llama_8b_tp2_rank1():
    """Spec 2.3: Llama-3.1-8B qkv at TP 2 rank 1 is q rows 2048..4095, k and v rows 512..1023; N_r 3072."""
    qkv = PlannedLayer("model.layers.0.self_attn.qkv_proj", "qkv", ("q", "k", "v"), (4096, 1024, 1024),
                       4096, 6144, num_heads=32, num_kv_heads=8, head_dim=128, v_head_dim=128)
    assert rank_sizes(qkv, 2) == (4096, 3072)
    job = RankJob(qkv, 2, 1, 4096, 3072)
    assert rank_row_ranges(job) == [(0, 2048, 4096), (1, 512, 1024), (2, 512, 1024)]
