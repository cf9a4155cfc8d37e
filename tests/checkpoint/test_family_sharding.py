"""Rank-local weights of the new layer kinds against slices computed here with plain indexing (TP 2)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from exl3tool.checkpoint import open_checkpoint, plan_layers, rank_local_weight

from tiny_models import write_glm53, write_mla, write_qwen35

BOTH = '{"linear": "mxfp8", "shared_experts": "mxfp8"}'


def _tensors(d) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _jobs(d, prefix, overlay=BOTH):
    plan = plan_layers(open_checkpoint(str(d)), overlay=overlay)
    return open_checkpoint(str(d)), [j for j in plan.for_tp(2, include_skipped=True) if j.prefix == prefix]


def test_qwen35_in_proj_qkvz_and_gated_qkv(tmp_path):
    d = write_qwen35(tmp_path / "q")
    t, base = _tensors(d), "model.language_model.layers"
    ckpt, jobs = _jobs(d, "language_model.model.layers.2.linear_attn.in_proj_qkvz")
    qkv, z = t[f"{base}.2.linear_attn.in_proj_qkv.weight"], t[f"{base}.2.linear_attn.in_proj_z.weight"]
    for job in jobs:  # q | k | v (the three parts of in_proj_qkv: 128, 128, 256 rows) | z, each halved
        r = job.tp_rank
        want = torch.cat([qkv[:128].chunk(2)[r], qkv[128:256].chunk(2)[r], qkv[256:].chunk(2)[r], z.chunk(2)[r]])
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
