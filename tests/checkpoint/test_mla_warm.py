"""Each kind of planned entry of the tiny DeepSeek-V3 MLA model, encoded on the CPU at TP 2, found by the tests'
independent server look-up, decoding to the right rank-local slice; ``verify`` passes on it.

One module-scoped warm of every module kind once: layer 0 (dense MLP) and layer 1's shared experts, the 7 aligned
entries of rank 1 (K=6), and layer 0's unaligned ``fused_qkv_a_proj`` skipped, as the server skips it. (Layer 1's
attention repeats layer 0's shapes; every layer's planned look-up is checked without encoding in
tests/checkpoint/test_family_plans.py.) Rank 0 is not encoded (7 encodes, not 14): its 7 jobs are planned, each
missing where rank 1's hits, and the weight it would encode is checked against the same plain-indexing slices; a
warm that encoded every rank from rank 0's slice fails on rank 1, whose slice is the second half.
"""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

from exl3tool.checkpoint import rank_local_weight
from exl3tool.encode import dequantize_tensors
from exl3tool.operations.verify import verify_plan
from exl3tool.plan import ServerRequest, prepare
from exl3tool.operations.warm import warm

from helpers import ENC, server_lookup
from exl3tool.checkpoint.tiny import write_mla
from seeds import fresh_seed

OVERLAY = '{"linear": {"weight": "mxfp8"}, "shared_experts": "mxfp8"}'
BITS = 6
LAYERS = ("model.layers.0.*", "model.layers.1.mlp.shared_experts.*")


def rank_slice(t: dict[str, torch.Tensor], prefix: str, r: int) -> torch.Tensor:
    """The ``[N_r, K_r]`` weight TP-2 rank ``r`` holds, from the checkpoint tensors with plain indexing."""
    layer, module = prefix.rsplit(".", 1)
    w = lambda name: t[f"{layer}.{name}.weight"].float()  # noqa: E731
    if module in ("q_b_proj", "kv_b_proj"):  # ColumnParallelLinear: output rows split
        return w(module).chunk(2, dim=0)[r]
    if module in ("o_proj", "down_proj"):  # RowParallelLinear: input columns split
        return w(module).chunk(2, dim=1)[r]
    if module == "gate_up_proj":  # MergedColumnParallelLinear: gate rows | up rows, each split
        return torch.cat([w("gate_proj").chunk(2)[r], w("up_proj").chunk(2)[r]])
    raise AssertionError(prefix)


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    base = tmp_path_factory.mktemp("mla")
    model = write_mla(base / "model", seed=fresh_seed())
    summary = warm(ServerRequest(model=str(model), tp_sizes=(2,), tp_ranks=(1,), bits=BITS, cache_dir=str(base / "cache"),
                               device="cpu", quantization_config=OVERLAY, layers=LAYERS, **ENC))
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(model.glob("*.safetensors")):
        tensors.update(load_file(f))
    return model, base / "cache", summary, tensors


@pytest.mark.slow
def test_every_planned_entry_is_a_server_hit_with_the_right_slice(warmed):
    model, cache, summary, tensors = warmed
    assert summary.counts == {"hit": 0, "encoded": 7, "skipped": 1, "failed": 0}
    assert {e.tp_rank for e in summary.entries} == {1}
    assert {e.prefix for e in summary.entries if e.status == "skipped"} == {"model.layers.0.self_attn.fused_qkv_a_proj"}
    encoded = [e for e in summary.entries if e.status == "encoded"]
    assert {e.prefix for e in encoded} == {
        "model.layers.0.self_attn.q_b_proj", "model.layers.0.self_attn.kv_b_proj", "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.shared_experts.gate_up_proj",
        "model.layers.1.mlp.shared_experts.down_proj"}
    for e in encoded:
        hit = server_lookup(cache, summary.model_identity, summary.encoder_identity, e.prefix, BITS, 2, e.tp_rank,
                            e.input_size, e.output_size)
        assert hit is not None, (e.prefix, e.tp_rank)
        t = {k: torch.from_numpy(v) for k, v in hit[0].items()}
        got = dequantize_tensors(t["trellis"], t["suh"], t["svh"], BITS, "mcg", dtype=torch.float64)  # [K_r, N_r]
        want = rank_slice(tensors, e.prefix, e.tp_rank).t().double()
        other = rank_slice(tensors, e.prefix, 1 - e.tp_rank).t().double()
        assert tuple(got.shape) == (e.input_size, e.output_size) == tuple(want.shape)
        assert ((got - want).norm() / want.norm()).item() < 0.03, e.prefix
        assert ((got - other).norm() / other.norm()).item() > 0.5, e.prefix


@pytest.mark.slow
def test_rank_0_is_planned_as_misses_of_its_own_slices(warmed):
    """Rank 0's look-ups, not encoded here: each planned as a miss beside rank 1's hit, of the right weight."""
    model, cache, summary, tensors = warmed
    checkpoint, plan, _ = prepare(ServerRequest(model=str(model), tp_sizes=(2,), bits=BITS, cache_dir=str(cache),
                                                mode="readonly", device="cpu", quantization_config=OVERLAY,
                                                layers=LAYERS, **ENC))
    states = {(j.prefix, j.tp_rank): j.state for j in plan.jobs}
    encoded = {e.prefix for e in summary.entries if e.status == "encoded"}
    assert states == {**{(p, r): ("hit" if r else "miss") for p in encoded for r in (0, 1)},
                      **{("model.layers.0.self_attn.fused_qkv_a_proj", r): "skipped" for r in (0, 1)}}
    for job in plan.jobs:
        if job.tp_rank == 0 and job.state == "miss":
            got = rank_local_weight(checkpoint, job.rank_job).float()
            assert torch.equal(got, rank_slice(tensors, job.prefix, 0)), job.prefix


@pytest.mark.slow
def test_verify_passes(warmed):
    model, cache, _, _ = warmed
    checkpoint, plan, store = prepare(ServerRequest(model=str(model), tp_sizes=(2,), tp_ranks=(1,), bits=BITS,
                                                  cache_dir=str(cache), mode="readonly", device="cpu", quantization_config=OVERLAY, layers=LAYERS, **ENC))
    report = verify_plan(plan, checkpoint, store, rows=(1, 16), seed=3, device=torch.device("cpu"))
    assert report.ok and len(report.layers) == 7
