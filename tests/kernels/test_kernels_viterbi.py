"""Tests for the Triton Viterbi tile quantizer (exl3tool.kernels.viterbi).

Interpreter tests run the kernel on CPU in a subprocess with TRITON_INTERPRET=1 set before triton is
imported (so the kernels of this pytest process, and other tests that import triton, are untouched).
GPU tests (marker ``gpu``) check every golden tile of every configuration, fresh random tiles against
an independent numpy reference, and a batch that crosses chunk boundaries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from exl3tool.format.codebook import codebook_table_np  # noqa: E402
from exl3tool.kernels import viterbi as vmod  # noqa: E402
from seeds import fresh_seed

REPO = Path(__file__).resolve().parents[2]
CONFIGS = [(2, "mcg"), (3, "mcg"), (4, "mcg"), (5, "mcg"), (6, "mcg"), (7, "mcg"), (8, "mcg"),
           (6, "3inst"), (6, "mul1")]


# ----------------------------------------------------------------------------------------------------
# Independent numpy reference (docs/format.md §6), written with numpy's direct float64 -> float16 cast.
# ----------------------------------------------------------------------------------------------------

def _brev5(x: np.ndarray) -> np.ndarray:
    return ((x & 1) << 4) | ((x & 2) << 2) | (x & 4) | ((x & 8) >> 2) | ((x & 16) >> 4)


def reference_tile(x: np.ndarray, bits: int, codebook: str) -> np.ndarray:
    """States (uint16-valued int64, 256) of one tile by the spec's two-pass tail-biting Viterbi."""
    nl, e_n = 1 << bits, 1 << (16 - bits)
    nh = 1 << (16 - 2 * bits)
    dec = codebook_table_np(codebook).astype(np.float64).reshape(nl, e_n)  # dec[k, e], s = k*E + e
    w = x.astype(np.float32).astype(np.float16).astype(np.float64)
    e_idx = np.arange(e_n)
    pred = np.arange(nl)[:, None] * nh + (e_idx[None, :] >> bits)  # (nl, E)

    def forward(order, fix):
        bp = np.zeros((256, e_n), dtype=np.int64)
        cost = None
        for t, p in enumerate(order):
            d = (dec - w[p]).astype(np.float16).astype(np.float64)
            if t == 0:
                c = (d * d).astype(np.float16)
                if fix is not None:
                    c[pred != fix] = np.inf
            else:
                c = (d * d + cost[pred].astype(np.float64)).astype(np.float16)  # one rounding
            k = np.argmin(c, axis=0)  # first minimum = strict less-than scan in increasing k
            cost = c[k, e_idx]
            bp[p] = k
        return cost, bp

    cost, bp1 = forward(list(range(128, 256)) + list(range(128)), None)
    bits16 = cost.view(np.uint16).astype(np.int64)
    rank = (_brev5((e_idx >> 5) & 31) << 10) | (_brev5(e_idx & 31) << 5) | (e_idx >> 10)
    key = (bits16 << 16) | rank
    e = int(np.argmin(key)) if bits16.min() < 0x7C00 else 0
    for p in range(127, -1, -1):
        e = int(bp1[p, e] * nh + (e >> bits))
    e_fix = e
    _, bp2 = forward(list(range(256)), e_fix)
    states = np.zeros(256, dtype=np.int64)
    e = e_fix
    for p in range(255, -1, -1):
        k = int(bp2[p, e])
        states[p] = (k << (16 - bits)) | e
        e = k * nh + (e >> bits)
    return states


def _load_golden(golden: Path, bits: int, codebook: str):
    from safetensors.torch import load_file

    g = load_file(str(golden / "tiles_golden.safetensors"))
    tag = f"k{bits}_{codebook}"
    return g[f"{tag}.input"], g[f"{tag}.indices"], g[f"{tag}.output"]


# ----------------------------------------------------------------------------------------------------
# Input validation (runs anywhere)
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "tiles, bits, codebook",
    [
        (torch.zeros(2, 255), 6, "mcg"),
        (torch.zeros(2, 256, 1), 6, "mcg"),
        (torch.zeros(2, 256, dtype=torch.float16), 6, "mcg"),
        (torch.zeros(2, 256, dtype=torch.float64), 6, "mcg"),
        (torch.zeros(2, 256), 0, "mcg"),
        (torch.zeros(2, 256), 9, "mcg"),
        (torch.zeros(2, 256), 6.0, "mcg"),
        (torch.zeros(2, 256), True, "mcg"),
        (torch.zeros(2, 256), 6, "nope"),
        (np.zeros((2, 256), dtype=np.float32), 6, "mcg"),
    ],
)
def test_bad_input_raises(tiles, bits, codebook):
    with pytest.raises(ValueError):
        vmod.viterbi_tiles(tiles, bits, codebook)


def test_cpu_tensor_without_interpreter_raises():
    if vmod.interpreter_active():
        pytest.skip("TRITON_INTERPRET=1 was set when the module was imported")
    with pytest.raises(ValueError, match="CUDA"):
        vmod.viterbi_tiles(torch.randn(3, 256), 6, "mcg")


def test_reference_matches_golden_sample(golden):
    """The numpy reference used by the GPU tests is itself right (one golden tile, K=6 mcg)."""
    x, idx, _ = _load_golden(golden, 6, "mcg")
    row = int(np.random.default_rng(fresh_seed()).integers(0, x.shape[0]))
    states = reference_tile(x[row].numpy(), 6, "mcg")
    assert np.array_equal(states, idx[row].numpy().view(np.uint16).astype(np.int64)), row


# ----------------------------------------------------------------------------------------------------
# Interpreter tests: the Triton kernel on CPU (subprocess, TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------------------

_INTERP_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from safetensors.torch import load_file
    from exl3tool.kernels.viterbi import viterbi_tiles, interpreter_active
    jobs, golden = json.loads(sys.argv[1]), sys.argv[2]
    g = load_file(os.path.join(golden, "tiles_golden.safetensors"))
    out = []
    for job in jobs:
        if "rows" in job:
            x = g[f"k{job['bits']}_{job['cb']}.input"][job["rows"]]
        else:
            x = torch.tensor(job["tiles"], dtype=torch.float32)
        t0 = time.time()
        vals, states = viterbi_tiles(x, job["bits"], job["cb"], mode=job["mode"])
        out.append({"interp": interpreter_active(), "seconds": time.time() - t0,
                    "states": states.tolist(), "values": vals.tolist(),
                    "dtypes": [str(vals.dtype), str(states.dtype)]})
    print(json.dumps(out))
    """
)


def _interp_jobs(golden: Path) -> list[list[dict]]:
    """Two processes (2 cores): a random golden row at K=6, a fresh tile in the packed layout at K=4."""
    from safetensors import safe_open

    rng = np.random.default_rng(fresh_seed())
    fresh = (rng.standard_normal((1, 256)) * rng.uniform(0.5, 1.5)).astype(np.float32)
    with safe_open(str(golden / "tiles_golden.safetensors"), "pt") as f:
        meta = f.metadata()
    n_gauss, n_real = int(meta["k6_mcg.n_gauss"]), int(meta["k6_mcg.n_real"])
    return [
        # K=6 mcg, plain path: one golden tile, a Gaussian or a real-weight one (the n_real rows after the n_gauss
        # Gaussian ones), drawn at random (one tile is half a minute under the interpreter; test_viterbi.py checks
        # every golden tile with numba)
        [{"bits": 6, "cb": "mcg", "mode": 0,
          "rows": [int(rng.integers(0, n_gauss)) if rng.random() < 0.5 else int(rng.integers(n_gauss, n_gauss + n_real))]}],
        # the packed-pair layout (mode 5) on a fresh tile at K=4, where the back-pointers are kept two per byte
        # (the K=4 golden tiles: numba in test_viterbi.py, the kernel itself in the GPU tests; under the
        # interpreter a K=4 tile costs more than the K=6 one, and the plain path is the K=6 case's)
        [{"bits": 4, "cb": "mcg", "mode": 5, "tiles": fresh.tolist()}],
    ]


@pytest.fixture(scope="module")
def interp_results(golden):
    """Run the interpreter jobs concurrently (one process per list) and collect (job, result) pairs."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    for jobs in _interp_jobs(golden):
        args = [sys.executable, "-c", _INTERP_SCRIPT, json.dumps(jobs), str(golden)]
        procs.append((jobs, subprocess.Popen(args, env=env, cwd=str(REPO), stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True)))
    pairs = []
    for jobs, proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-4000:]
        pairs += list(zip(jobs, json.loads(stdout.strip().splitlines()[-1])))
    return pairs


def _find(pairs, bits, mode):
    return next((job, res) for job, res in pairs if job["bits"] == bits and job["mode"] == mode)


@pytest.mark.slow
def test_interpreter_matches_golden(interp_results, golden):
    job, res = _find(interp_results, 6, 0)
    assert res["interp"], "subprocess did not run under the Triton interpreter"
    assert res["dtypes"] == ["torch.float32", "torch.int16"]
    _, idx, out = _load_golden(golden, 6, job["cb"])
    assert torch.equal(torch.tensor(res["states"], dtype=torch.int16), idx[job["rows"]]), job["rows"]
    assert torch.equal(torch.tensor(res["values"], dtype=torch.float32), out[job["rows"]]), job["rows"]


@pytest.mark.slow
def test_interpreter_packed_layout_matches_reference(interp_results):
    """Mode 5 (the packed-pair indexing of the GPU default, exact arithmetic) on a fresh tile, K=4: the
    back-pointers two per byte (nibbles), read back by both tracebacks."""
    job, res = _find(interp_results, 4, 5)
    assert res["interp"]
    x = np.asarray(job["tiles"], dtype=np.float32)
    ref = reference_tile(x[0], 4, "mcg")
    got = np.asarray(res["states"], dtype=np.int64)[0] & 0xFFFF
    assert np.array_equal(got, ref)
    table = codebook_table_np("mcg").astype(np.float32)
    assert np.array_equal(np.asarray(res["values"], dtype=np.float32)[0], table[ref])


# ----------------------------------------------------------------------------------------------------
# GPU tests
# ----------------------------------------------------------------------------------------------------

def _gpu_ready():
    if vmod.interpreter_active():
        pytest.skip("module imported under the interpreter")


@pytest.mark.gpu
@pytest.mark.parametrize("bits, codebook", CONFIGS)
def test_gpu_every_golden_tile(golden, bits, codebook):
    _gpu_ready()
    x, idx, out = _load_golden(golden, bits, codebook)
    vals, states = vmod.viterbi_tiles(x.cuda(), bits, codebook)
    torch.cuda.synchronize()
    bad = (states.cpu() != idx).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"{len(bad)} tiles differ, first {bad[:8]}"
    assert torch.equal(vals.cpu(), out)


@pytest.mark.gpu
@pytest.mark.parametrize("bits, codebook", [(6, "mcg"), (1, "mcg"), (3, "mul1"), (7, "3inst"), (5, "mul1")])
def test_gpu_random_vs_reference(bits, codebook):
    _gpu_ready()
    gen = torch.Generator().manual_seed(fresh_seed(32))
    scale = float(torch.empty(1).uniform_(0.3, 2.0, generator=gen))
    x = torch.randn(3, 256, generator=gen) * scale
    vals, states = vmod.viterbi_tiles(x.cuda(), bits, codebook)
    table = torch.from_numpy(codebook_table_np(codebook).astype(np.float32))
    for row in range(x.shape[0]):
        ref = reference_tile(x[row].numpy(), bits, codebook)
        got = states[row].cpu().numpy().view(np.uint16).astype(np.int64)
        assert np.array_equal(got, ref), (bits, codebook, row, scale)
    assert torch.equal(vals.cpu(), table[states.cpu().long() & 0xFFFF])


@pytest.mark.gpu
def test_gpu_chunks_and_variants_agree():
    """A batch split into uneven chunks, and every kernel variant, give the same states."""
    _gpu_ready()
    x = torch.randn(1000, 256, device="cuda") * 1.2
    vals, states = vmod.viterbi_tiles(x, 6, "mcg")
    # 300 slots: every program quantizes 3 or 4 tiles in its one slot (scratch_bytes, or programs=)
    v2, s2 = vmod.viterbi_tiles(x, 6, "mcg", scratch_bytes=300 * vmod.slot_bytes(6))
    assert torch.equal(states, s2) and torch.equal(vals, v2)
    for bits in (4, 6):  # a prime number of programs, one program, and more programs than tiles
        ref_v, ref_s = vmod.viterbi_tiles(x[:300], bits, "mcg")
        for programs, count in ((7, 300), (1, 23), (1000, 300)):
            v3, s3 = vmod.viterbi_tiles(x[:count], bits, "mcg", programs=programs)
            assert torch.equal(ref_s[:count], s3) and torch.equal(ref_v[:count], v3), (bits, programs)
    for row in np.random.default_rng(fresh_seed()).choice(1000, size=2, replace=False):
        ref = reference_tile(x[int(row)].cpu().numpy(), 6, "mcg")
        assert np.array_equal(states[int(row)].cpu().numpy().view(np.uint16).astype(np.int64), ref)
    sub = x[:64]
    for mode in (1, 4):  # the GPU modes (2 and 3 are retired)
        _, s3 = vmod.viterbi_tiles(sub, 6, "mcg", mode=mode)
        assert torch.equal(s3, states[:64]), mode


@pytest.mark.gpu
@pytest.mark.parametrize("bits, rows", [(b, 1) for b in range(1, 9)] + [(b, 2) for b in range(1, 7)])
def test_gpu_cost_rows_equal_back_pointers(bits, rows):
    """Keeping every step's cost row (``rows`` 1) or every other (2) and recomputing the choice in the traceback
    gives the back-pointer kernel's states and values bit for bit, for gathered tiles and in place over a
    weight, at every K, at 1 and several programs and 1, 2 and 4 tiles per program (tile lanes, a last group
    part-filled) (tiles of several scales: ties and saturated costs)."""
    _gpu_ready()
    x = torch.randn(200, 256, device="cuda") * torch.logspace(-2, 1.5, 200, device="cuda")[:, None]
    ref_v, ref_s = vmod.viterbi_tiles(x, bits, "mcg", rows=False)
    # the traceback's codebook reads (edge-major table or state-major) and tiles per program (f16x2 lanes; 37 slots
    # with 4 lanes: 9 programs, 50 groups of 4)
    for edge_major, lanes in ((True, 1), (False, 1), (True, 2), (True, 4), (False, 4)):
        for programs in (None, 1, 37):
            v, s = vmod.viterbi_tiles(x if programs != 1 else x[:9], bits, "mcg", rows=rows, programs=programs,
                                      edge_major=edge_major, lanes=lanes)
            count = v.shape[0]
            assert torch.equal(s, ref_s[:count]) and torch.equal(v, ref_v[:count]), (bits, programs, edge_major, lanes)
    w = torch.randn(64, 96, device="cuda") * 1.5
    tiles = (64 // 16) * (96 // 16)
    plain = w.clone()
    s_bp = vmod.viterbi_matrix(plain, 0, tiles, bits, rows=False, programs=5)
    for edge_major, lanes in ((True, 1), (False, 1), (True, 4)):
        inplace = w.clone()  # 24 tiles on 5 slots: lanes 4 gives one program of 4 (6 groups)
        s_rows = vmod.viterbi_matrix(inplace, 0, tiles, bits, rows=rows, programs=5, edge_major=edge_major,
                                     lanes=lanes)
        assert torch.equal(s_bp, s_rows) and torch.equal(plain, inplace), (bits, rows, edge_major, lanes)


@pytest.mark.gpu
def test_gpu_selfcheck_kept_default_mode():
    """The packed default mode agreed with the plain mode for every bit width used (no fallback)."""
    _gpu_ready()
    for bits in (1, 6, 8):
        vmod.viterbi_tiles(torch.randn(4, 256, device="cuda"), bits, "mcg")
    res = vmod.selfcheck_results()
    from exl3tool.knobs import current_tuning

    assert res and all(m == current_tuning().viterbi_mode for m in res.values()), res


@pytest.mark.gpu
def test_gpu_empty_batch():
    _gpu_ready()
    vals, states = vmod.viterbi_tiles(torch.empty(0, 256, device="cuda"), 6, "mcg")
    assert vals.shape == (0, 256) and states.dtype == torch.int16


_MATRIX_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from exl3tool.format.layout import tile_element_index
    from exl3tool.kernels.viterbi import viterbi_matrix, viterbi_tiles
    torch.manual_seed({seed})
    w = torch.randn(32, 48) * torch.empty(1, 48).uniform_(0.5, 2.0)  # 2 x 3 tiles
    first, count = 2, 2  # the last tile of row 0 and the first of row 1
    index = tile_element_index(48, torch.arange(first, first + count))
    tiles = w.reshape(-1)[index]
    values, states = viterbi_tiles(tiles, 6, mode=0)
    inplace = w.clone()
    got = viterbi_matrix(inplace, first, count, 6, mode=0, programs=1)  # one slot: its values row is reused
    expected = w.clone()
    expected.reshape(-1)[index] = (tiles - values).square()
    assert torch.equal(got, states), "states"
    assert torch.equal(inplace, expected), "squared errors in place, other tiles untouched"
    print("ok")
    """
)


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_interpreter_matrix_launch_equals_gathered_tiles():
    """viterbi_matrix reads tiles where they lie and writes their squared error over them: the same states as
    viterbi_tiles on the gathered tiles, and (x - q)^2 with q those tiles' values (fresh weight, K=6)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    seed = fresh_seed()
    proc = subprocess.run([sys.executable, "-c", _MATRIX_SCRIPT.format(seed=seed)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (seed, proc.stderr[-3000:])


_ROWS_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from exl3tool.format.layout import tile_element_index
    from exl3tool.kernels.viterbi import viterbi_matrix, viterbi_tiles
    torch.manual_seed(int(sys.argv[1]))
    rows, bits, launch, lanes = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    if launch == "tiles":
        x = torch.randn(lanes, 256) * torch.empty(lanes, 1).uniform_(0.5, 2.0)
        _, states = viterbi_tiles(x, bits, mode=5, rows=rows, lanes=lanes, programs=lanes)
        print(json.dumps({"x": x.tolist(), "states": states.tolist()}))
    else:
        w = torch.randn(16, 32) * 1.3  # two tiles; the second quantized in place
        index = tile_element_index(32, torch.tensor([1]))
        tile = w.reshape(-1)[index].clone()
        m_states = viterbi_matrix(w, 1, 1, bits, mode=5, rows=rows, programs=1)
        print(json.dumps({"tile": tile.tolist(), "m_states": m_states.tolist(), "m_error": w.reshape(-1)[index].tolist()}))
    """
)


@pytest.mark.slow
def test_interpreter_cost_rows_match_reference():
    """The cost-row kernel (the traceback recomputes each choice from the costs kept: every step's row, or every
    other with the odd rows' entries recomputed from the even ones) in its packed-pair layout with exact
    arithmetic (mode 5): a fresh tile at K=3 (``viterbi_tiles``), or two at K=2 in the two f16x2 lanes of one
    program (``lanes`` 2), gives the independent numpy Viterbi's states, and a tile quantized in place over a weight
    at K=2 (``viterbi_matrix``) gives them and writes (x - q)^2.

    Which rows are kept (1: every row, 2: every other), which launch runs and, for tiles, the lanes are drawn from
    the test seed: 20 s of interpreter each, so a run checks one of the six and the seed in the message says which
    (the GPU tests check every one on every run)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    seed = fresh_seed()
    rows, launch = 1 + seed % 2, ("tiles", "matrix")[(seed // 2) % 2]
    lanes = 1 + (seed // 4) % 2 if launch == "tiles" else 1
    bits = 3 if launch == "tiles" and lanes == 1 else 2
    proc = subprocess.run([sys.executable, "-c", _ROWS_SCRIPT, str(seed), str(rows), str(bits), launch, str(lanes)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (seed, rows, launch, lanes, proc.stderr[-3000:])
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if launch == "tiles":
        for i, x in enumerate(np.asarray(res["x"], dtype=np.float32)):
            got = np.asarray(res["states"], dtype=np.int64)[i] & 0xFFFF
            assert np.array_equal(got, reference_tile(x, bits, "mcg")), (seed, rows, launch, lanes, i)
        return
    tile = np.asarray(res["tile"], dtype=np.float32)[0]
    ref = reference_tile(tile, bits, "mcg")
    assert np.array_equal(np.asarray(res["m_states"], dtype=np.int64)[0] & 0xFFFF, ref), (seed, rows, launch)
    q = codebook_table_np("mcg").astype(np.float32)[ref]
    assert np.array_equal(np.asarray(res["m_error"], dtype=np.float32)[0], (tile - q) ** 2), (seed, rows, launch)


_BLOCK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton
    import triton.language as tl
    from exl3tool.kernels.viterbi import _even_row_block

    @triton.jit
    def probe(row_ptr, out_ptr, ed, K: tl.constexpr, NL: tl.constexpr, NH: tl.constexpr, WHOLE: tl.constexpr):
        j = tl.arange(0, NL) * NH + (ed >> K)  # as _traced_k: the odd-row entries edge ed's candidates read
        block = _even_row_block(row_ptr, j, K, NL, NH, WHOLE)
        tl.store(out_ptr + tl.arange(0, NL)[:, None] * NL + tl.arange(0, NL)[None, :], block)

    torch.manual_seed(int(sys.argv[1]))
    out = []
    for K in (6, 7):
        NL, NH = 1 << K, 1 << (16 - 2 * K)
        row = (torch.randn(NL * NH) * 100).to(torch.float16)
        for ed in torch.randint(0, NL * NH, (3,)).tolist():
            got = {}
            for whole in (True, False):
                block = torch.empty((NL, NL), dtype=torch.float16)
                probe[(1,)](row, block, ed, K, NL, NH, whole)
                got[whole] = block.float().tolist()
            out.append({"K": K, "ed": ed, "row": row.float().tolist(), "whole": got[True], "scattered": got[False]})
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_interpreter_even_row_block_whole_row_equals_scattered(tmp_path):
    """At K >= 6 the traceback reads an odd row's (NL, NL) block of the even row before it as the whole row,
    transposed and each column repeated (one contiguous load): the same block as NL x NL scattered loads, and
    [i, k] = row[k * NH + (j[i] >> K)] (numpy), for random edges at K = 6 and 7 under the interpreter."""
    script = tmp_path / "block_probe.py"  # triton.jit needs the probe's source in a file
    script.write_text(_BLOCK_SCRIPT)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    seed = fresh_seed()
    proc = subprocess.run([sys.executable, str(script), str(seed)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (seed, proc.stderr[-3000:])
    for case in json.loads(proc.stdout.strip().splitlines()[-1]):
        K, ed = case["K"], case["ed"]
        nl, nh = 1 << K, 1 << (16 - 2 * K)
        row = np.asarray(case["row"], dtype=np.float32)
        j = np.arange(nl) * nh + (ed >> K)
        expected = row[np.arange(nl)[None, :] * nh + (j[:, None] >> K)]
        assert np.array_equal(np.asarray(case["scattered"], dtype=np.float32), expected), (seed, K, ed)
        assert np.array_equal(np.asarray(case["whole"], dtype=np.float32), expected), (seed, K, ed)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 6])
def test_gpu_launch_capped_at_the_resident_wave_gives_the_same_states(bits):
    """More programs than the GPU keeps resident run in whole waves (the compiled variant's occupancy, read
    without a launch): the wave is whole SMs, and a launch asking more gives the states of one program."""
    _gpu_ready()
    x = torch.randn(700, 256, device="cuda") * torch.empty(700, 1, device="cuda").uniform_(0.2, 3.0)
    _, one = vmod.viterbi_tiles(x[:40], bits, "mcg", programs=1)
    _, many = vmod.viterbi_tiles(x, bits, "mcg", programs=3000)  # every tile a program: capped
    assert torch.equal(many[:40], one)
    waves = [w for (dev, meta), w in vmod._WAVES.items() if dict(meta)["K"] == bits]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert waves and all(w is not None and w >= sms and w % sms == 0 for w in waves), waves
