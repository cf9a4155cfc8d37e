"""An encode within a memory budget: chunked quantization gives the same bytes as one pass, the plan keeps its
predicted peak inside the budget, and a budget too small fails naming the layer and the bytes it needed."""

from __future__ import annotations

import pytest
import torch

from exl3tool.format.layout import matrix_to_tiles, tile_element_index, tile_position
from exl3tool.encode.memory import (
    MIN_CHUNK_TILES, MIN_SLOTS, EncodeMemoryError, default_budget, plan_encode_memory, reference_call_bytes,
    reference_peak_bytes, sample_tile_count, viterbi_slot_bytes,
)
from exl3tool.encode.online import encode_linear, quantize_regularized, scale_mse
from exl3tool.format.trellis import pack_trellis
from exl3tool.encode.viterbi import quantize_tiles
from seeds import fresh_seed
from exl3tool.knobs import current_tuning

# the speed rules the plan reads (knobs.Tuning: the defaults unless EXL3TOOL_* variables are set)
COST_ROW_BITS = current_tuning().cost_row_bits
HALF_ROW_BITS = current_tuning().half_row_bits
IN_PLACE_BITS = current_tuning().in_place_bits
CHUNK_ROUNDS_IN_PLACE = current_tuning().chunk_rounds_in_place


def _weight(k: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(k, n, generator=gen) * torch.empty(1, n).uniform_(0.005, 0.05, generator=gen)


def _smallest_budget(k: int, n: int, bits: int = 6) -> int:
    with pytest.raises(EncodeMemoryError) as info:
        plan_encode_memory(k, n, bits, "cpu", 1)
    return info.value.needed_bytes


def test_tile_element_index_gathers_the_tiles_of_matrix_to_tiles():
    w = torch.randn(64, 96)
    tiles = matrix_to_tiles(w).reshape(-1, 256)
    pick = torch.randperm(tiles.shape[0])[:7]
    assert torch.equal(w.reshape(-1)[tile_element_index(96, pick)], tiles[pick])
    full = matrix_to_tiles(w)
    for r, c in ((0, 0), (1, 0), (0, 1), (7, 9), (15, 15), (8, 3)):  # the spec's position formula, element by element
        assert torch.equal(full[:, :, tile_position(r, c)], w[r::16, c::16])


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_encode_under_the_smallest_budget_gives_the_same_bytes():
    k, n, seed = 128, 512, 41  # 256 tiles: chunks of MIN_CHUNK_TILES (the search's chunking: test below)
    w = _weight(k, n, seed)
    budget = _smallest_budget(k, n)
    assert plan_encode_memory(k, n, 6, "cpu", budget).chunk_tiles == MIN_CHUNK_TILES
    seen: list[int] = []
    small = encode_linear(w, bits=6, seed=seed, memory_budget_bytes=budget, progress=seen.append, g_scale=0.83)
    whole = encode_linear(w, bits=6, seed=seed, memory_budget_bytes=1 << 40, g_scale=0.83)
    assert sum(seen) == (k // 16) * (n // 16) and max(seen) <= MIN_CHUNK_TILES
    for name in ("trellis", "suh", "svh"):
        assert torch.equal(getattr(small, name), getattr(whole, name)), name
    assert small.proxy_error == whole.proxy_error and small.g_scale == whole.g_scale
    assert torch.equal(w, _weight(k, n, seed))  # the caller's weight is never written


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_chunked_quantize_regularized_equals_one_pass_over_all_tiles():
    w_r = _weight(64, 384, 7) * 60.0
    states, q_r, proxy = quantize_regularized(w_r, 6, chunk_tiles=37)  # chunks cut tile rows anywhere
    tiles = matrix_to_tiles(w_r).reshape(-1, 256)
    values, ref_states = quantize_tiles(tiles, 6)  # an independent whole-matrix pass
    assert torch.equal(states.reshape(-1, 256), ref_states)
    assert torch.equal(matrix_to_tiles(q_r).reshape(-1, 256), values)
    plain = float((w_r - q_r).square().to(torch.float64).sum()) / w_r.numel()
    assert abs(proxy - plain) <= 1e-12 * plain
    _, _, proxy_whole = quantize_regularized(w_r, 6)
    assert proxy == proxy_whole
    assert torch.equal(pack_trellis(states, 6), pack_trellis(ref_states.reshape(states.shape), 6))


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_scale_mse_does_not_depend_on_the_chunk():
    tiles = torch.randn(50, 256) * torch.empty(50, 1).uniform_(0.5, 2.0)
    assert scale_mse(tiles, [0.7, 1.1], 4, chunk_tiles=13) == scale_mse(tiles, [0.7, 1.1], 4)


def test_a_budget_too_small_fails_naming_the_layer_and_the_bytes_needed():
    w = _weight(128, 256, 3)
    with pytest.raises(EncodeMemoryError) as info:
        encode_linear(w, bits=6, seed=1, name="model.layers.0.mlp.down_proj", memory_budget_bytes=1 << 20)
    text = str(info.value)
    assert text.startswith("model.layers.0.mlp.down_proj: ") and "MiB" in text and "(128, 256)" in text
    assert info.value.needed_bytes > info.value.budget_bytes == 1 << 20
    assert isinstance(info.value, ValueError)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="memory_budget_bytes"):
            plan_encode_memory(128, 256, 6, "cuda", bad)


@pytest.mark.parametrize("shape, bits", [((5120, 6144), 6), ((16384, 7168), 6), ((18432, 7168), 6),
                                         ((7168, 36864), 6), ((4096, 4096), 6), ((1536, 3072), 6), ((256, 7168), 6),
                                         ((128, 4096), 4), ((4096, 12288), 4)])
def test_default_gpu_plan_stays_within_the_reference(shape, bits):
    k, n = shape
    wave = {6: 1188, 4: 528}[bits]  # the kernel's resident tiles on an H200
    plan = plan_encode_memory(k, n, bits, "cuda", wave=wave)
    assert plan.budget_bytes == default_budget(k, n, bits) == reference_peak_bytes(k, n, bits)
    # the reference: 3.5 W per call (or its scale search's sample, where that is larger) and its scratch,
    # 4 x 132 programs of 256 x 2^(16-K) bytes
    per_call = max(int(3.5 * 4 * k * n), 4 * k * n + 15 * 1024 * (sample_tile_count(k, n) // 5))
    assert reference_peak_bytes(k, n, bits) == per_call + 528 * 256 * (1 << (16 - bits))
    assert plan.peak_bytes <= plan.budget_bytes
    tiles = (k // 16) * (n // 16)
    assert MIN_SLOTS <= plan.slots <= plan.chunk_tiles and plan.slots * plan.slot_bytes <= 2 << 30
    if bits in COST_ROW_BITS:  # 256 fp16 cost rows (129 at the K of HALF_ROW_BITS), a row of fp32 values
        rows = 129 if bits in HALF_ROW_BITS else 256
        assert plan.slot_bytes == viterbi_slot_bytes(bits) == rows * 2 * (1 << (16 - bits)) + 1024
    else:  # back-pointers, two fp16 cost rows, a row of fp32 values
        assert plan.slot_bytes == viterbi_slot_bytes(bits) == 256 * (1 << (16 - bits)) // (2 if bits <= 4 else 1) + (
            4 << (16 - bits)) + 1024
    if plan.slots < plan.chunk_tiles < tiles:
        assert plan.chunk_tiles % plan.slots == 0  # whole rounds of slots
    if bits in IN_PLACE_BITS:  # an in-place chunk: 16 tiles per program a launch where the layer has them
        assert plan.chunk_tiles >= min(tiles, 65536 - plan.slots, CHUNK_ROUNDS_IN_PLACE * plan.slots)
    if 4 * k * n >= 100 << 20:  # from a 100 MiB weight on, 2 tiles per SM in flight (where the cost-row kernel
        # already runs as fast as the back-pointer kernel at its best), or that kernel's whole resident wave
        assert plan.slots >= (2 * 132 if bits in COST_ROW_BITS else wave)


def test_plan_peak_never_exceeds_any_budget_it_accepts():
    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        k = 128 * int(torch.randint(1, 160, (1,), generator=gen))
        n = 128 * int(torch.randint(1, 300, (1,), generator=gen))
        budget = int(torch.randint(1, 1 << 36, (1,), generator=gen))
        for device in ("cuda", "cpu"):
            try:
                plan = plan_encode_memory(k, n, 6, device, budget, wave=1584)
            except EncodeMemoryError as exc:
                assert exc.needed_bytes > budget
                continue
            assert plan.peak_bytes <= budget and 1 <= plan.chunk_tiles <= (k // 16) * (n // 16)
            if device == "cuda":
                assert 1 <= plan.slots <= plan.chunk_tiles and plan.slots * plan.slot_bytes <= 2 << 30
                assert plan.peak_bytes >= plan.slots * plan.slot_bytes + plan.chunk_tiles * plan.tile_bytes


@pytest.mark.parametrize("command", [["cache", "warm"], ["encode"]])
def test_gpu_memory_option_reaches_the_request(command, monkeypatch):
    from helpers import CliRunner

    from exl3tool.cli import _register, app

    _register()
    seen = []
    monkeypatch.setattr("exl3tool.operations.warm.warm", lambda request, **kw: seen.append(request.gpu_memory_gib))
    for flag in ([], ["--gpu-memory", "24"], ["--gpu-memory", "7.5"]):
        r = CliRunner().invoke(app, [*command, "test-org/x", "--cache-dir", "/nonexistent", *flag])
        assert r.exit_code == 0, r.output
    assert seen == [None, 24.0, 7.5]


def test_gpu_memory_on_a_cpu_warm_is_a_config_error():
    from exl3tool.errors import ConfigError
    from exl3tool.operations.warm.run import _memory_budget

    assert _memory_budget(torch.device("cpu"), None) is None
    with pytest.raises(ConfigError, match="--gpu-memory 4.0: this warm runs on cpu"):
        _memory_budget(torch.device("cpu"), 4.0)


def test_warm_job_over_its_budget_fails_by_name_with_the_figure(tmp_path, monkeypatch):
    """run_plan with a 1 MiB budget: every job fails, each result naming its layer and the MiB it needed."""
    from exl3tool.checkpoint import write_llama_checkpoint
    from exl3tool.plan import ServerRequest, prepare
    from exl3tool.operations.warm.pipeline import run_plan
    from helpers import ENC

    write_llama_checkpoint(tmp_path / "ckpt", hidden=128, heads=2, kv_heads=1, intermediate=256, layers=1, vocab=256,
                           seed=fresh_seed())
    request = ServerRequest(model=str(tmp_path / "ckpt"), layers=("*.o_proj",), cache_dir=str(tmp_path / "c"),
                          device="cpu", **ENC)
    checkpoint, plan, store = prepare(request)
    results = run_plan(plan, checkpoint, store, device=torch.device("cpu"), memory_budget=1 << 20)
    assert results and all(r.status == "failed" for r in results)
    for r in results:
        assert "o_proj" in r.prefix and "MiB" in r.error and "(128, 128)" in r.error and "budget is 1 MiB" in r.error
    assert not list((tmp_path / "c").rglob("*.safetensors"))


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_cpu_host_peak_of_every_phase_is_within_the_plan():
    """A CPU encode of a 128 MiB weight, measured in a fresh process (``bench_encode_memory.py --phases``): the
    resident peak of every phase stays within the plan's figure for it, and the whole within the plan's peak.

    Every phase and every chunk runs; the numba kernel quantizes 4 tiles of each call and the other rows of its
    result are copies (its memory does not depend on the values: ``benchmarks/host_peak.py``), so this takes
    seconds. Before issue 24's CPU bound the proxy error widened the whole squared error to float64 (3.2 W here,
    the plan's figure for it is 2.2 W).
    """
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo / "benchmarks"))
    from host_peak import can_measure

    if (why := can_measure()) is not None:
        pytest.skip(why)
    k, n = 4096, 8192
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_encode_memory.py"), "--child-phases",
                          f"{k}x{n}", "--real-tiles", "4"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    phases = row["phases"]
    over = {p: f["measured_mib"] for p, f in phases.items() if f["measured_mib"] > f["model_mib"]}
    assert not over, f"phases above the plan's figure (MiB): {over}; {phases}"
    assert row["within_plan"] and row["peak_mib"] <= row["plan_peak_mib"], row
    w = 4 * k * n / 2**20
    # the meter sees the live bytes: regularize holds two matrices at once, later phases W_r and the trellis
    assert phases["regularize"]["measured_mib"] >= 1.95 * w
    trellis = (k // 16) * (n // 16) * 32 * 6 / 2**20
    assert phases["proxy error"]["measured_mib"] >= 0.99 * (w + trellis)
    assert phases["tile quantization"]["measured_mib"] >= 0.99 * (w + trellis)
    assert row["chunks"] >= 2 and row["viterbi"]["tiles"] >= (k // 16) * (n // 16)


def test_speed_rules_can_be_overridden_for_a_benchmark(monkeypatch):
    """EXL3TOOL_COST_ROW_BITS / _HALF_ROW_BITS / _IN_PLACE_BITS / _CHUNK_ROUNDS_IN_PLACE change the plan's slot
    size and chunks (what bench_rules.py runs compare), read at each call (not frozen at import), and nothing when
    unset; a Tuning passed to the call gives the same plan as the variables."""
    import dataclasses
    import os

    from exl3tool.encode import memory as m
    from exl3tool.knobs import DEFAULT_TUNING, read_knobs

    for name in [n for n in os.environ if n.startswith("EXL3TOOL_")]:
        monkeypatch.delenv(name)

    def run(**extra):
        for name in ("EXL3TOOL_COST_ROW_BITS", "EXL3TOOL_IN_PLACE_BITS", "EXL3TOOL_CHUNK_ROUNDS_IN_PLACE",
                     "EXL3TOOL_HALF_ROW_BITS"):
            monkeypatch.delenv(name, raising=False)
        for name, value in extra.items():
            monkeypatch.setenv(name, value)
        t = current_tuning()
        p = m.plan_encode_memory(4096, 12288, 4, "cuda", wave=528)
        assert p == m.plan_encode_memory(4096, 12288, 4, "cuda", wave=528, tuning=read_knobs(extra))
        for name in extra:
            monkeypatch.delenv(name)
        given = m.plan_encode_memory(4096, 12288, 4, "cuda", wave=528, tuning=t)  # the variables unset again
        assert given == p and m.viterbi_slot_bytes(4, tuning=t) == p.slot_bytes
        return (sorted(t.cost_row_bits), sorted(t.half_row_bits), sorted(t.in_place_bits), t.chunk_rounds_in_place,
                p.slot_bytes, p.slots, p.chunk_tiles)

    assert read_knobs({}) == DEFAULT_TUNING
    custom = dataclasses.replace(DEFAULT_TUNING, cost_row_bits=frozenset({6}))
    assert m.viterbi_slot_bytes(4, tuning=custom) == 256 * 4096 // 2 + 4 * 4096 + 1024

    rows, half, in_place, rounds, slot4, slots, chunk = run()
    assert (rows, half, in_place, rounds) == ([4, 6], [4, 6], [6], 16) and slot4 == 129 * 2 * 4096 + 1024
    assert m.viterbi_slot_bytes(4) == slot4  # nothing set: the defaults
    rows, half, in_place, rounds, slot4, slots2, chunk2 = run(EXL3TOOL_COST_ROW_BITS="6", EXL3TOOL_IN_PLACE_BITS="4,6",
                                                              EXL3TOOL_CHUNK_ROUNDS_IN_PLACE="8")
    assert (rows, half, in_place, rounds) == ([6], [4, 6], [4, 6], 8) and slot4 == 256 * 4096 // 2 + 4 * 4096 + 1024
    assert slots2 > slots and chunk2 >= 8 * slots2  # back-pointers: half the bytes a slot; in-place chunks
    rows, half, in_place, rounds, slot4, slots3, chunk3 = run(EXL3TOOL_HALF_ROW_BITS="")
    assert (rows, half) == ([4, 6], []) and slot4 == 256 * 2 * 4096 + 1024 and slots3 < slots  # every row


@pytest.mark.parametrize("results", ["bench_dropin_vs_reference_h200_2026-12-03.json",
                                     "bench_dropin_vs_reference_h200_2026-12-02.json",
                                     "bench_encode_memory_vs_reference_h200_2026-12-03.json"])
def test_reference_model_stays_under_the_measured_reference(results):
    """The default budget's per-call figure never exceeds what exllamav3 1.6.5 was measured to take above the weight
    on an H200 (benchmarks/results), on every deployed shape and issue 24's; and where the scale search's sample is
    large beside the weight ((128, 4096): 7.1 W measured) it is above 3.5 W, within 5 % of the measurement."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / results
    data = json.loads(path.read_text())
    rows = data.get("layers") or data["rows"]
    assert len(rows) >= 4
    for row in rows:
        measured = row["reference_peak_bytes"] if "reference_peak_bytes" in row else row["ref_peak_mib"] * 2**20
        model = reference_call_bytes(row["k"], row["n"])
        assert model <= measured, (row["k"], row["n"], model, measured)
        if (row["k"], row["n"]) in ((128, 4096), (4096, 128), (256, 7168)):
            assert 3.5 * 4 * row["k"] * row["n"] < model and measured < 1.06 * model


def test_small_layers_quantize_in_place_at_every_k(monkeypatch):
    """With IN_PLACE_MAX_TILES set, a layer of at most that many tiles is one launch over the weight at any K
    (1 KiB a tile of a chunk, not the 8 KiB of a gathered one); a larger one only at the K of IN_PLACE_BITS. 4,096
    tiles by default, 0 turns it off."""
    from exl3tool.encode import memory

    monkeypatch.delenv("EXL3TOOL_IN_PLACE_MAX_TILES", raising=False)
    assert current_tuning().in_place_max_tiles == 4096 and memory.quantizes_in_place(4, 2048)
    monkeypatch.setenv("EXL3TOOL_IN_PLACE_MAX_TILES", "0")  # read at the call
    assert not memory.quantizes_in_place(4, 2048)
    assert memory.plan_encode_memory(128, 4096, 4, "cuda", wave=528).tile_bytes == 8 * 1024
    monkeypatch.setenv("EXL3TOOL_IN_PLACE_MAX_TILES", "4096")
    for bits in (2, 3, 4, 5, 6, 7, 8):
        assert memory.quantizes_in_place(bits, 4096)
        assert memory.quantizes_in_place(bits, 4097) == (bits in IN_PLACE_BITS)
    small = memory.plan_encode_memory(128, 4096, 4, "cuda", wave=528)  # 2,048 tiles
    large = memory.plan_encode_memory(4096, 12288, 4, "cuda", wave=528)
    assert small.tile_bytes == 1024 and small.chunk_tiles == 2048  # states and error in place: the whole layer
    assert large.tile_bytes == 8 * 1024 and 4 not in IN_PLACE_BITS


@pytest.mark.parametrize("k, n, bits", [(512, 4096, 6), (1536, 3072, 6), (6144, 4096, 4), (128, 4096, 4)])
def test_plan_keeps_every_other_row_only_where_every_row_leaves_few_programs(k, n, bits):
    """Given both cost-row strides, a plan keeps every row unless that leaves fewer than HALF_ROWS_BELOW_PER_SM
    slots per SM: at the reference's budget (tight for these layers) every other row, with more slots than every row
    would get; at a whole GPU's budget every row; at the least budget that holds a plan, every other row. Every plan
    fits its budget and says which rows its slots were sized for."""
    from exl3tool.encode.memory import viterbi_slot_bytes

    HALF_ROWS_BELOW_PER_SM = current_tuning().half_rows_below_per_sm

    sms = 132
    choices = {r: viterbi_slot_bytes(bits, True, rows=r) + 1024 for r in (1, 2)}
    every = plan_encode_memory(k, n, bits, "cuda", sms=sms, slot_bytes=choices[1])
    assert every.slots < HALF_ROWS_BELOW_PER_SM * sms  # the reference's budget is tight here
    tight = plan_encode_memory(k, n, bits, "cuda", sms=sms, rows_slot_bytes=choices)
    assert tight.rows == 2 and tight.slot_bytes == choices[2] and tight.slots > every.slots
    assert tight.peak_bytes <= tight.budget_bytes
    roomy = plan_encode_memory(k, n, bits, "cuda", 40 << 30, sms=sms, rows_slot_bytes=choices)
    assert roomy.rows == 1 and roomy.slot_bytes == choices[1] and roomy.slots >= HALF_ROWS_BELOW_PER_SM * sms
    assert roomy.peak_bytes <= roomy.budget_bytes
    # the least budget, in steps of a quarter half-row slot, that holds every other row (where the slots decide it,
    # not every row)
    budget = every.fixed_bytes
    while True:
        try:
            plan_encode_memory(k, n, bits, "cuda", budget, sms=sms, slot_bytes=choices[2])
        except EncodeMemoryError:
            budget += choices[2] // 4
            continue
        break
    plan = plan_encode_memory(k, n, bits, "cuda", budget, sms=sms, rows_slot_bytes=choices)
    assert plan.rows == 2 and plan.peak_bytes <= budget
    only = plan_encode_memory(k, n, bits, "cuda", sms=sms, rows_slot_bytes={1: choices[1]})
    assert only.rows == 1 and only.slots == every.slots
