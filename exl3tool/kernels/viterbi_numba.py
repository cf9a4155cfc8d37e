"""Numba CPU kernels for the EXL3 tail-biting Viterbi tile quantizer (docs/format.md §6).

Two kernels, bit-identical on the inputs each is used for:

* ``_generic_tile``: a literal float64 emulation of the reference's generic kernel (fp16 rounding of every
  candidate cost, strict less-than scan over k, uint8 back-pointers). Used for tiles that contain a NaN,
  where the scan's NaN semantics (section 6.7) matter.
* ``_fast_tile``: for NaN-free tiles. Because RNE rounding to fp16 is monotone, the rounded minimum over k
  equals the rounding of the unrounded minimum, so the hot loop is a plain ``min(sq[s] + C_old[pred])``
  (float64, vectorised) with one rounding per edge and step. Back-pointers are not tracked in the hot loop:
  every step's rounded costs are kept and the literal strict-less-than scan is redone only along the
  traced path (2^K candidates per position), which gives the reference's tie-break by construction.

Exactness argument for the fast kernel (checked on every golden tile):

1. ``d = f16(dec - w)``: dec and w are fp16; f32(dec - w) then RNE to 11 significant bits equals the direct
   fp16 rounding (double rounding is innocuous since 24 >= 2*11 + 2). We round with the normal-range bit
   trick only. If the true |d| < 2^-14 (fp16 subnormal) our d may differ from the fp16 one, but then both
   d^2 < 2^-27 < 2^-25 = half the smallest fp16 ulp, so f16(d^2 + C) = C for every fp16 C >= 0 either way
   (and f16(d^2) = 0 at a first step).
2. ``d*d`` is exact in float32 (22 significant bits, no underflow since |d| >= 2^-24 or d == 0), and so in
   float64. |d| may round up to 2^16; then d^2 >= 2^32 and the cost is +inf either way.
3. ``x = d*d + C`` in float64 rounds to the same fp16 value as the exact sum. Only x < 2^17 matters (else
   +inf either way). Write d = m * 2^q (|m| < 2^11): d^2 is a multiple of 2^2q, C of 2^-24, so the sum is
   exact when 2^2q >= 2^-36 (17 + 36 = 53 bits). If it is inexact, the float64 error is < 2^-36 and a wrong
   fp16 result needs an fp16 rounding boundary b != x with |x - b| < 2^-36, i.e. d^2 within 2^-36 of b - C:
   * b == C: then d^2 < 2^-36 and x, fl64(x) both lie in [C, C + 2^-36], which round to C;
   * b != C: |b - C| >= 2^-25, so d^2 > 2^-26, while 2^2q < 2^-36 gives d^2 < 2^(22+2q) <= 2^-16 and
     2^2q >= 2^-46; inexactness then needs x > 2^(53+2q) >= 2^7, so C > 2^6 and b, C are multiples of 2^-4,
     forcing d^2 > 2^-5: a contradiction.
   Float64 rounding is monotone, so the minimum of the float64 sums rounds to the minimum rounded cost.
"""

from __future__ import annotations

import os

import numba
import numpy as np
from numba import njit, prange



def _threading_layer() -> None:
    """numba's default "omp" layer (GNU OpenMP) leaves its workers spinning after each parallel call; on a 2-core
    box that made the torch work that follows (Hadamards, the torch reference) 15x slower. The workqueue layer
    sleeps. Chosen before this module's first parallel launch (never at import: importing changes nothing in the
    process), and only when nothing chose one (an explicit NUMBA_THREADING_LAYER stands)."""
    if "NUMBA_THREADING_LAYER" not in os.environ and not _launched:
        numba.config.THREADING_LAYER = "workqueue"
    _launched.append(True)


_launched: list[bool] = []

__all__ = ["quantize_tiles_numba"]

_INF = np.inf
_TWO_M14 = 2.0**-14
_M64 = 1.5 * 2.0**28  # (x + M) - M rounds |x| < 2^-14 to the fp16 subnormal grid 2^-24 (RNE, float64)
_TRANSPOSE_MAX_K = 5  # K <= 5: transposed loop layout (see _forward_fast)
# int32 constants keep numba's float32 bit tricks in 32-bit lanes (python ints would promote to int64)
_I0FFF = np.int32(0xFFF)
_I13 = np.int32(13)
_I1 = np.int32(1)
_IMASK = np.int32(~0x1FFF)


@njit(cache=True, inline="always")
def _r16_64(x: float) -> float:
    """RNE of a float64 to the nearest fp16 value, returned as float64 (inf beyond 65520, NaN kept)."""
    if x != x:
        return x
    a = abs(x)
    if a < _TWO_M14:
        return (x + _M64) - _M64
    b = np.int64(np.float64(x).view(np.int64))
    b = (b + np.int64(0x1FFFFFFFFFF) + ((b >> 42) & 1)) & np.int64(~0x3FFFFFFFFFF)
    r = np.int64(b).view(np.float64)
    if abs(r) >= 65520.0:
        return _INF if x > 0 else -_INF
    return r


@njit(cache=True, inline="always")
def _cost64(dec64, w: float, k: int, e: int, K: int, first: bool, constrained: bool, efix: int, cold) -> float:
    """Exact fp16 cost of candidate k for edge e at one step (float64 emulation of section 6.2/6.3)."""
    s = (k << (16 - K)) | e
    d = _r16_64(dec64[s] - w)
    if first:
        if constrained and ((k << (16 - 2 * K)) | (e >> K)) != efix:
            return _INF
        return _r16_64(d * d)
    return _r16_64(d * d + cold[(k << (16 - 2 * K)) | (e >> K)])


@njit(cache=True)
def _scan_k(dec64, w: float, e: int, K: int, first: bool, constrained: bool, efix: int, cold):
    """Reference candidate scan for one edge: first k with the smallest cost (strict less-than)."""
    best = _cost64(dec64, w, 0, e, K, first, constrained, efix, cold)
    bk = 0
    for k in range(1, 1 << K):
        c = _cost64(dec64, w, k, e, K, first, constrained, efix, cold)
        if c < best:
            best = c
            bk = k
    return best, bk


@njit(cache=True)
def _rank(e: int) -> int:
    """Tie-break rank of section 6.5: (brev5(bits 5..9), brev5(bits 0..4), e >> 10)."""
    a = (e >> 5) & 31
    b = e & 31
    ra = 0
    rb = 0
    for i in range(5):
        ra |= ((a >> i) & 1) << (4 - i)
        rb |= ((b >> i) & 1) << (4 - i)
    return (ra << 10) | (rb << 5) | (e >> 10)


@njit(cache=True)
def _final_edge(cost, E: int) -> int:
    """Argmin over edges by (cost, rank); 0 when the minimum is +inf or NaN."""
    best_e = 0
    best_c = _INF
    best_r = 1 << 30
    for e in range(E):
        c = cost[e]
        if c != c or c == _INF:
            continue
        r = _rank(e)
        if c < best_c or (c == best_c and r < best_r):
            best_c = c
            best_r = r
            best_e = e
    if best_c == _INF:
        return 0
    return best_e


@njit(cache=True)
def _generic_tile(w64, K: int, dec64, bp, ca, cb, states) -> None:
    """Literal two-pass tail-biting Viterbi (float64 emulation); handles NaN exactly like the reference."""
    E = 1 << (16 - K)
    efix = 0
    for pas in range(2):
        constrained = pas == 1
        cold = ca
        cnew = cb
        for t in range(256):
            p = (t + 128) & 255 if pas == 0 else t
            w = w64[p]
            for e in range(E):
                c, bk = _scan_k(dec64, w, e, K, t == 0, constrained, efix, cold)
                cnew[e] = c
                bp[p, e] = bk
            tmp = cold
            cold = cnew
            cnew = tmp
        if pas == 0:
            e = _final_edge(cold, E)
            for p in range(127, -1, -1):
                e = (np.int64(bp[p, e]) << (16 - 2 * K)) | (e >> K)
            efix = e
    e = efix
    for p in range(255, -1, -1):
        k = np.int64(bp[p, e])
        states[p] = (k << (16 - K)) | e
        e = (k << (16 - 2 * K)) | (e >> K)


@njit(cache=True)
def _round_costs(best, out) -> None:
    """out[e] = f16-rounded best[e] (non-negative float64 or +inf), branch-free so that it vectorises."""
    bi = best.view(np.int64)
    for e in range(best.shape[0]):
        x = best[e]
        b = bi[e]
        rn = np.int64((b + np.int64(0x1FFFFFFFFFF) + ((b >> 42) & 1)) & np.int64(~0x3FFFFFFFFFF)).view(np.float64)
        sub = (x + _M64) - _M64
        r = sub if x < _TWO_M14 else rn
        r = _INF if r >= 65520.0 else r
        out[e] = np.float32(r)


@njit(cache=True)
def _forward_fast(w32, order_start: int, K: int, decl, constrained: bool, efix: int, hist, sq, best, tmp) -> None:
    """One forward pass storing every step's rounded costs in hist[t] (natural edge order).

    ``decl`` is the float32 codebook in the loop layout of ``_loop_layout``: natural for K >= 6 (inner loop
    over the 2^K edges sharing one pred), transposed for K <= 5 (inner loop over the 2^(16-2K) preds of a
    k block, so short runs of 4 or 8 do not stop vectorisation). ``sq`` and ``best`` follow that layout.
    """
    E = 1 << (16 - K)
    R = 1 << K  # candidates per edge = run length of a constant C_old[pred]
    J = E >> K  # distinct pred values per k block
    sh = 16 - 2 * K
    tr = K <= _TRANSPOSE_MAX_K
    for t in range(256):
        p = (t + order_start) & 255
        w = w32[p]
        # sq[s] = f16(dec[s] - w)^2 in float32 (normal-range rounding suffices, see module docstring)
        for s in range(65536):
            d = np.float32(decl[s] - w)
            b = d.view(np.int32)
            b = np.int32((b + _I0FFF + ((b >> _I13) & _I1)) & _IMASK)
            dr = np.uint32(b).view(np.float32)
            sq[s] = dr * dr  # exact in float32; widened to float64 in the min loop
        cur = hist[t]
        if t == 0 and constrained:
            # only pred == efix is allowed: k = efix >> sh and edges e with e >> K == efix & (J - 1)
            kf = efix >> sh
            jf = efix & (J - 1)
            for e in range(E):
                best[e] = _INF
            for i in range(R):
                li = kf * E + (i * J + jf if tr else (jf << K) | i)
                best[i * J + jf if tr else (jf << K) | i] = np.float64(sq[li])
        elif t == 0:
            # d*d is exact, so min then one rounding is the fp16 cost (no double rounding)
            for e in range(E):
                best[e] = np.float64(sq[e])
            for k in range(1, R):
                sqk = sq[k * E:(k + 1) * E]
                for e in range(E):
                    best[e] = np.minimum(np.float64(sqk[e]), best[e])
        else:
            old = hist[t - 1]
            for e in range(E):
                best[e] = _INF
            # Slices (not computed indices) keep numba from emitting negative-index wraparound, which
            # blocks vectorisation. np.minimum, not ``v if v < b else b``: LLVM turns that select into a masked
            # store of v (vmaskmovpd), microcoded on AMD and slow elsewhere; an unconditional store of the minimum
            # ran the whole tile quantizer 1.35-2.1x faster (K = 1..8, one thread). The same value: the fast
            # kernel's costs are never NaN, and the equal case stores an equal value (costs are >= +0).
            for k in range(R):
                sqk = sq[k * E:(k + 1) * E]
                ok = old[(k << sh):(k << sh) + J]
                if tr:
                    for i in range(R):
                        sj = sqk[i * J:(i + 1) * J]
                        bj = best[i * J:(i + 1) * J]
                        for j in range(J):
                            bj[j] = np.minimum(np.float64(sj[j]) + np.float64(ok[j]), bj[j])  # float64: point 3
                else:
                    for j in range(J):
                        c = np.float64(ok[j])
                        o = j << K
                        sj = sqk[o:o + R]
                        bj = best[o:o + R]
                        for i in range(R):
                            bj[i] = np.minimum(np.float64(sj[i]) + c, bj[i])  # float64: point 3
        if tr:
            _round_costs(best, tmp)
            for i in range(R):
                for j in range(J):
                    cur[(j << K) | i] = tmp[i * J + j]
        else:
            _round_costs(best, cur)


def _loop_layout(dec32: np.ndarray, K: int) -> np.ndarray:
    """The codebook reordered for _forward_fast: index k*E + i*J + j holds state (k << (16-K)) | (j << K) | i."""
    if K > _TRANSPOSE_MAX_K:
        return np.ascontiguousarray(dec32)
    E, R = 1 << (16 - K), 1 << K
    J = E >> K
    return np.ascontiguousarray(dec32.reshape(R, J, R).transpose(0, 2, 1).reshape(-1))


@njit(cache=True)
def _bp_along(dec64, w: float, e: int, K: int, first: bool, constrained: bool, efix: int, prev) -> int:
    """Back-pointer k of edge e at one step, recomputed with the reference scan from the previous costs."""
    best = _INF
    bk = 0
    for k in range(1 << K):
        s = (k << (16 - K)) | e
        d = _r16_64(dec64[s] - w)
        if first:
            if constrained and ((k << (16 - 2 * K)) | (e >> K)) != efix:
                c = _INF
            else:
                c = _r16_64(d * d)
        else:
            c = _r16_64(d * d + np.float64(prev[(k << (16 - 2 * K)) | (e >> K)]))
        if k == 0 or c < best:
            best = c
            bk = k
    return bk


@njit(cache=True)
def _fast_tile(w64, w32, K: int, dec64, decl, hist, sq, best, tmp, states) -> None:
    """Two-pass tail-biting Viterbi for a NaN-free tile; min-only forward passes, recomputed traceback."""
    E = 1 << (16 - K)
    sh = 16 - 2 * K
    _forward_fast(w32, 128, K, decl, False, 0, hist, sq, best, tmp)
    final = np.empty(E, dtype=np.float64)
    for e in range(E):
        final[e] = hist[255, e]
    e = _final_edge(final, E)
    # pass 1 visits position p at step t = (p - 128) & 255; trace positions 127..0 (steps 255..128)
    for p in range(127, -1, -1):
        t = (p - 128) & 255
        k = _bp_along(dec64, w64[p], e, K, False, False, 0, hist[t - 1])
        e = (k << sh) | (e >> K)
    efix = e
    _forward_fast(w32, 0, K, decl, True, efix, hist, sq, best, tmp)
    e = efix
    for p in range(255, -1, -1):
        if p == 0:
            k = _bp_along(dec64, w64[0], e, K, True, True, efix, hist[0])
        else:
            k = _bp_along(dec64, w64[p], e, K, False, True, efix, hist[p - 1])
        states[p] = (k << (16 - K)) | e
        e = (k << sh) | (e >> K)


@njit(cache=True, parallel=True, fastmath=False)
def _quantize_tiles_kernel(x, K: int, dec64, decl, nthreads: int, force_generic: bool):
    """All tiles: prange over per-thread chunks, each chunk with its own scratch buffers."""
    n = x.shape[0]
    E = 1 << (16 - K)
    states = np.empty((n, 256), dtype=np.int32)
    chunk = (n + nthreads - 1) // nthreads
    for c in prange(nthreads):
        lo = c * chunk
        hi = min(n, lo + chunk)
        if lo >= hi:
            continue
        w64 = np.empty(256, dtype=np.float64)
        w32 = np.empty(256, dtype=np.float32)
        hist = np.empty((256, E), dtype=np.float32)
        sq = np.empty(65536, dtype=np.float32)
        best = np.empty(E, dtype=np.float64)
        tmp = np.empty(E, dtype=np.float32)
        bp = np.empty((0, 0), dtype=np.uint8)
        ca = np.empty(E, dtype=np.float64)
        cb = np.empty(E, dtype=np.float64)
        st = np.empty(256, dtype=np.int64)
        for i in range(lo, hi):
            has_nan = False
            for p in range(256):
                v = _r16_64(np.float64(x[i, p]))
                w64[p] = v
                w32[p] = np.float32(v)
                if v != v:
                    has_nan = True
            if has_nan or force_generic:
                if bp.shape[0] == 0:
                    bp = np.empty((256, E), dtype=np.uint8)
                _generic_tile(w64, K, dec64, bp, ca, cb, st)
            else:
                _fast_tile(w64, w32, K, dec64, decl, hist, sq, best, tmp, st)
            for p in range(256):
                states[i, p] = st[p]
    return states


def quantize_tiles_numba(x: np.ndarray, bits: int, dec16: np.ndarray, force_generic: bool = False) -> np.ndarray:
    """(n, 256) float32 tiles -> (n, 256) int32 states in 0..65535 (force_generic: literal kernel only)."""
    dec64 = dec16.astype(np.float64)
    decl = _loop_layout(dec16.astype(np.float32), bits)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[0] == 0:
        return np.empty((0, 256), dtype=np.int32)
    _threading_layer()
    nthreads = max(1, min(numba.get_num_threads(), x.shape[0]))
    return _quantize_tiles_kernel(x, bits, dec64, decl, nthreads, force_generic)
