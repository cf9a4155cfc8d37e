"""Triton GPU tile quantizer: the EXL3 tail-biting Viterbi (docs/format.md §6), bit-exact.

Formulation (one program per tile). A step visits one trellis position; every edge e in [0, E) with
E = 2^(16-K) keeps the cheapest of its 2^K candidates s = (k << (16-K)) | e, whose predecessor is
pred = k * NH + (e >> K) with NH = 2^(16-2K). We loop over k (in increasing order, so a strict
less-than keeps the first minimum exactly like the reference) and treat all edges of the tile
element-wise as one [NH, 2^K] block, so no cross-thread reduction is needed: per candidate only
d = dec - w, one fp16 FMA, a compare and two selects. dec[k*E + e] is a contiguous row of the
codebook table (L1 resident); C_old[k*NH + h] is one value per block row. Costs live in a
double-buffered per-slot global scratch (L1 resident, one CTA barrier per step); back-pointers are
stored as the uint8 k per (position, edge), or two per byte at K <= 4 in the packed modes (half the
scratch); the two tracebacks are scalar loops per tile.

Cost rows (``ROWS``, the packed modes at the K of the tuning's ``cost_row_bits``): no back-pointer is kept. Every
step's cost row stays in the slot (256 rows of E fp16), a candidate is only sub, fma and min (3 f16x2
instructions per two candidates instead of 5; ptxas fuses pairs of mins into a 3-way VHMNMX), and the
traceback recomputes, at each position it visits, the NL candidate costs of its edge from the row the step
read, with the same fp16 operations, and takes the first minimum: the choice the strict less-than kept.

Tile lanes (``TL``, cost rows only; the tuning's ``viterbi_lanes``): a program runs TL = 2 or 4 tiles at once, tile l
in bits 16 l .. 16 l + 15 of each edge's cost word (int32 or int64), so one codebook value read serves TL tiles'
candidates (``_forward_lanes``; with two edges per register the L1 reads of the codebook bound the kernel); every
lane's traceback runs at once with every row kept (``_traced_k_lanes``), lane by lane with every other row.

Programs are persistent: G of them (``programs``) each own one scratch slot (TL slots with lanes) and loop over
tiles pid, pid + G, ... (groups of TL tiles), so the scratch is G slots however many tiles one launch holds, and a
launch never ends in a partial wave of short-lived programs.

Exactness: the fp16 FMA must be rounded once. On the GPU it is PTX ``fma.rn.f16``/``fma.rn.f16x2``
through inline assembly; under TRITON_INTERPRET=1 (no PTX) it is emulated exactly in float64 with
explicit round-to-nearest-even to fp16 precision (never torch's double-rounding float64->float16).
"""

from __future__ import annotations

import warnings

import torch

from exl3tool.format.codebook import check_codebook, codebook_table, edge_major_table
from exl3tool.kernels.geometry import (DEFAULT_MAX_SCRATCH, MAX_HALF_ROW_BITS, cost_row_stride, slot_cost_rows,
                                      viterbi_slot_bytes)
from exl3tool.knobs import Tuning, current_tuning

try:  # triton is optional for the CPU-only parts of the package
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    _HAVE_TRITON = False

__all__ = ["viterbi_tiles", "viterbi_matrix", "interpreter_active", "resident_tiles", "row_choices", "selfcheck_results",
           "slot_bytes", "packs_nibbles", "keeps_rows", "MODES"]

# Arithmetic paths (tl.constexpr MODE of the kernel):
#   0: exact float64 emulation (interpreter; also runs on GPU, slowly)
#   1: fma.rn.f16 inline asm (pack 1), Triton fp16 sub / compare / select (the self-check's plain form)
#   4: one f16x2 inline asm per two edges packed in an int32 element: sub, fma, set.lt mask, two lop3 selects
#   5: the layout of 4 with the exact emulation of 0 (checks 4's indexing under the interpreter)
# (Modes 2 and 3, f16x2 forms that repacked halves every step, were slower than 4 and are retired: git history.)
MODES = (0, 1, 4, 5)
# (device, bits, the mode asked for: Tuning.viterbi_mode) -> mode in use after the one-time self-check against mode 1
_CHECKED: dict[tuple[str, int, int], int] = {}
DEFAULT_SCRATCH_BYTES = DEFAULT_MAX_SCRATCH  # scratch of one call when ``programs`` is not given

if _HAVE_TRITON:

    @triton.jit
    def _fma16_emu(d, c):
        """f16(d*d + c) with ONE rounding, emulated exactly in float64 (d, c fp16; c >= 0)."""
        dd = d.to(tl.float64)
        r = dd * dd + c.to(tl.float64)  # exact: 22-bit product plus an fp16, far inside 53 bits
        b = r.to(tl.int64, bitcast=True)
        b = (b + 2199023255551 + ((b >> 42) & 1)) & -4398046511104  # RNE to 11 significant bits
        normal = b.to(tl.float64, bitcast=True)
        sub = (r + 402653184.0) - 402653184.0  # 1.5*2^28: RNE to a multiple of 2^-24 (fp16 subnormals)
        out = tl.where(r < 6.103515625e-05, sub, normal)
        out = tl.where(r >= 65520.0, float("inf"), out)
        return out.to(tl.float16)  # exact: out is representable in fp16

    @triton.jit
    def _fma16_asm1(d, c):
        """fp16 FMA d*d + c, single rounding (PTX fma.rn.f16), one element per asm block."""
        return tl.inline_asm_elementwise(
            "fma.rn.f16 $0, $1, $1, $2;", "=h,h,h", [d, c], dtype=tl.float16, is_pure=True, pack=1
        )

    @triton.jit
    def _cost(dec, w, cold, MODE: tl.constexpr):
        """fma16(d, d, C_old) with d = f16(dec - w)."""
        if MODE == 0:
            d = (dec.to(tl.float32) - w.to(tl.float32)).to(tl.float16)  # exact (double-rounding theorem)
            return _fma16_emu(d, cold)
        else:
            return _fma16_asm1(dec - w, cold)

    @triton.jit
    def _step_update(dec, w, cold, best, bk, k, MODE: tl.constexpr):
        """Candidate k of every edge: replace (best, bk) where its cost is strictly smaller."""
        c = _cost(dec, w, cold, MODE)
        take = c < best
        best = tl.where(take, c, best)
        bk = tl.where(take, k, bk).to(tl.int16)
        return best, bk

    @triton.jit
    def _unpack2(x2):
        """int32 holding two fp16 (element 2j in the low half) -> (low, high) fp16."""
        lo = (x2 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        hi = ((x2 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        return lo, hi

    @triton.jit
    def _pack2(lo, hi):
        lo32 = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi32 = hi.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return lo32 | (hi32 << 16)

    @triton.jit
    def _first_packed(dec2, w, cold, MODE: tl.constexpr):
        """Costs of candidate k = 0 for two edges per int32: fma16(d, d, C_old)."""
        if MODE == 4:
            return tl.inline_asm_elementwise(
                """{
                .reg .b32 ww, cc, d;
                mov.b32 ww, {$2, $2};
                mov.b32 cc, {$3, $3};
                sub.rn.f16x2 d, $1, ww;
                fma.rn.f16x2 $0, d, d, cc;
                }""",
                "=r,r,h,h",
                [dec2, w, cold],
                dtype=tl.int32,
                is_pure=True,
                pack=1,
            )
        else:
            dl, dh = _unpack2(dec2)
            return _pack2(_cost(dl, w, cold, 0), _cost(dh, w, cold, 0))

    @triton.jit
    def _update_packed(dec2, w, cold, best2, bk2, k, MODE: tl.constexpr):
        """Candidate k for two edges per int32 register: strict less-than replaces (best, k)."""
        if MODE == 4:
            kk2 = (tl.zeros_like(bk2) + k) * 65537
            best2, bk2 = tl.inline_asm_elementwise(
                """{
                .reg .b32 ww, cc, d, c, m;
                mov.b32 ww, {$3, $3};
                mov.b32 cc, {$4, $4};
                sub.rn.f16x2 d, $2, ww;
                fma.rn.f16x2 c, d, d, cc;
                set.lt.u32.f16x2 m, c, $5;
                lop3.b32 $0, c, $5, m, 0xE4;
                lop3.b32 $1, $7, $6, m, 0xE4;
                }""",
                "=r,=r,r,h,h,r,r,r",
                [dec2, w, cold, best2, bk2, kk2],
                dtype=(tl.int32, tl.int32),
                is_pure=True,
                pack=1,
            )
        else:
            dl, dh = _unpack2(dec2)
            bl, bh = _unpack2(best2)
            cl = _cost(dl, w, cold, 0)
            ch = _cost(dh, w, cold, 0)
            tlo = cl < bl
            thi = ch < bh
            best2 = _pack2(tl.where(tlo, cl, bl), tl.where(thi, ch, bh))
            bk2 = tl.where(tlo, k, bk2 & 0xFFFF) | (tl.where(thi, k, bk2 >> 16) << 16)
        return best2, bk2

    @triton.jit
    def _min_packed(dec2, w, cold, best2, MODE: tl.constexpr):
        """Candidate k for two edges per int32 register, cost only (the cost-row kernel keeps no back-pointer):
        best = min(best, fma16(d, d, C_old)); the first minimum's k is recomputed by the traceback."""
        if MODE == 4:
            return tl.inline_asm_elementwise(
                """{
                .reg .b32 ww, cc, d, c;
                mov.b32 ww, {$2, $2};
                mov.b32 cc, {$3, $3};
                sub.rn.f16x2 d, $1, ww;
                fma.rn.f16x2 c, d, d, cc;
                min.f16x2 $0, c, $4;
                }""",
                "=r,r,h,h,r",
                [dec2, w, cold, best2],
                dtype=tl.int32,
                is_pure=True,
                pack=1,
            )
        else:  # the exact emulation: _update_packed's costs, its back-pointer dropped
            best2, _ = _update_packed(dec2, w, cold, best2, tl.zeros_like(best2), 0, MODE)
            return best2

    @triton.jit
    def _row_slot(r):
        """Where cost row r lies in a slot that keeps every other row (ROWS = 2): even rows at r / 2 (row 256 is
        row 0), the odd row of the step in flight in row 128."""
        return tl.where(r % 2 == 0, (r // 2) % 128, 128)

    @triton.jit
    def _forward_pass(x_t, dec_ptr, cs, bp, START: tl.constexpr, K: tl.constexpr, NL: tl.constexpr,
                      NH: tl.constexpr, BH: tl.constexpr, KC: tl.constexpr, MODE: tl.constexpr,
                      PACK4: tl.constexpr, ROWS: tl.constexpr, STEPS: tl.constexpr):
        """STEPS Viterbi steps over positions START, START+1, ... (mod 256); costs start in cs[0:E]. Step t reads
        cost row t and writes row t + 1: two rows used in turn (ROWS = 0), or no back-pointers and the rows kept
        for the traceback to recompute them: all 256 (ROWS = 1, row 256 is row 0) or the even ones (ROWS = 2,
        ``_row_slot``)."""
        E: tl.constexpr = NH * NL
        rows = tl.arange(0, BH)[:, None]
        cols = tl.arange(0, NL)[None, :]
        for t in range(STEPS):
            p = (t + START) % 256
            w = tl.load(x_t + p).to(tl.float16)
            if ROWS == 1:
                src = cs + t * E
                dst = cs + ((t + 1) % 256) * E
            elif ROWS == 2:
                src = cs + _row_slot(t) * E
                dst = cs + _row_slot(t + 1) * E
            else:
                src = cs + (t % 2) * E
                dst = cs + ((t + 1) % 2) * E
            for hc in range(NH // BH):
                h = hc * BH + rows  # e >> K
                e = h * NL + cols
                if MODE >= 4:
                    # two edges per int32: dec pairs, costs and back-pointers packed, f16x2 arithmetic
                    NL2: tl.constexpr = NL // 2
                    e2 = h * NL2 + tl.arange(0, NL2)[None, :]
                    dec32 = dec_ptr.to(tl.pointer_type(tl.int32))
                    best2 = _first_packed(tl.load(dec32 + e2), w, tl.load(src + h), MODE)
                    if ROWS:
                        for k in range(1, NL):
                            dec2 = tl.load(dec32 + k * (E // 2) + e2)
                            cold = tl.load(src + k * NH + h)
                            best2 = _min_packed(dec2, w, cold, best2, MODE)
                        tl.store(dst.to(tl.pointer_type(tl.int32)) + e2, best2)
                    else:
                        bk2 = tl.zeros([BH, NL2], dtype=tl.int32)
                        for k in range(1, NL):
                            dec2 = tl.load(dec32 + k * (E // 2) + e2)
                            cold = tl.load(src + k * NH + h)
                            best2, bk2 = _update_packed(dec2, w, cold, best2, bk2, k, MODE)
                        tl.store(dst.to(tl.pointer_type(tl.int32)) + e2, best2)
                        if PACK4:  # k < 16: the pair's two back-pointers in one byte (even edge in the low nibble)
                            tl.store(bp + p * (E // 2) + e2, ((bk2 & 0xF) | ((bk2 >> 12) & 0xF0)).to(tl.uint8))
                        else:
                            bp16 = (bp + p * E).to(tl.pointer_type(tl.int16))
                            tl.store(bp16 + e2, ((bk2 & 0xFF) | ((bk2 >> 8) & 0xFF00)).to(tl.int16))
                elif KC == 1:
                    # k = 0 is the first candidate: taken unconditionally (strict less-than afterwards)
                    best = _cost(tl.load(dec_ptr + e), w, tl.load(src + h), MODE)
                    bk = tl.zeros([BH, NL], dtype=tl.int16)
                    for k in range(1, NL):
                        dec = tl.load(dec_ptr + k * E + e)
                        cold = tl.load(src + k * NH + h)
                        best, bk = _step_update(dec, w, cold, best, bk, k, MODE)
                else:
                    # KC candidates at once as a [KC, BH, NL] block; argmin keeps the first minimum
                    kb = tl.arange(0, KC)[:, None, None]
                    best = tl.full([BH, NL], float("inf"), tl.float16)
                    bk = tl.zeros([BH, NL], dtype=tl.int16)
                    for kc in range(NL // KC):
                        k3 = kc * KC + kb
                        dec = tl.load(dec_ptr + k3 * E + e[None, :, :])
                        cold = tl.load(src + k3 * NH + h[None, :, :])
                        c = _cost(dec, w, cold, MODE)
                        cmin, ci = tl.min(c, axis=0, return_indices=True, return_indices_tie_break_left=True)
                        if kc == 0:
                            best = cmin
                            bk = ci.to(tl.int16)
                        else:
                            take = cmin < best
                            best = tl.where(take, cmin, best)
                            bk = tl.where(take, ci + kc * KC, bk).to(tl.int16)
                if MODE < 4:
                    tl.store(dst + e, best)
                    tl.store(bp + p * E + e, bk.to(tl.uint8))
            tl.debug_barrier()  # C_new and back-pointers visible to the whole CTA

    # ---- tile lanes (TL = 2 or 4 tiles per program): each f16x2 half holds one tile's cost of the same edge ----
    # A lane word (int32 for TL = 2, int64 for TL = 4) holds the fp16 costs of one edge in TL tiles, lane l in bits
    # 16 l .. 16 l + 15. The codebook value of a candidate is the same in every tile, so one codebook read serves TL
    # tiles (the cost-row kernel with two edges per register read it for one: its L1 traffic bound the speed).

    @triton.jit
    def _lane(word, li, TL: tl.constexpr):
        """fp16 lane ``li`` of lane words (int32 / int64)."""
        return ((word >> (16 * li)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)

    @triton.jit
    def _lane_bits(v, TL: tl.constexpr):
        """fp16 -> its 16 bits in the lane word's integer type (zero-extended)."""
        if TL == 2:
            return v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        else:
            return v.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF

    @triton.jit
    def _lanes_asm(dec, w, cold, best, TL: tl.constexpr, FIRST: tl.constexpr):
        """fma16(f16(dec - w_l), ., cold_l) in every lane, min'd into best unless FIRST: f16x2 inline PTX, the
        codebook value broadcast to both halves."""
        if TL == 2:
            if FIRST:
                return tl.inline_asm_elementwise(
                    """{
                    .reg .b32 dd, d;
                    mov.b32 dd, {$1, $1};
                    sub.rn.f16x2 d, dd, $2;
                    fma.rn.f16x2 $0, d, d, $3;
                    }""",
                    "=r,h,r,r", [dec, w, cold], dtype=tl.int32, is_pure=True, pack=1)
            else:
                return tl.inline_asm_elementwise(
                    """{
                    .reg .b32 dd, d, c;
                    mov.b32 dd, {$1, $1};
                    sub.rn.f16x2 d, dd, $2;
                    fma.rn.f16x2 c, d, d, $3;
                    min.f16x2 $0, c, $4;
                    }""",
                    "=r,h,r,r,r", [dec, w, cold, best], dtype=tl.int32, is_pure=True, pack=1)
        else:
            if FIRST:
                return tl.inline_asm_elementwise(
                    """{
                    .reg .b32 dd, w0, w1, c0, c1, d0, d1, r0, r1;
                    mov.b32 dd, {$1, $1};
                    mov.b64 {w0, w1}, $2;
                    mov.b64 {c0, c1}, $3;
                    sub.rn.f16x2 d0, dd, w0;
                    sub.rn.f16x2 d1, dd, w1;
                    fma.rn.f16x2 r0, d0, d0, c0;
                    fma.rn.f16x2 r1, d1, d1, c1;
                    mov.b64 $0, {r0, r1};
                    }""",
                    "=li,h,li,li", [dec, w, cold], dtype=tl.int64, is_pure=True, pack=1)
            else:
                return tl.inline_asm_elementwise(
                    """{
                    .reg .b32 dd, w0, w1, c0, c1, b0, b1, d0, d1, r0, r1;
                    mov.b32 dd, {$1, $1};
                    mov.b64 {w0, w1}, $2;
                    mov.b64 {c0, c1}, $3;
                    mov.b64 {b0, b1}, $4;
                    sub.rn.f16x2 d0, dd, w0;
                    sub.rn.f16x2 d1, dd, w1;
                    fma.rn.f16x2 r0, d0, d0, c0;
                    fma.rn.f16x2 r1, d1, d1, c1;
                    min.f16x2 r0, r0, b0;
                    min.f16x2 r1, r1, b1;
                    mov.b64 $0, {r0, r1};
                    }""",
                    "=li,h,li,li,li", [dec, w, cold, best], dtype=tl.int64, is_pure=True, pack=1)

    @triton.jit
    def _lanes_asm2(da, db, w, ca, cb, best, TL: tl.constexpr):
        """Two candidates (codebook values da, db; previous costs ca, cb) of every lane min'd into best in one
        block: min(min(cost a, cost b), best), which ptxas issues as one 3-input VHMNMX per word."""
        if TL == 2:
            return tl.inline_asm_elementwise(
                """{
                .reg .b32 xa, xb, d, e, c, f, m;
                mov.b32 xa, {$1, $1};
                mov.b32 xb, {$2, $2};
                sub.rn.f16x2 d, xa, $3;
                sub.rn.f16x2 e, xb, $3;
                fma.rn.f16x2 c, d, d, $4;
                fma.rn.f16x2 f, e, e, $5;
                min.f16x2 m, c, f;
                min.f16x2 $0, m, $6;
                }""",
                "=r,h,h,r,r,r,r", [da, db, w, ca, cb, best], dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(
                """{
                .reg .b32 xa, xb, w0, w1, a0, a1, b0, b1, m0, m1, d0, d1, e0, e1, c0, c1, f0, f1;
                mov.b32 xa, {$1, $1};
                mov.b32 xb, {$2, $2};
                mov.b64 {w0, w1}, $3;
                mov.b64 {a0, a1}, $4;
                mov.b64 {b0, b1}, $5;
                mov.b64 {m0, m1}, $6;
                sub.rn.f16x2 d0, xa, w0;
                sub.rn.f16x2 d1, xa, w1;
                sub.rn.f16x2 e0, xb, w0;
                sub.rn.f16x2 e1, xb, w1;
                fma.rn.f16x2 c0, d0, d0, a0;
                fma.rn.f16x2 c1, d1, d1, a1;
                fma.rn.f16x2 f0, e0, e0, b0;
                fma.rn.f16x2 f1, e1, e1, b1;
                min.f16x2 c0, c0, f0;
                min.f16x2 c1, c1, f1;
                min.f16x2 c0, c0, m0;
                min.f16x2 c1, c1, m1;
                mov.b64 $0, {c0, c1};
                }""",
                "=li,h,h,li,li,li,li", [da, db, w, ca, cb, best], dtype=tl.int64, is_pure=True, pack=1)

    @triton.jit
    def _lanes_pair(da, db, w, ca, cb, best, TL: tl.constexpr, MODE: tl.constexpr):
        """``_lanes_step`` for two candidates at once (``_lanes_asm2`` in MODE 4)."""
        if MODE == 4:
            return _lanes_asm2(da, db, w, ca, cb, best, TL)
        else:
            return _lanes_step(db, w, cb, _lanes_step(da, w, ca, best, TL, MODE, False), TL, MODE, False)

    @triton.jit
    def _lanes_step(dec, w, cold, best, TL: tl.constexpr, MODE: tl.constexpr, FIRST: tl.constexpr):
        """One candidate of every edge in TL tiles at once (lane words): its cost, min'd into ``best`` unless
        FIRST. MODE 4: f16x2 PTX; MODE 5: lane by lane with the exact emulation (the interpreter)."""
        if MODE == 4:
            return _lanes_asm(dec, w, cold, best, TL, FIRST)
        else:
            out = tl.zeros(dec.shape, dtype=cold.dtype)
            for li in tl.static_range(TL):
                c = _cost(dec, _lane(w, li, TL), _lane(cold, li, TL), 0)
                if not FIRST:
                    c = tl.minimum(c, _lane(best, li, TL))
                out = out | (_lane_bits(c, TL) << (16 * li))
            return out

    @triton.jit
    def _lane_word(xl, p, valid, TL: tl.constexpr):
        """The lane word of trellis position p: x of lane li's tile (rows of 256 floats from ``xl``) as fp16, 0 in
        lanes li >= valid (past the last tile)."""
        if TL == 2:
            word = tl.zeros([], dtype=tl.int32)
        else:
            word = tl.zeros([], dtype=tl.int64)
        for li in tl.static_range(TL):
            v = tl.load(xl + li * 256 + p, mask=li < valid, other=0.0).to(tl.float16)
            word = word | (_lane_bits(v, TL) << (16 * li))
        return word

    @triton.jit
    def _forward_lanes(xl, valid, dec_ptr, cw, START: tl.constexpr, K: tl.constexpr, NL: tl.constexpr,
                       NH: tl.constexpr, BH: tl.constexpr, MODE: tl.constexpr, ROWS: tl.constexpr,
                       STEPS: tl.constexpr, TL: tl.constexpr, UNROLL: tl.constexpr = 4):
        """``_forward_pass`` with cost rows (ROWS 1 or 2) for TL tiles at once: ``cw`` points to the slot's lane
        words (a cost row is E of them), the candidates of an edge are one fp16 codebook value each, read once for
        every lane."""
        E: tl.constexpr = NH * NL
        rows = tl.arange(0, BH)[:, None]
        cols = tl.arange(0, NL)[None, :]
        for t in range(STEPS):
            p = (t + START) % 256
            w = _lane_word(xl, p, valid, TL)
            if ROWS == 1:
                src = cw + t * E
                dst = cw + ((t + 1) % 256) * E
            else:
                src = cw + _row_slot(t) * E
                dst = cw + _row_slot(t + 1) * E
            for hc in range(NH // BH):
                h = hc * BH + rows  # e >> K
                e = h * NL + cols
                cold0 = tl.load(src + h)
                best = _lanes_step(tl.load(dec_ptr + e), w, cold0, cold0, TL, MODE, True)
                for k in tl.range(1, NL - 1, 2, loop_unroll_factor=UNROLL):  # two candidates a time: a 3-input min
                    best = _lanes_pair(tl.load(dec_ptr + k * E + e), tl.load(dec_ptr + (k + 1) * E + e), w,
                                       tl.load(src + k * NH + h), tl.load(src + (k + 1) * NH + h), best, TL, MODE)
                best = _lanes_step(tl.load(dec_ptr + (NL - 1) * E + e), w, tl.load(src + (NL - 1) * NH + h), best, TL,
                                   MODE, False)
                tl.store(dst + e, best)
            tl.debug_barrier()  # the row is visible to the whole CTA before the next step reads it

    @triton.jit
    def _brev5(x):
        return ((x & 1) << 4) | ((x & 2) << 2) | (x & 4) | ((x & 8) >> 2) | ((x & 16) >> 4)

    @triton.jit
    def _back_pointer(bp, p, ed, E: tl.constexpr, PACK4: tl.constexpr):
        """The candidate k stored for edge ``ed`` at position ``p``: a byte, or a nibble when PACK4."""
        if PACK4:
            b = tl.load(bp + p * (E // 2) + (ed >> 1)).to(tl.int32)
            return (b >> ((ed & 1) * 4)) & 15
        else:
            return tl.load(bp + p * E + ed).to(tl.int32)

    @triton.jit
    def _even_row_block(row, j, K: tl.constexpr, NL: tl.constexpr, NH: tl.constexpr, WHOLE: tl.constexpr,
                        S: tl.constexpr = 1):
        """The (NL, NL) costs an odd row's entries j[i] are the minimum of: [i, k] = row[k * NH + (j[i] >> K)].

        WHOLE (K >= 6, 3K >= 16, with j[i] = i * NH + (edge >> K)): j[i] >> K is i >> (3K - 16) whatever the edge,
        so the block is the whole row (one contiguous load), transposed and each of its columns repeated
        2^(3K - 16) times; otherwise NL x NL scattered loads. S: the row's entries are S apart (tile lanes)."""
        if WHOLE:
            R: tl.constexpr = 1 << (3 * K - 16)
            even = tl.load(row + (tl.arange(0, NL)[:, None] * NH + tl.arange(0, NH)[None, :]) * S)
            return tl.reshape(tl.broadcast_to(tl.trans(even)[:, None, :], (NH, R, NL)), (NL, NL))
        else:
            return tl.load(row + (tl.arange(0, NL)[None, :] * NH + (j[:, None] >> K)) * S)

    @triton.jit
    def _traced_k(x_t, dec_ptr, dect_ptr, cs, t, p, ed, K: tl.constexpr, NL: tl.constexpr, NH: tl.constexpr,
                  MODE: tl.constexpr, ROWS: tl.constexpr, DECT: tl.constexpr, S: tl.constexpr = 1):
        """The candidate k step t (position p) kept for edge ``ed``, recomputed from the cost row t it read: its
        NL candidates' costs again, with the same fp16 operations, and the first minimum, as the strict
        less-than in increasing k kept it. With ROWS = 2 an odd row t is not kept: its NL entries are those
        step t - 1 computed, each the minimum of its NL candidates over the even row t - 1 (min is exact).

        DECT: the codebook values come from the edge-major table (``codebook.edge_major_table``: an edge's NL
        candidates side by side), one or a few cache lines a step, instead of NL values 2^(16-K) apart in the
        state-major table (NL lines, and NL x NL of them at an odd row). S: cost entries S apart (a tile lane's fp16
        in lane words of S tiles; ``cs`` points to the lane's first)."""
        E: tl.constexpr = NH * NL
        M: tl.constexpr = 0 if MODE == 0 or MODE == 5 else 1
        kk = tl.arange(0, NL)
        w = tl.load(x_t + p).to(tl.float16)
        if DECT:
            dec = tl.load(dect_ptr + ed * NL + kk)
        else:
            dec = tl.load(dec_ptr + kk * E + ed)
        j = kk * NH + (ed >> K)  # the entries of row t that edge ed's candidates read
        if ROWS == 2:
            if t % 2 == 1:
                w1 = tl.load(x_t + (p + 255) % 256).to(tl.float16)  # step t - 1's position
                k2 = tl.arange(0, NL)[None, :]
                if DECT:  # row j of the edge-major table: edge j's NL candidates
                    dec2 = tl.load(dect_ptr + j[:, None] * NL + k2)
                else:
                    dec2 = tl.load(dec_ptr + k2 * E + j[:, None])
                c2 = _even_row_block(cs + ((t - 1) // 2) * E * S, j, K, NL, NH, DECT and 3 * K >= 16, S)
                # tl.min without indices reduces fp16 in fp32: back to fp16 (exact) so both branches agree
                cold = tl.min(_cost(dec2, w1, c2, M), axis=1).to(tl.float16)
            else:
                cold = tl.load(cs + ((t // 2) * E + j) * S)
        else:
            cold = tl.load(cs + (t * E + j) * S)
        c = _cost(dec, w, cold, M)
        _, k = tl.min(c, axis=0, return_indices=True, return_indices_tie_break_left=True)
        return k.to(tl.int32)

    @triton.jit
    def _traced_k_lanes(xl, valid, dec_ptr, dect_ptr, c16, t, p, ed, K: tl.constexpr, NL: tl.constexpr,
                        NH: tl.constexpr, MODE: tl.constexpr, DECT: tl.constexpr, TL: tl.constexpr):
        """``_traced_k`` (every cost row kept) for the TL lanes at once: ``ed`` is each lane's edge ([TL]), the
        candidates a [TL, NL] block, so the TL tracebacks of a program take the time of one (lanes >= valid, past
        the last tile, read x = 0)."""
        E: tl.constexpr = NH * NL
        M: tl.constexpr = 0 if MODE == 0 or MODE == 5 else 1
        lanes = tl.arange(0, TL)[:, None]
        kk = tl.arange(0, NL)[None, :]
        ed2 = ed[:, None]
        w = tl.load(xl + lanes * 256 + p, mask=lanes < valid, other=0.0).to(tl.float16)
        if DECT:
            dec = tl.load(dect_ptr + ed2 * NL + kk)
        else:
            dec = tl.load(dec_ptr + kk * E + ed2)
        cold = tl.load(c16 + (t * E + kk * NH + (ed2 >> K)) * TL + lanes)
        _, k = tl.min(_cost(dec, w, cold, M), axis=1, return_indices=True, return_indices_tie_break_left=True)
        return k.to(tl.int32)

    # the launch's integers are plain arguments, not specialised on (divisibility by 16, == 1): otherwise each
    # new combination of chunk start, chunk size, tile columns and weight columns compiled the kernel again (a
    # second on a server's first call of a new layer shape)
    @triton.jit(do_not_specialize=["n_tiles", "first_tile", "tiles_n", "n_cols"])
    def _viterbi_kernel(x_ptr, dec_ptr, dect_ptr, cs_ptr, bp_ptr, idx_ptr, val_ptr, n_tiles, off_ptr, first_tile,
                        tiles_n, n_cols,
                        K: tl.constexpr, NL: tl.constexpr, NH: tl.constexpr, BH: tl.constexpr,
                        KC: tl.constexpr, MODE: tl.constexpr, PACK4: tl.constexpr, MATRIX: tl.constexpr,
                        ROWS: tl.constexpr, DECT: tl.constexpr, TL: tl.constexpr = 1):
        """Persistent programs, one scratch slot each, tiles pid, pid + G, ... (G programs): per tile pass 1,
        end-edge choice, traceback, constrained pass 2, traceback. The scratch is G slots, whatever n_tiles.

        MATRIX: x_ptr is a row-major (k, n_cols) weight and the tiles are its flat tiles first_tile, +1, ...
        (tiles_n per tile row); element p of a tile sits at off[p] from the tile's corner. Each tile is copied
        into its slot's row of val_ptr (G x 256), quantized from there, and its squared error (x - q)^2 written
        over it in the weight (fp32) instead of writing the values q; the states go to idx_ptr in launch order
        as always."""
        E: tl.constexpr = NH * NL
        SLOT: tl.constexpr = 0 if ROWS else 256 * (E // 2 if PACK4 else E)  # back-pointer bytes per slot
        NROWS: tl.constexpr = 256 if ROWS == 1 else (129 if ROWS == 2 else 2)  # geometry.slot_cost_rows(ROWS)
        pid = tl.program_id(0)
        cs = cs_ptr + pid.to(tl.int64) * (NROWS * E)
        bp = bp_ptr + pid.to(tl.int64) * SLOT
        rows = tl.arange(0, BH)[:, None]
        cols = tl.arange(0, NL)[None, :]
        zero64 = pid.to(tl.int64) * 0  # 64-bit tile offsets in compiled code and under the interpreter alike
        if TL == 1:
            for tile in range(pid, n_tiles, tl.num_programs(0)):
                t64 = tile + zero64
                if MATRIX:  # the tile is copied into the slot's values row (a gather of 256 in parallel): the
                    # passes then read x_t[p] as for gathered tiles, not a dependent offset load per step
                    g64 = t64 + first_tile
                    row = g64 // tiles_n
                    x_m = x_ptr + row * 16 * n_cols + (g64 - row * tiles_n) * 16
                    pos = tl.arange(0, 256)
                    x_t = val_ptr + pid * 256
                    tl.store(x_t + pos, tl.load(x_m + tl.load(off_ptr + pos)))
                    tl.debug_barrier()
                else:
                    x_t = x_ptr + t64 * 256

                # pass 1 (unconstrained): C = 0 makes the first step fma16(d, d, 0) = f16(d*d)
                for hc in range(NH // BH):
                    e = (hc * BH + rows) * NL + cols
                    tl.store(cs + e, tl.zeros([BH, NL], dtype=tl.float16))
                tl.debug_barrier()
                _forward_pass(x_t, dec_ptr, cs, bp, 128, K, NL, NH, BH, KC, MODE, PACK4, ROWS, 256)

                # end edge: min over (bits(C[e]), rank(e)); costs are >= +0 so bit order is value order
                best_key = tl.full([], 0x7FFFFFFF, tl.int32)
                for hc in range(NH // BH):
                    e = (hc * BH + rows) * NL + cols
                    cb = tl.load(cs + e).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
                    rank = (_brev5((e >> 5) & 31) << 10) | (_brev5(e & 31) << 5) | (e >> 10)
                    best_key = tl.minimum(best_key, tl.min(tl.min((cb << 16) | rank, axis=1), axis=0))
                r = best_key & 0xFFFF
                e_star = ((r & 31) << 10) | (_brev5((r >> 10) & 31) << 5) | _brev5((r >> 5) & 31)
                e_star = tl.where((best_key >> 16) >= 0x7C00, 0, e_star)

                # partial traceback of pass 1 over positions 127..0 gives E_fix
                ed = e_star
                for i in range(128):
                    p = 127 - i
                    if ROWS:  # pass 1 visited position p at step p + 128
                        k = _traced_k(x_t, dec_ptr, dect_ptr, cs, p + 128, p, ed, K, NL, NH, MODE, ROWS, DECT)
                    else:
                        k = _back_pointer(bp, p, ed, E, PACK4)
                    ed = k * NH + (ed >> K)
                e_fix = ed
                tl.debug_barrier()

                # pass 2 (constrained): C = 0 at E_fix, +inf elsewhere, so the first step gives f16(d*d) or +inf
                for hc in range(NH // BH):
                    e = (hc * BH + rows) * NL + cols
                    tl.store(cs + e, tl.where(e == e_fix, 0.0, float("inf")).to(tl.float16))
                tl.debug_barrier()
                # with ROWS the last step is left out: its costs (row 256, which is row 0) are never read, and row 0
                # must keep the constraint for the traceback's last position
                _forward_pass(x_t, dec_ptr, cs, bp, 0, K, NL, NH, BH, KC, MODE, PACK4, ROWS, 255 if ROWS else 256)

                # final traceback from E_fix, closing the ring
                ed = e_fix
                for i in range(256):
                    p = 255 - i
                    if ROWS:
                        k = _traced_k(x_t, dec_ptr, dect_ptr, cs, p, p, ed, K, NL, NH, MODE, ROWS, DECT)
                    else:
                        k = _back_pointer(bp, p, ed, E, PACK4)
                    s = (k << (16 - K)) | ed
                    tl.store(idx_ptr + t64 * 256 + p, s.to(tl.int16))
                    q = tl.load(dec_ptr + s).to(tl.float32)
                    if MATRIX:  # the values replace the copy of the tile in the slot's row (the passes are done)
                        tl.store(x_t + p, q)
                    else:
                        tl.store(val_ptr + t64 * 256 + p, q)
                    ed = k * NH + (ed >> K)
                tl.debug_barrier()  # the slot's back-pointers are read to the end before the next tile writes them
                if MATRIX:
                    # one thread per element reads x and q and writes (x - q)^2 in x's place (a scalar read-modify-
                    # write in the traceback would race between warps, each running it for the same element)
                    xp = x_m + tl.load(off_ptr + pos)
                    d = tl.load(xp) - tl.load(x_t + pos)
                    tl.store(xp, d * d)
                    tl.debug_barrier()  # the slot's values row is read before the next tile writes it
        else:
            # TL tiles per program, one in each lane of the cost rows' lane words (``_forward_lanes``); the tracebacks
            # read lane li's fp16 costs TL apart. Groups grp, grp + G, ... of TL consecutive tiles; the last may be
            # partial: its lanes past the last tile compute on zeros and write nothing
            WT: tl.constexpr = tl.int32 if TL == 2 else tl.int64
            n_groups = (n_tiles + TL - 1) // TL
            lanes = tl.arange(0, TL)
            cw = cs_ptr.to(tl.pointer_type(WT)) + pid.to(tl.int64) * (NROWS * E)
            c16 = cs_ptr + pid.to(tl.int64) * (NROWS * E * TL)
            pos = tl.arange(0, 256)
            for grp in range(pid, n_groups, tl.num_programs(0)):
                t0 = (grp + zero64) * TL  # the group's first tile
                valid = tl.minimum(n_tiles - t0, TL)
                if MATRIX:  # lane li's tile copied into the slot's values row li
                    xl = val_ptr + pid * (256 * TL)
                    for li in tl.static_range(TL):
                        if li < valid:
                            g64 = t0 + li + first_tile
                            row = g64 // tiles_n
                            x_m = x_ptr + row * 16 * n_cols + (g64 - row * tiles_n) * 16
                            tl.store(xl + li * 256 + pos, tl.load(x_m + tl.load(off_ptr + pos)))
                    tl.debug_barrier()
                else:
                    xl = x_ptr + t0 * 256

                # pass 1 (unconstrained), every lane
                for hc in range(NH // BH):
                    e = (hc * BH + rows) * NL + cols
                    tl.store(cw + e, tl.zeros([BH, NL], dtype=WT))
                tl.debug_barrier()
                _forward_lanes(xl, valid, dec_ptr, cw, 128, K, NL, NH, BH, MODE, ROWS, 256, TL)

                # each lane's end edge, then the partial tracebacks (every lane at once with every row kept): E_fix
                e_fix = tl.zeros([TL], dtype=tl.int32)
                for ln in range(TL):
                    best_key = tl.full([], 0x7FFFFFFF, tl.int32)
                    for hc in range(NH // BH):
                        e = (hc * BH + rows) * NL + cols
                        cb = ((tl.load(cw + e) >> (16 * ln)) & 0xFFFF).to(tl.int32)
                        rank = (_brev5((e >> 5) & 31) << 10) | (_brev5(e & 31) << 5) | (e >> 10)
                        best_key = tl.minimum(best_key, tl.min(tl.min((cb << 16) | rank, axis=1), axis=0))
                    r = best_key & 0xFFFF
                    e_star = ((r & 31) << 10) | (_brev5((r >> 10) & 31) << 5) | _brev5((r >> 5) & 31)
                    e_fix = tl.where(lanes == ln, tl.where((best_key >> 16) >= 0x7C00, 0, e_star), e_fix)
                if ROWS == 1:
                    for i in range(128):
                        p = 127 - i
                        k = _traced_k_lanes(xl, valid, dec_ptr, dect_ptr, c16, p + 128, p, e_fix, K, NL, NH, MODE,
                                            DECT, TL)
                        e_fix = k * NH + (e_fix >> K)
                else:
                    for ln in range(TL):
                        if ln < valid:
                            ed = tl.sum(tl.where(lanes == ln, e_fix, 0))
                            for i in range(128):
                                p = 127 - i
                                k = _traced_k(xl + ln * 256, dec_ptr, dect_ptr, c16 + ln, p + 128, p, ed, K, NL, NH,
                                              MODE, ROWS, DECT, TL)
                                ed = k * NH + (ed >> K)
                            e_fix = tl.where(lanes == ln, ed, e_fix)
                tl.debug_barrier()

                # pass 2 (constrained): lane li's costs 0 at its E_fix, +inf elsewhere
                for hc in range(NH // BH):
                    e = (hc * BH + rows) * NL + cols
                    word = tl.zeros([BH, NL], dtype=WT)
                    for li in tl.static_range(TL):
                        ef = tl.sum(tl.where(lanes == li, e_fix, 0))
                        word = word | (tl.where(e == ef, 0, 0x7C00).to(WT) << (16 * li))
                    tl.store(cw + e, word)
                tl.debug_barrier()
                _forward_lanes(xl, valid, dec_ptr, cw, 0, K, NL, NH, BH, MODE, ROWS, 255, TL)

                # each lane's final traceback from its E_fix (every lane at once with every row kept)
                if ROWS == 1:
                    ed = e_fix
                    live = lanes < valid
                    for i in range(256):
                        p = 255 - i
                        k = _traced_k_lanes(xl, valid, dec_ptr, dect_ptr, c16, p, p, ed, K, NL, NH, MODE, DECT,
                                            TL)
                        s = (k << (16 - K)) | ed
                        tl.store(idx_ptr + (t0 + lanes) * 256 + p, s.to(tl.int16), mask=live)
                        q = tl.load(dec_ptr + s).to(tl.float32)
                        if MATRIX:
                            tl.store(xl + lanes * 256 + p, q, mask=live)
                        else:
                            tl.store(val_ptr + (t0 + lanes) * 256 + p, q, mask=live)
                        ed = k * NH + (ed >> K)
                else:
                    for ln in range(TL):
                        if ln < valid:
                            ed = tl.sum(tl.where(lanes == ln, e_fix, 0))
                            tile = t0 + ln
                            for i in range(256):
                                p = 255 - i
                                k = _traced_k(xl + ln * 256, dec_ptr, dect_ptr, c16 + ln, p, p, ed, K, NL, NH, MODE,
                                              ROWS, DECT, TL)
                                s = (k << (16 - K)) | ed
                                tl.store(idx_ptr + tile * 256 + p, s.to(tl.int16))
                                q = tl.load(dec_ptr + s).to(tl.float32)
                                if MATRIX:
                                    tl.store(xl + ln * 256 + p, q)
                                else:
                                    tl.store(val_ptr + tile * 256 + p, q)
                                ed = k * NH + (ed >> K)
                tl.debug_barrier()
                if MATRIX:
                    for li in tl.static_range(TL):
                        if li < valid:
                            g64 = t0 + li + first_tile
                            row = g64 // tiles_n
                            x_m = x_ptr + row * 16 * n_cols + (g64 - row * tiles_n) * 16
                            xp = x_m + tl.load(off_ptr + pos)
                            d = tl.load(xp) - tl.load(xl + li * 256 + pos)
                            tl.store(xp, d * d)
                    tl.debug_barrier()


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def interpreter_active() -> bool:
    """True when this module's kernel was built by Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    if not _HAVE_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_viterbi_kernel, InterpretedFunction)


def selfcheck_results() -> dict[tuple[str, int], int]:
    """Mode in use per (device, bits) after the self-check: the tuning's ``viterbi_mode`` unless the check failed."""
    return {(dev, bits): mode for (dev, bits, _), mode in _CHECKED.items()}


def _mode_in_use(bits: int, tuning: Tuning) -> int:
    """The mode a launch at K = ``bits`` runs: the self-checked one where a check ran, else the tuning's."""
    wanted = tuning.viterbi_mode
    return next((m for (_, b, w), m in _CHECKED.items() if b == bits and w == wanted), wanted)


def _checked_default_mode(device: torch.device, bits: int, codebook: str, num_warps: int | None,
                          block_edges: int | None, tuning: Tuning) -> int:
    """``tuning.viterbi_mode``, once checked on this device and bit width against mode 1 on fresh random tiles.

    Mode 1 uses only a scalar ``fma.rn.f16`` plus Triton's own fp16 compare/select; the default packs
    two edges per register with set/lop3 tricks. If they ever disagree, warn and fall back to mode 1.
    Disable with EXL3TOOL_VITERBI_SELFCHECK=0.
    """
    key = (str(device), bits, tuning.viterbi_mode)
    if key in _CHECKED:
        return _CHECKED[key]
    mode = tuning.viterbi_mode
    if mode != 1 and tuning.viterbi_selfcheck:
        x = torch.randn(8, 256, device=device) * (0.5 + torch.rand(8, 1, device=device))
        kw = dict(num_warps=num_warps, block_edges=block_edges)
        # the tiles per program of a large launch (8 tiles alone would run one per program)
        lanes = _tile_lanes(bits, mode, keeps_rows(bits, mode, tuning), 1 << 30, tuning, None, _sm_count(device))
        _, s_default = viterbi_tiles(x, bits, codebook, mode=mode, tuning=tuning, lanes=lanes, **kw)
        _, s_plain = viterbi_tiles(x, bits, codebook, mode=1, tuning=tuning, **kw)
        if not torch.equal(s_default, s_plain):
            warnings.warn(f"viterbi kernel mode {mode} disagrees with mode 1 on {device} at K={bits}; "
                          "falling back to mode 1", RuntimeWarning, stacklevel=3)
            mode = 1
    _CHECKED[key] = mode
    return mode


_RESIDENT: dict[tuple[str, int, Tuning], int | None] = {}


def resident_tiles(device: torch.device, bits: int, codebook: str = "mcg", tuning: Tuning | None = None) -> int | None:
    """Tiles the GPU runs at once (CTAs per SM from the kernel's registers, threads and shared memory, times
    the SM count): the encoder's memory plan gives at least this many slots where its budget allows. None where it
    cannot be told (no CUDA)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not _HAVE_TRITON or interpreter_active():
        return None
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    tuning = tuning or current_tuning()
    key = (str(dev), bits, tuning)
    if key not in _RESIDENT:
        x = torch.randn(8, 256, device=dev)
        mode = _check_launch(x, bits, codebook, None, None, None, None, "resident_tiles", tuning)  # self-checks
        values = torch.empty_like(x)
        states = torch.empty((8, 256), dtype=torch.int16, device=dev)
        # the variant a launch over many tiles runs: its tiles per program with slots to spare
        lanes = _tile_lanes(bits, mode, keeps_rows(bits, mode, tuning), 1 << 30, tuning, None, _sm_count(dev))
        compiled = _launch(x, 8, bits, codebook, mode, None, None, DEFAULT_SCRATCH_BYTES, None, states, values,
                           tuning=tuning, lanes=lanes)
        programs = _occupancy(compiled, torch.cuda.get_device_properties(dev))
        _RESIDENT[key] = programs * lanes if programs else programs
    return _RESIDENT[key]


def _occupancy(compiled, props) -> int | None:
    """CTAs per SM x SMs for one compiled kernel (one tile per CTA), or None if Triton hides the figures."""
    regs = getattr(compiled, "n_regs", None)
    meta = getattr(compiled, "metadata", None)
    warps = getattr(meta, "num_warps", None)
    if not regs or not warps:
        return None
    shared = int(getattr(meta, "shared", 0) or 0)
    threads_sm = int(getattr(props, "max_threads_per_multi_processor", 2048))
    regs_sm = int(getattr(props, "regs_per_multiprocessor", 65536))
    smem_sm = int(getattr(props, "shared_memory_per_multiprocessor", 228 * 1024))
    regs_per_warp = -(-int(regs) * 32 // 256) * 256  # allocated per warp in units of 256 registers
    by_regs = (regs_sm // regs_per_warp) // int(warps)
    by_threads = threads_sm // (32 * int(warps))
    by_smem = smem_sm // (shared + 1024) if shared else 32  # 1 KiB reserved per CTA on sm_80+
    per_sm = max(1, min(32, by_regs, by_threads, by_smem))
    return per_sm * int(props.multi_processor_count)


def keeps_rows(bits: int, mode: int | None = None, tuning: Tuning | None = None) -> int:
    """Which cost rows the kernel keeps instead of back-pointers: 0 (none: back-pointers), 1 (every step's) or
    2 (every other step's), ``geometry.cost_row_stride``, in the packed modes 4 and 5 only. With rows a candidate
    is sub, fma and min (3 instructions per two, not 5), and the traceback recomputes the kept candidate from
    the row (an odd row from the even row before it, with 2 only). ``mode`` None: the tuning's."""
    tuning = tuning or current_tuning()
    mode = tuning.viterbi_mode if mode is None else mode
    return cost_row_stride(bits, tuning) if mode >= 4 else 0


def _row_stride(bits: int, rows: bool | int) -> int:
    """``rows`` as the kernel's ROWS (False/True are 0/1), checked."""
    if rows not in (0, 1, 2):
        raise ValueError(f"rows must be 0 (back-pointers), 1 (every cost row) or 2 (every other), got {rows!r}")
    if rows == 2 and bits > MAX_HALF_ROW_BITS:
        raise ValueError(f"rows=2 recomputes 2^(2K) costs per traceback step: K <= {MAX_HALF_ROW_BITS} only, "
                         f"got K={bits}")
    return int(rows)


def row_choices(bits: int, mode: int | None = None, tuning: Tuning | None = None) -> dict[int, int]:
    """{rows: a slot's bytes} for the cost rows the kernel can keep at K = ``bits`` in ``mode`` (None: the mode in
    use on the current device): every row and every other at the K of HALF_ROW_BITS, every row at the other K of
    COST_ROW_BITS, back-pointers elsewhere. What an encode's memory plan chooses from."""
    tuning = tuning or current_tuning()
    if mode is None:
        mode = _mode_in_use(bits, tuning)
    default = keeps_rows(bits, mode, tuning)
    strides = (1, 2) if default == 2 else (default,)
    return {r: slot_bytes(bits, mode, r, tuning) for r in strides}


def packs_nibbles(bits: int, mode: int | None = None) -> bool:
    """Whether the kernel keeps two back-pointers per byte: K <= 4 (k < 16) in the packed modes 4 and 5 (None: the
    mode of ``current_tuning()``)."""
    mode = current_tuning().viterbi_mode if mode is None else mode
    return bits <= 4 and mode >= 4


def slot_bytes(bits: int, mode: int | None = None, rows: bool | int | None = None,
               tuning: Tuning | None = None) -> int:
    """GPU scratch of one tile in flight (``viterbi_slot_bytes``) for ``mode``; None: the mode in use on the
    current device after its self-check, or the tuning's before it ran. ``rows``: back-pointers (0), every cost
    row (1) or every other (2); None: ``keeps_rows``."""
    tuning = tuning or current_tuning()
    if mode is None:
        mode = _mode_in_use(bits, tuning)
    rows = keeps_rows(bits, mode, tuning) if rows is None else _row_stride(bits, rows)
    return viterbi_slot_bytes(bits, packs_nibbles(bits, mode), rows=rows, tuning=tuning)


def _geometry(bits: int, block_edges: int | None) -> tuple[int, int, int]:
    """(NL, NH, BH): candidates per edge, edge rows (e >> K) and rows per block chunk."""
    nl = 1 << bits
    nh = 1 << (16 - 2 * bits)
    be = block_edges if block_edges is not None else 1024
    bh = max(1, min(nh, be // nl))
    return nl, nh, bh


def _check_launch(x: torch.Tensor, bits: int, codebook: str, mode: int | None, num_warps: int | None,
                  block_edges: int | None, programs: int | None, what: str, tuning: Tuning) -> int:
    """Validate the arguments both entry points share; returns the kernel mode."""
    if not _HAVE_TRITON:
        raise RuntimeError(f"{what} needs triton")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    check_codebook(codebook)
    interp = interpreter_active()
    if not x.is_cuda and not interp:
        raise ValueError(f"{what} needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1)")
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
        raise ValueError(f"programs must be a positive integer, got {programs!r}")
    if mode is None:
        mode = 0 if interp else _checked_default_mode(x.device, bits, codebook, num_warps, block_edges, tuning)
    if mode not in MODES or (interp and mode not in (0, 5)):
        raise ValueError(f"mode must be one of {MODES} (0 or 5 under the interpreter), got {mode!r}")
    return mode


def viterbi_tiles(
    tiles: torch.Tensor,
    bits: int,
    codebook: str = "mcg",
    *,
    mode: int | None = None,
    num_warps: int | None = None,
    block_edges: int | None = None,
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
    programs: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows: bool | int | None = None,
    edge_major: bool | None = None,
    tuning: Tuning | None = None,
    lanes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize (n, 256) float32 tiles (trellis order) to EXL3 states; same contract as quantize_tiles.

    Returns (values float32 (n, 256), states int16 (n, 256)) on the input's device, written into ``out``
    (contiguous tensors of those shapes) when given. Runs on CUDA tensors, or on CPU tensors when the Triton
    interpreter is active. ``mode``/``num_warps``/``block_edges`` select kernel variants (for benchmarking);
    results never depend on them. ``programs`` is how many tiles are in flight at once, each with its own
    scratch slot (``slot_bytes``); None: as many as ``scratch_bytes`` holds. Results never depend on it either,
    nor on ``rows`` (0: back-pointers, 1: every cost row, 2: every other; 1 and 2 in modes 4 and 5 only; None:
    ``keeps_rows``). ``tuning``: the speed rules and the default mode (None: ``knobs.current_tuning()``).
    ``lanes``: tiles per program, one in each lane of its f16x2 cost words (1, 2 or 4; cost rows only; None: the
    tuning's ``viterbi_lanes``); results never depend on it.
    """
    if not isinstance(tiles, torch.Tensor):
        raise ValueError(f"tiles must be a torch.Tensor, got {type(tiles).__name__}")
    if tiles.dtype != torch.float32:
        raise ValueError(f"tiles must be float32, got {tiles.dtype}")
    if tiles.dim() != 2 or tiles.shape[1] != 256:
        raise ValueError(f"tiles must have shape (n, 256), got {tuple(tiles.shape)}")
    tuning = tuning or current_tuning()
    mode = _check_launch(tiles, bits, codebook, mode, num_warps, block_edges, programs, "viterbi_tiles", tuning)
    dev = tiles.device
    n = tiles.shape[0]
    if out is not None:
        values, states = out
        for t, dtype in ((values, torch.float32), (states, torch.int16)):
            if t.shape != (n, 256) or t.dtype != dtype or not t.is_contiguous() or t.device != dev:
                raise ValueError(f"out tensors must be contiguous ({n}, 256) float32 and int16 on {dev}")
    else:
        values = torch.empty((n, 256), dtype=torch.float32, device=dev)
        states = torch.empty((n, 256), dtype=torch.int16, device=dev)
    if n:
        _launch(tiles.contiguous(), n, bits, codebook, mode, num_warps, block_edges, scratch_bytes,
                programs, states, values, rows=rows, edge_major=edge_major, tuning=tuning, lanes=lanes)
    return values, states


def viterbi_matrix(
    weight: torch.Tensor,
    first_tile: int,
    n_tiles: int,
    bits: int,
    codebook: str = "mcg",
    *,
    states: torch.Tensor | None = None,
    programs: int | None = None,
    mode: int | None = None,
    num_warps: int | None = None,
    block_edges: int | None = None,
    rows: bool | int | None = None,
    edge_major: bool | None = None,
    tuning: Tuning | None = None,
    lanes: int | None = None,
) -> torch.Tensor:
    """Quantize the flat tiles ``first_tile`` .. ``first_tile + n_tiles - 1`` (row-major over the 16 x 16 tiles)
    of a contiguous (k, n) float32 ``weight`` where they lie, and overwrite each with its squared error
    (W - Q)^2 in fp32. Returns their states (n_tiles, 256) int16 (into ``states`` when given).

    What ``viterbi_tiles`` on the gathered tiles gives, without gathering them: an encode's chunk then needs
    only its states besides the kernel's scratch (no gathered tiles, index or values: 8 KiB per tile less), so
    a small layer goes through in one launch within the reference's memory. Each slot's scratch has a 1 KiB row
    more (the values of the tile in flight).
    """
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError("weight must be a 2-D float32 tensor")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous (row-major)")
    k, n = weight.shape
    total = (k // 16) * (n // 16)
    if k % 16 or n % 16 or not 0 <= first_tile <= first_tile + n_tiles <= total:
        raise ValueError(f"tiles {first_tile}..{first_tile + n_tiles - 1} are not tiles of a ({k}, {n}) weight")
    tuning = tuning or current_tuning()
    mode = _check_launch(weight, bits, codebook, mode, num_warps, block_edges, programs, "viterbi_matrix", tuning)
    dev = weight.device
    if states is None:
        states = torch.empty((n_tiles, 256), dtype=torch.int16, device=dev)
    elif states.shape != (n_tiles, 256) or states.dtype != torch.int16 or not states.is_contiguous():
        raise ValueError(f"states must be a contiguous ({n_tiles}, 256) int16 tensor")
    if n_tiles:
        _launch(weight, n_tiles, bits, codebook, mode, num_warps, block_edges, DEFAULT_SCRATCH_BYTES,
                programs, states, None, matrix=(first_tile, n // 16, n), rows=rows, edge_major=edge_major,
                tuning=tuning, lanes=lanes)
    return states


_WAVES: dict[tuple, int | None] = {}


def _resident_wave(dev: torch.device, meta: dict, x: torch.Tensor, dec: torch.Tensor, dec_t: torch.Tensor,
                   states: torch.Tensor, values: torch.Tensor | None) -> int | None:
    """Programs of the kernel variant ``meta`` the GPU keeps resident at once (``_occupancy``), from the compiled
    kernel (compiled here, without a launch, the first time: scratch arguments are stand-ins, which specialise the
    same); None where Triton hides the figures."""
    key = (str(dev), tuple(sorted(meta.items())))
    if key not in _WAVES:
        wave = None
        try:
            f16, u8, f32 = (torch.empty(1, dtype=t, device=dev) for t in (torch.float16, torch.uint8, torch.float32))
            off = dec if not meta["MATRIX"] else torch.empty(1, dtype=torch.int32, device=dev)
            compiled = _viterbi_kernel.warmup(x, dec, dec_t, f16, u8, states, values if values is not None else f32,
                                              1, off, 0, 1, 1, grid=(1,), **meta)
            getattr(compiled, "run", None)  # loads the binary: registers and shared memory become known
            wave = _occupancy(compiled, torch.cuda.get_device_properties(dev))
        except Exception:  # noqa: BLE001 - an older or newer Triton without warmup: no cap, same results
            wave = None
        _WAVES[key] = wave
    return _WAVES[key]


_SMS: dict[str, int] = {}


def _sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (132 on an H200); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    key = str(device)
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[key]


_OFFSETS: dict[tuple[str, int], torch.Tensor] = {}


def _even_rounds(n: int, g: int, sms: int) -> int:
    """Programs for n tiles on at most g: as few as take the same rounds (ceil(n / g) tiles a program), in whole
    waves of ``sms``. A launch whose last round is nearly empty (3,885 tiles on 964 programs: 4 full rounds and
    27 tiles) then runs every round at fewer programs per SM, each faster, instead of a tail of a few."""
    rounds = -(-n // g)
    fewer = -(-n // rounds)
    return min(g, -(-fewer // sms) * sms)


def _tile_offsets(device: torch.device, n_cols: int) -> torch.Tensor:
    """int32 offset of trellis position p from its tile's corner in a row-major matrix with ``n_cols`` columns."""
    key = (str(device), n_cols)
    if key not in _OFFSETS:
        from exl3tool.format.layout import TENSOR_CORE_PERM

        perm = TENSOR_CORE_PERM.to(torch.int64)
        _OFFSETS[key] = ((perm // 16) * n_cols + perm % 16).to(device=device, dtype=torch.int32)
    return _OFFSETS[key]


def _tile_lanes(bits: int, mode: int, rows: int, slots: int, tuning: Tuning, lanes: int | None,
                sms: int = 1) -> int:
    """Tiles per program (``TL``): ``lanes``, with cost rows in the packed modes only, and no more than the slots in
    flight (each tile keeps its own slot's bytes: a program of TL tiles takes TL slots). None: the tuning's
    ``viterbi_lanes``, at most 2 with every other row kept (its traceback recomputes an odd row lane by lane), and
    fewer where TL would leave less than one program per SM of the ``sms``."""
    want = tuning.viterbi_lanes if lanes is None else lanes
    if want not in (1, 2, 4):
        raise ValueError(f"lanes must be 1, 2 or 4 tiles per program, got {want!r}")
    if want > 1 and (not rows or mode < 4):
        if lanes is not None:
            raise ValueError(f"lanes={lanes} needs cost rows (rows 1 or 2) in mode 4 or 5, got rows={rows}, "
                             f"mode {mode}")
        return 1
    if lanes is None:
        if rows == 2:
            want = min(want, 2)
        while want > 1 and slots < want * sms:
            want //= 2
    while want > 1 and want > slots:
        want //= 2
    return want


def _launch(x: torch.Tensor, n: int, bits: int, codebook: str, mode: int, num_warps: int | None,
            block_edges: int | None, scratch_bytes: int, programs: int | None,
            states: torch.Tensor, values: torch.Tensor | None,
            matrix: tuple[int, int, int] | None = None, rows: bool | int | None = None,
            edge_major: bool | None = None, tuning: Tuning | None = None, lanes: int | None = None):
    """Scratch for G = min(n, programs) slots and one launch of the persistent kernel over n tiles of ``x``
    (gathered tiles, or a matrix when ``matrix`` = (first tile, tiles per row, columns)); ``rows``: keep cost
    rows instead of back-pointers (None: ``keeps_rows``); ``edge_major``: the traceback reads the edge-major
    codebook table (None: ``tuning.edge_major_traceback``; used with rows only). Returns Triton's compiled kernel (its
    registers and shared memory give ``resident_tiles``)."""
    tuning = tuning or current_tuning()
    interp = interpreter_active()
    dev = x.device
    dec = codebook_table(codebook, dev)
    nl, nh, bh = _geometry(bits, block_edges if block_edges is not None or not interp else 1 << (16 - bits))
    if rows is None:
        rows = keeps_rows(bits, mode, tuning)
    else:
        rows = _row_stride(bits, rows)
        if rows and mode < 4:
            raise ValueError(f"rows={rows} needs one of the packed modes 4 or 5, got mode {mode}")
    pack4 = packs_nibbles(bits, mode)
    dect = bool(tuning.edge_major_traceback if edge_major is None else edge_major) and bool(rows)
    dec_t = edge_major_table(codebook, bits, dev) if dect else dec  # dec: unused
    per_slot = slot_bytes(bits, mode, rows, tuning)
    slots = max(1, min(n, programs if programs is not None else scratch_bytes // per_slot))
    tl_ = _tile_lanes(bits, mode, rows, slots, tuning, lanes, 1 if interp else _sm_count(dev))
    n_groups = -(-n // tl_)  # programs run groups of tl_ tiles, one per lane (the last may be partial)
    g = max(1, min(n_groups, slots // tl_))
    if tuning.even_rounds and g < n_groups and not interp:
        g = _even_rounds(n_groups, g, _sm_count(dev))
    if num_warps is None:  # about 8 edges per thread: 4 warps for a 1024-edge block, fewer for K = 7, 8; at K = 4
        # 8 warps (4 edges per thread) for the back-pointer kernel (+8 % at 4 programs per SM on an H200) and for
        # the cost-row kernel below 4 programs per SM (2 per SM: 217 K against 200 K tiles/s), 4 from there (4 per
        # SM: 251 K against 239 K; 12: 282 K against 241 K; benchmarks/bench_viterbi_slots.py). Keeping every other
        # row, 8 warps fit only 2 programs per SM: up to 3 per SM 8 warps (2: 210 K against 162 K, 3: 196 K against
        # 186 K), from 4 per SM 4 warps (4: 229 K against 213 K, 5: 251 K against 206 K; the same run)
        wide_below = 3 * _sm_count(dev) + 1 if rows == 2 else 4 * _sm_count(dev)
        k4_wide = bits == 4 and not interp and tl_ == 1 and (not rows or g < wide_below)
        num_warps = 8 if k4_wide else max(1, min(4, (bh * nl) // 256))
    kc = nl if interp else 1  # the interpreter takes all 2^K candidates of a step as one block (fewer, larger ops)
    e = nl * nh
    meta = dict(K=bits, NL=nl, NH=nh, BH=bh, KC=kc, MODE=mode, PACK4=pack4, MATRIX=matrix is not None, ROWS=rows,
                DECT=dect, TL=tl_, num_warps=num_warps)
    guard = torch.cuda.device(dev) if dev.type == "cuda" else _NullContext()
    if tuning.resident_cap and dev.type == "cuda" and not interp and g > 1:
        # programs beyond the GPU's resident wave queue and start as others end: a part of a wave left over ran
        # alone at low occupancy at the end (713 programs, 660 resident, 4 tiles each: 1.30x slower on GLM-5.3's
        # down_proj), while one wave for all was 5 % slower than 6,445 programs on 924 on Qwen3.8-27B's gate_up_proj
        # (queued programs balance the SMs). So whole waves (RESIDENT_CAP 1; 2: one wave), the tiles spread evenly
        with guard:
            wave = _resident_wave(dev, meta, x, dec, dec_t, states, values)
        if wave and g > wave and g % wave:
            g = wave if tuning.resident_cap == 2 else g - g % wave
            if tuning.even_rounds:
                g = _even_rounds(n_groups, g, _sm_count(dev))
    # per_slot = back-pointers (none with rows) + cost rows (+ the values row of a matrix launch)
    bp = torch.empty((1,) if rows else (g, 256 * (e // 2 if pack4 else e)), dtype=torch.uint8, device=dev)
    cs = torch.empty((g, slot_cost_rows(rows), e * tl_), dtype=torch.float16, device=dev)
    if matrix is None:
        off, first, tiles_n, n_cols = dec, 0, 1, 1  # off unused
    else:
        first, tiles_n, n_cols = matrix
        off = _tile_offsets(dev, n_cols)
        values = torch.empty((g, 256 * tl_), dtype=torch.float32, device=dev)  # each slot's values row (1 KiB)
    with guard:  # launch on the tensors' GPU, not whichever is current
        return _viterbi_kernel[(g,)](x, dec, dec_t, cs, bp, states, values, n, off, first, tiles_n, n_cols, **meta)
