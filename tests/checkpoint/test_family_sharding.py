"""Rank-local weights of the new layer kinds against slices computed here with plain indexing (TP 2)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from exl3tool.checkpoint import open_checkpoint, plan_layers, rank_local_weight

from exl3tool.checkpoint.tiny import QWEN3_NEXT, write_glm4_moe, write_glm53, write_mla, write_qwen3_next, write_qwen35
from exl3tool.releases import newest
from helpers import BOTH



def _tensors(d) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _jobs(d, prefix, overlay=BOTH):
    plan = plan_layers(open_checkpoint(str(d)), overlay=overlay, release=newest())
    return open_checkpoint(str(d)), [j for j in plan.for_tp(2, include_skipped=True) if j.prefix == prefix]


def test_qwen35_in_proj_qkvz_and_gated_qkv(tmp_path):
    d = write_qwen35(tmp_path / "q")
    t, base = _tensors(d), "model.language_model.layers"
    ckpt, jobs = _jobs(d, "language_model.model.layers.2.linear_attn.in_proj_qkvz")
    qkv, z = t[f"{base}.2.linear_attn.in_proj_qkv.weight"], t[f"{base}.2.linear_attn.in_proj_z.weight"]
    for job in jobs:  # q | k | v (the three parts of in_proj_qkv: 256, 256, 256 rows) | z, each halved
        r = job.tp_rank
        want = torch.cat([qkv[:256].chunk(2)[r], qkv[256:512].chunk(2)[r], qkv[512:].chunk(2)[r], z.chunk(2)[r]])
        assert torch.equal(rank_local_weight(ckpt, job), want)
    ckpt, jobs = _jobs(d, "language_model.model.layers.3.self_attn.qkv_proj")
    q, k, v = (t[f"{base}.3.self_attn.{x}_proj.weight"] for x in "qkv")
    for job in jobs:  # q carries 4 heads + 4 gates (8 x 64 rows): rank r holds rows of its 4; 1 KV head each
        r = job.tp_rank
        want = torch.cat([q[r * 256:(r + 1) * 256], k[r * 64:(r + 1) * 64], v[r * 64:(r + 1) * 64]])
        assert torch.equal(rank_local_weight(ckpt, job), want)


def test_glm53_kda_in_proj_keeps_f_a_whole(tmp_path):
    d = write_glm53(tmp_path / "g", seed=3)
    t, p = _tensors(d), "model.language_model.layers.1.self_attn"
    ckpt, jobs = _jobs(d, "language_model.model.layers.1.self_attn.in_proj_qkvgfab")
    for job in jobs:
        r = job.tp_rank
        want = torch.cat([t[f"{p}.{x}_proj.weight"].chunk(2)[r] for x in "qkvb"]
                         + [t[f"{p}.forget_gate.f_a_proj.weight"]])
        got = rank_local_weight(ckpt, job)
        assert tuple(got.shape) == (513, 128) and torch.equal(got, want)


def test_mla_fused_qkv_a_is_replicated(tmp_path):
    d = write_mla(tmp_path / "m", seed=5)
    t = _tensors(d)
    ckpt, jobs = _jobs(d, "model.layers.0.self_attn.fused_qkv_a_proj")
    want = torch.cat([t["model.layers.0.self_attn.q_a_proj.weight"],
                      t["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]])
    assert [j.tp_rank for j in jobs] == [0, 1]
    for job in jobs:
        assert torch.equal(rank_local_weight(ckpt, job), want)


def test_qwen3_next_interleaved_in_proj_takes_whole_key_groups(tmp_path):
    """One interleaved part: rank r holds key-head groups [r * nk/W, (r+1) * nk/W), each group q|k|v|z side by side
    (64 + 64 + 2 x 64 + 2 x 64 = 384 rows), not a slice of each of q, k, v, z as in Qwen3.5."""
    q = QWEN3_NEXT
    d = write_qwen3_next(tmp_path / "q", seed=7)
    t = _tensors(d)
    per_group = 2 * q["hk"] + 2 * (q["nv"] // q["nk"]) * q["hv"]
    qkvz = t["model.layers.2.linear_attn.in_proj_qkvz.weight"]
    groups = [qkvz[g * per_group:(g + 1) * per_group] for g in range(q["nk"])]
    ckpt, jobs = _jobs(d, "model.layers.2.linear_attn.in_proj_qkvz")
    assert [j.tp_rank for j in jobs] == [0, 1]
    for job in jobs:  # nk = 2 groups, TP 2: one group per rank
        assert torch.equal(rank_local_weight(ckpt, job), groups[job.tp_rank])
    ba = t["model.layers.2.linear_attn.in_proj_ba.weight"]  # [b_g0 (2), a_g0 (2), b_g1, a_g1]
    ckpt, jobs = _jobs(d, "model.layers.2.linear_attn.in_proj_ba")
    for job in jobs:
        r = job.tp_rank
        assert torch.equal(rank_local_weight(ckpt, job), ba[4 * r:4 * (r + 1)])


def test_glm4_moe_qkv_with_replicated_kv_heads(tmp_path):
    """TP 4 with 2 KV heads: rank r holds q head r and KV head r // 2 (vLLM replicates each KV head on 2 ranks)."""
    d = write_glm4_moe(tmp_path / "g", seed=9)
    t = _tensors(d)
    q, k, v = (t[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    ckpt = open_checkpoint(str(d))
    plan = plan_layers(ckpt, overlay=BOTH, release=newest())
    jobs = [j for j in plan.for_tp(4, include_skipped=True) if j.prefix == "model.layers.1.self_attn.qkv_proj"]
    assert [j.tp_rank for j in jobs] == [0, 1, 2, 3]
    for job in jobs:
        r, kr = job.tp_rank, job.tp_rank // 2
        want = torch.cat([q[r * 64:(r + 1) * 64], k[kr * 64:(kr + 1) * 64], v[kr * 64:(kr + 1) * 64]])
        assert torch.equal(rank_local_weight(ckpt, job), want)
