"""EXL3 tile quantizer: the tail-biting Viterbi search of docs/format.md §6, bit-exact with the reference.

``quantize_tiles`` picks a backend: a numba kernel on CPU (fast, see ``kernels.viterbi_numba``), the Triton kernel
``exl3tool.kernels.viterbi.viterbi_tiles`` on CUDA, or ``quantize_tiles_torch``, a vectorised float64 torch
emulation that runs anywhere and serves as the independent reference in the tests.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from exl3tool.format.codebook import check_codebook, codebook_table, codebook_table_np
from exl3tool.format.trellis import check_bits

__all__ = ["BACKENDS", "quantize_tiles", "quantize_tiles_torch"]

BACKENDS = ("auto", "numba", "torch", "triton")


def _check_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """Validate an (n, 256) float tensor and return it as float32 (other float dtypes converted)."""
    if isinstance(tiles, np.ndarray):
        tiles = torch.from_numpy(tiles)
    if not isinstance(tiles, torch.Tensor):
        raise ValueError(f"tiles must be a torch.Tensor of shape (n, 256), got {type(tiles).__name__}")
    if not tiles.is_floating_point():
        raise ValueError(f"tiles must have a floating-point dtype, got {tiles.dtype} (shape {tuple(tiles.shape)})")
    if tiles.dim() != 2 or tiles.shape[1] != 256:
        raise ValueError(f"tiles must have shape (n, 256) in trellis-position order, got shape {tuple(tiles.shape)}")
    return tiles.detach().to(torch.float32)


def quantize_tiles(
    tiles: torch.Tensor, bits: int, codebook: str = "mcg", backend: str = "auto", programs: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None, rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize (n, 256) tiles to K-bit trellis states; returns (values float32, states int16 raw bits).

    backend: "auto" (numba on CPU, Triton on CUDA with a torch fallback), "numba", "torch" or "triton".
    Every backend gives the same bits. ``programs``: tiles in flight at once in the Triton kernel, each with its
    scratch slot (None: the kernel's default), and ``rows`` the cost rows each slot keeps (0, 1, 2; None: the
    kernel's rule); the other backends use neither. ``out``: (values, states) tensors of the result's shapes to
    write into (the Triton kernel writes there directly).

    >>> v, s = quantize_tiles(torch.randn(2, 256), 6)
    >>> v.shape, s.dtype
    (torch.Size([2, 256]), torch.int16)
    """
    values, states = _quantize_tiles(_check_tiles(tiles), bits, codebook, backend, programs, out, rows)
    if out is not None and values is not out[0]:
        out[0].copy_(values)
        out[1].copy_(states)
        return out
    return values, states


def _quantize_tiles(tiles: torch.Tensor, bits: int, codebook: str, backend: str, programs: int | None,
                    out: tuple[torch.Tensor, torch.Tensor] | None,
                    rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    check_bits(bits)
    check_codebook(codebook)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    on_cpu = tiles.device.type == "cpu"
    if backend == "auto":
        backend = "numba" if on_cpu else "triton"
    if backend == "numba":
        if not on_cpu:
            raise ValueError(f"backend 'numba' needs CPU tiles, got device {tiles.device}")
        from exl3tool.kernels.viterbi_numba import quantize_tiles_numba

        states = quantize_tiles_numba(tiles.contiguous().numpy(), bits, codebook_table_np(codebook))
        st = torch.from_numpy(states)
        values = codebook_table(codebook, "cpu")[st.to(torch.int64)].to(torch.float32)
        return values, _to_int16(st)
    if backend == "triton":
        try:
            from exl3tool.kernels.viterbi import viterbi_tiles
        except ImportError as exc:  # Triton missing or the kernel module not built yet
            warnings.warn(
                f"Triton Viterbi kernel unavailable ({exc}); running the slower pure-torch path instead",
                RuntimeWarning,
                stacklevel=3,
            )
            return quantize_tiles_torch(tiles, bits, codebook)
        return viterbi_tiles(tiles, bits, codebook, programs=programs, out=out, rows=rows)
    return quantize_tiles_torch(tiles, bits, codebook)


def _to_int16(states: torch.Tensor) -> torch.Tensor:
    """0..65535 integer states -> int16 raw bits (two's complement)."""
    s = states.to(torch.int32)
    return torch.where(s >= 32768, s - 65536, s).to(torch.int16)


def _r16(x: torch.Tensor) -> torch.Tensor:
    """RNE of float64 values to fp16 precision, kept in float64 (one rounding; never torch's .half()).

    Normal range: round the 52-bit mantissa to 10 bits on the bit pattern; subnormal range: (x + M) - M
    with ulp(M) = 2^-24; |r| >= 65520 -> inf; NaN stays NaN.
    """
    b = x.view(torch.int64)
    normal = ((b + (2**41 - 1) + ((b >> 42) & 1)) & ~(2**42 - 1)).view(torch.float64)
    m = 1.5 * 2.0**28
    sub = (x + m) - m
    r = torch.where(x.abs() < 2.0**-14, sub, normal)
    r = torch.where(r.abs() >= 65520.0, torch.copysign(torch.full_like(r, float("inf")), x), r)
    return torch.where(torch.isnan(x), x, r)


def _r16_cost(x: torch.Tensor) -> torch.Tensor:
    """Cheaper _r16 for costs: x >= 0, +inf or an arithmetic (canonical, so preserved) NaN."""
    b = x.view(torch.int64)
    normal = ((b + (2**41 - 1) + ((b >> 42) & 1)) & ~(2**42 - 1)).view(torch.float64)
    m = 1.5 * 2.0**28
    r = torch.where(x < 2.0**-14, (x + m) - m, normal)
    return r.masked_fill_(r >= 65520.0, float("inf"))


def _rank(e: torch.Tensor) -> torch.Tensor:
    """Section 6.5 tie-break rank: (brev5(bits 5..9), brev5(bits 0..4), e >> 10)."""

    def brev5(v: torch.Tensor) -> torch.Tensor:
        return sum(((v >> i) & 1) << (4 - i) for i in range(5))

    return (brev5((e >> 5) & 31) << 10) | (brev5(e & 31) << 5) | (e >> 10)


def _first_min(cost: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict less-than scan over the last dim (k), as the reference: (best cost, first best k).

    If k = 0 is NaN nothing replaces it; otherwise NaNs never win, so they can be treated as +inf.
    """
    nan0 = torch.isnan(cost[..., 0])
    clean = torch.where(torch.isnan(cost), float("inf"), cost)
    k = clean.argmin(dim=-1)  # documented: the first index among equal minima
    best = torch.gather(clean, -1, k.unsqueeze(-1)).squeeze(-1)
    best = torch.where(nan0, cost[..., 0], best)
    k = torch.where(nan0, torch.zeros_like(k), k)
    return best, k


def _forward(w: torch.Tensor, order: list[int], K: int, dec_s: torch.Tensor, pred: torch.Tensor,
             efix: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over positions ``order``; returns final costs (n, E) and back-pointer k (n, 256, E) uint8."""
    n = w.shape[0]
    w32 = w.to(torch.float32)  # exact: w holds fp16 values
    dec_s32 = dec_s.to(torch.float32)
    E = 1 << (16 - K)
    bp = torch.zeros((n, 256, E), dtype=torch.uint8, device=w.device)
    cost = None
    for t, p in enumerate(order):
        # (n, E, 2^K) fp16 differences: f32(dec - w) is then rounded float32 -> float16 once (a direct RNE
        # cast); f16(f32(a - b)) == f16(a - b) for fp16 a, b since 24 >= 2*11 + 2 (no double-rounding error)
        d = (dec_s32.unsqueeze(0) - w32[:, p].view(n, 1, 1)).to(torch.float16).to(torch.float64)
        if t == 0:
            c = _r16_cost(d * d)
            if efix is not None:
                c = torch.where(pred.unsqueeze(0) == efix.view(n, 1, 1), c, float("inf"))
        else:
            # d*d is exact in float64, and f16(fl64(d*d + C)) == f16(d*d + C) (see kernels/viterbi_numba, point 4)
            c = _r16_cost(torch.addcmul(cost[:, pred], d, d))
        cost, k = _first_min(c)
        bp[:, p] = k.to(torch.uint8)
    return cost, bp


@torch.no_grad()
def quantize_tiles_torch(tiles: torch.Tensor, bits: int, codebook: str = "mcg",
                         batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch float64 emulation of section 6 on any device (slow; the reference for the tests)."""
    tiles = _check_tiles(tiles)
    K = check_bits(bits)
    check_codebook(codebook)
    dev = tiles.device
    n = tiles.shape[0]
    E = 1 << (16 - K)
    table = codebook_table(codebook, dev)
    dec = table.to(torch.float64)  # exact widening
    kk = torch.arange(1 << K, device=dev).view(1, -1)
    ee = torch.arange(E, device=dev).view(-1, 1)
    s_grid = (kk << (16 - K)) | ee  # (E, 2^K) candidate states; k innermost so the scan is contiguous
    pred = s_grid >> K  # (E, 2^K) in-edge of each candidate
    dec_s = dec[s_grid]
    rank = _rank(torch.arange(E, device=dev))
    if batch is None:
        batch = 32 if dev.type == "cpu" else 1024
    states = torch.empty((n, 256), dtype=torch.int64, device=dev)
    for lo in range(0, n, batch):
        w = _r16(tiles[lo:lo + batch].to(torch.float64))  # (b, 256) fp16 inputs
        b = w.shape[0]
        rows = torch.arange(b, device=dev)
        cost, bp1 = _forward(w, list(range(128, 256)) + list(range(128)), K, dec_s, pred, None)
        bits16 = torch.where(torch.isnan(cost), 0x7E00, cost.to(torch.float16).view(torch.int16).to(torch.int64))
        key = (bits16 << 16) | rank.unsqueeze(0)
        e = key.argmin(dim=1)
        e = torch.where(bits16.amin(dim=1) >= 0x7C00, torch.zeros_like(e), e)
        for p in range(127, -1, -1):
            e = (bp1[rows, p, e].to(torch.int64) << (16 - 2 * K)) | (e >> K)
        efix = e
        del bp1
        _, bp2 = _forward(w, list(range(256)), K, dec_s, pred, efix)
        e = efix
        for p in range(255, -1, -1):
            k = bp2[rows, p, e].to(torch.int64)
            states[lo:lo + b, p] = (k << (16 - K)) | e
            e = (k << (16 - 2 * K)) | (e >> K)
    values = table[states].to(torch.float32)
    return values, _to_int16(states)
