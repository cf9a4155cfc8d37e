"""Tile quantizer (docs/format.md §6): goldens, numba vs the independent torch reference, ring, NaN, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from exl3tool.format.codebook import codebook_table_np
from exl3tool.encode.viterbi import quantize_tiles, quantize_tiles_torch

CONFIGS = ["k2_mcg", "k3_mcg", "k4_mcg", "k5_mcg", "k6_mcg", "k7_mcg", "k8_mcg", "k6_3inst", "k6_mul1"]


@pytest.fixture(scope="module", autouse=True)
def _torch_single_thread():
    """The torch reference does many small ops; on a busy 2-core box torch's spinning thread pool next to
    numba's workers made it 10x slower, one thread is the fastest."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiles_golden(golden):
    return load_file(str(golden / "tiles_golden.safetensors"))


def _u16(states: torch.Tensor | np.ndarray) -> np.ndarray:
    a = states.numpy() if isinstance(states, torch.Tensor) else states
    return a.view(np.uint16).astype(np.int64)


def _match_report(got: np.ndarray, want: np.ndarray) -> str:
    tiles = (got == want).all(axis=1)
    return f"tiles matching {tiles.mean():.4f} ({tiles.sum()}/{len(tiles)}), states matching {(got == want).mean():.6f}"


@pytest.mark.parametrize("cfg", CONFIGS)
def test_golden_every_tile(tiles_golden, cfg):
    K, cb = int(cfg[1]), cfg.split("_")[1]
    x = torch.from_numpy(tiles_golden[f"{cfg}.input"])
    values, states = quantize_tiles(x, K, cb)
    assert states.dtype == torch.int16 and values.dtype == torch.float32
    got, want = _u16(states), _u16(tiles_golden[f"{cfg}.indices"])
    assert np.array_equal(got, want), f"{cfg}: {_match_report(got, want)}"
    out = tiles_golden[f"{cfg}.output"]
    assert np.array_equal(values.numpy().view(np.uint32), out.view(np.uint32)), f"{cfg}: values differ"


def _fresh_tiles(seed: int) -> torch.Tensor:
    """Gaussian tiles at scales 0.3, 1 and 3, one with a few large values so the costs grow a lot."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(4, 256, generator=g)
    t[0] *= 0.3
    t[2] *= 3.0
    big = torch.randint(0, 256, (4,), generator=g)
    t[3, big] = torch.tensor([40.0, -75.0, 120.0, -9.5])
    return t


@pytest.mark.parametrize(
    "K,cb,rows", [(8, "mcg", [0, 2, 3]), (5, "mul1", [3]), (3, "3inst", [1]), (1, "mcg", [2]), (6, "mcg", [0])]
)
@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_numba_matches_torch_reference(K, cb, rows):
    x = _fresh_tiles(1000 + K)[rows]  # the torch path is slow on CPU: a few tiles only
    v_n, s_n = quantize_tiles(x, K, cb, backend="numba")
    v_t, s_t = quantize_tiles_torch(x, K, cb)
    got, want = _u16(s_n), _u16(s_t)
    assert np.array_equal(got, want), _match_report(got, want)
    assert torch.equal(v_n, v_t)


def test_overflowing_costs_match_reference():
    """An element of ~300 drives fp16 costs to +inf (section 6.7); ties among inf go to k = 0."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 256, generator=g)
    x[0, 40] = 300.0
    s_n = quantize_tiles(x, 8, backend="numba")[1]
    s_t = quantize_tiles_torch(x, 8)[1]
    assert np.array_equal(_u16(s_n), _u16(s_t)), _match_report(_u16(s_n), _u16(s_t))


@pytest.mark.parametrize("K", [3, 6])
def test_ring_closes_and_values_decode(K):
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(K)) * 1.1
    values, states = quantize_tiles(x, K)
    s = _u16(states)
    prev = np.roll(s, 1, axis=1)  # prev[:, i] = s[:, i - 1], and prev[:, 0] = s[:, 255]
    v = s & ((1 << K) - 1)
    assert np.array_equal(s, ((prev << K) | v) & 0xFFFF)
    table = codebook_table_np("mcg")
    assert np.array_equal(values.numpy(), table[s].astype(np.float32))
    # a real search, not a constant: the error is near the golden MSE scale for this K
    assert float(((values - x) ** 2).mean()) < 0.05


def test_deterministic_and_batch_independent():
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    a = quantize_tiles(x, 6)[1]
    b = quantize_tiles(x, 6)[1]
    c = torch.cat([quantize_tiles(x[i:i + 1], 6)[1] for i in range(5)])
    assert torch.equal(a, b) and torch.equal(a, c)


def test_nan_tiles():
    """Section 6.7: an all-NaN tile keeps k = 0 everywhere and e* = 0, so every state is 0.
    A single NaN is compared with the torch reference (strict less-than scan semantics)."""
    x = torch.full((1, 256), float("nan"))
    values, states = quantize_tiles(x, 6)
    assert (states == 0).all()
    assert (values == float(codebook_table_np("mcg")[0])).all()
    y = torch.randn(1, 256, generator=torch.Generator().manual_seed(11))
    y[0, 200] = float("nan")  # pass 1 reaches it early (its order starts at 128), pass 2 late
    s_n = quantize_tiles(y, 8)[1]
    s_t = quantize_tiles_torch(y, 8)[1]
    assert np.array_equal(_u16(s_n), _u16(s_t)), _match_report(_u16(s_n), _u16(s_t))


def test_dtypes_and_empty():
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(5))
    ref = quantize_tiles(x, 4)[1]
    assert torch.equal(quantize_tiles(x.to(torch.float64), 4)[1], ref)
    assert torch.equal(quantize_tiles(x.half(), 4)[1], quantize_tiles(x.half().float(), 4)[1])
    v, s = quantize_tiles(torch.empty(0, 256), 6)
    assert v.shape == (0, 256) and s.shape == (0, 256) and s.dtype == torch.int16


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.zeros(3, 255), 6), r"shape \(n, 256\).*\(3, 255\)"),
        ((torch.zeros(256), 6), r"\(256,\)"),
        ((torch.zeros(2, 256, dtype=torch.int32), 6), "floating-point dtype.*int32"),
        ((torch.zeros(2, 256), 0), "bits.*0"),
        ((torch.zeros(2, 256), 9), "bits.*9"),
        (([1.0] * 256, 6), "torch.Tensor"),
    ],
)
def test_validation(args, match):
    with pytest.raises(ValueError, match=match):
        quantize_tiles(*args)


def test_validation_codebook_and_backend():
    x = torch.randn(1, 256)
    with pytest.raises(ValueError, match="unknown codebook 'foo'"):
        quantize_tiles(x, 6, "foo")
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        quantize_tiles(x, 6, backend="cuda")


def test_triton_backend_falls_back_with_warning(monkeypatch):
    """Without the Triton kernel module the torch path runs (spied on here: it is slow) and says so."""
    import builtins

    import exl3tool.encode.viterbi as vit

    real_import = builtins.__import__

    def no_kernel(name, *a, **kw):
        if name == "exl3tool.kernels.viterbi":
            raise ImportError("simulated: no Triton")
        return real_import(name, *a, **kw)

    calls = []
    monkeypatch.setattr(builtins, "__import__", no_kernel)
    monkeypatch.setattr(vit, "quantize_tiles_torch", lambda t, b, cb: calls.append((t.shape, b, cb)) or ("torch", "ran"))
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2))
    with pytest.warns(RuntimeWarning, match="Triton Viterbi kernel unavailable"):
        assert quantize_tiles(x, 8, "mul1", backend="triton") == ("torch", "ran")
    assert calls == [((1, 256), 8, "mul1")]


@pytest.mark.parametrize("cfg", ["k4_mcg", "k6_mul1"])
def test_generic_kernel_matches_golden(tiles_golden, cfg):
    """The literal kernel NaN tiles go through, on finite golden tiles (one Gaussian, one real)."""
    from exl3tool.kernels.viterbi_numba import quantize_tiles_numba

    K, cb = int(cfg[1]), cfg.split("_")[1]
    x = tiles_golden[f"{cfg}.input"][[0, -1]]
    got = quantize_tiles_numba(x, K, codebook_table_np(cb), force_generic=True)
    want = _u16(tiles_golden[f"{cfg}.indices"][[0, -1]])
    assert np.array_equal(got, want), _match_report(got, want)
