"""The trellis GEMM's Triton kernels (``@triton.jit``): codebook decode, pair loads, the fused GEMM, the
reconstruct kernel and the prep / post Hadamard kernels. Launched by ``launch``; nothing here runs on the host."""

from __future__ import annotations

try:  # triton is optional: the reference path runs without it
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    HAVE_TRITON = False


__all__ = ["HAVE_TRITON"]


if HAVE_TRITON:

    @triton.jit
    def _codebook(s, CB: tl.constexpr):
        """16-bit states (uint32 tensor) -> fp16 codebook values (docs/format.md §3), bit-exact."""
        if CB == 2:  # mul1: byte sum, then h*A + B with one rounding (exact in fp32, then one cast)
            x = s * 0x83DCD12D
            t = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
            h = (t + 1024).to(tl.float32)
            v = (h * 0.00676727294921875 + (-10.3828125)).to(tl.float16)
        else:
            if CB == 1:
                x = s * 0xCBAC1FED
            else:
                x = s * 89226354 + 64248484
            x = (x & 0x8FFF8FFF) ^ 0x3B603B60
            lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
            hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
            v = lo + hi  # fp16 add: exact sum (both in [0.125, 2)), one RNE rounding
        return v

    @triton.jit
    def _pair_pattern(BK: tl.constexpr, K_BITS: tl.constexpr, S1: tl.constexpr, tiles_n, TRANS: tl.constexpr = False):
        """Word pair offsets per block of positions, and each element's shift, for one (BK, 128) block.

        The tensors are 10-D in exactly Q's order: rows (tile row, b1, b4, b3, b0), columns (tile column, b2,
        b7, b6, b5), where b0..b7 are the bits of the trellis position p = pos(r % 16, c % 16) (docs/format.md §5.2):
        r % 16 = 8 b1 + 4 b4 + 2 b3 + b0 and c % 16 = 8 b2 + 4 b7 + 2 b6 + b5, so a plain reshape gives
        (BK, 128). Positions p0 .. p0 + 2**EB - 1 (EB = 2 when S1 == 1, else 1) read their 16-bit windows
        (docs/format.md §4.5) from one aligned pair of words (hi = U[j], lo = U[j + 1], wrapping in the tile record);
        ``pair_block_bits`` checks on the host that every window fits. The offsets have size-1 axes at those
        low position bits (b0, and b1 when S1 == 1), so each pair is loaded once per block, then broadcast.
        Returns (off_hi, off_lo) in u32 words from the block's first record, and the right shift of the
        64-bit pair hi:lo that leaves each element's state in the low 16 bits. TRANS puts the five column
        axes first, so that the same reshape gives Q^T's (128, BK) block instead.
        """
        TR: tl.constexpr = BK // 16
        WORDS: tl.constexpr = 8 * K_BITS
        if TRANS:  # Q^T's order: columns (tc, b2, b7, b6, b5) first, then rows (tr, b1, b4, b3, b0)
            tc = tl.arange(0, 8)[:, None, None, None, None, None, None, None, None, None]
            b2 = tl.arange(0, 2)[None, :, None, None, None, None, None, None, None, None]
            b7 = tl.arange(0, 2)[None, None, :, None, None, None, None, None, None, None]
            b6 = tl.arange(0, 2)[None, None, None, :, None, None, None, None, None, None]
            b5 = tl.arange(0, 2)[None, None, None, None, :, None, None, None, None, None]
            tr = tl.arange(0, TR)[None, None, None, None, None, :, None, None, None, None]
            b1 = tl.arange(0, S1)[None, None, None, None, None, None, :, None, None, None]
            b4 = tl.arange(0, 2)[None, None, None, None, None, None, None, :, None, None]
            b3 = tl.arange(0, 2)[None, None, None, None, None, None, None, None, :, None]
            e0 = tl.arange(0, 2)[None, None, None, None, None, None, None, None, None, :]
            e1 = tl.arange(0, 2)[None, None, None, None, None, None, :, None, None, None]
        else:
            tr = tl.arange(0, TR)[:, None, None, None, None, None, None, None, None, None]
            b1 = tl.arange(0, S1)[None, :, None, None, None, None, None, None, None, None]
            b4 = tl.arange(0, 2)[None, None, :, None, None, None, None, None, None, None]
            b3 = tl.arange(0, 2)[None, None, None, :, None, None, None, None, None, None]
            tc = tl.arange(0, 8)[None, None, None, None, None, :, None, None, None, None]
            b2 = tl.arange(0, 2)[None, None, None, None, None, None, :, None, None, None]
            b7 = tl.arange(0, 2)[None, None, None, None, None, None, None, :, None, None]
            b6 = tl.arange(0, 2)[None, None, None, None, None, None, None, None, :, None]
            b5 = tl.arange(0, 2)[None, None, None, None, None, None, None, None, None, :]
            e0 = tl.arange(0, 2)[None, None, None, None, :, None, None, None, None, None]
            e1 = tl.arange(0, 2)[None, :, None, None, None, None, None, None, None, None]
        p0 = 128 * b7 + 64 * b6 + 32 * b5 + 16 * b4 + 8 * b3 + 4 * b2 + 2 * b1
        s0 = (p0 * K_BITS + (K_BITS - 16 + 256 * K_BITS)) % (256 * K_BITS)  # first bit of p0's window
        j = s0 // 32
        rec = (tr * tiles_n + tc) * WORDS
        off_hi = rec + j
        off_lo = rec + (j + 1) % WORDS
        if S1 == 1:
            shift = 48 - (s0 % 32) - K_BITS * (e0 + 2 * e1)
        else:
            shift = 48 - (s0 % 32) - K_BITS * e0
        return off_hi, off_lo, shift.to(tl.uint64)

    @triton.jit
    def _load_pairs(words_ptr, wbase, off_hi, off_lo):
        """The (hi, lo) word pairs of one (BK, 128) block (see ``_pair_pattern``), as uint64 tensors."""
        wptr = words_ptr + wbase  # scalar: each load is then one wide multiply-add of its offset
        hi = tl.load(wptr + off_hi).to(tl.uint32, bitcast=True).to(tl.uint64)
        lo = tl.load(wptr + off_lo).to(tl.uint32, bitcast=True).to(tl.uint64)
        return hi, lo

    @triton.jit
    def _decode_loaded(hi, lo, shift, BK: tl.constexpr, CB: tl.constexpr, ASM: tl.constexpr,
                       TRANS: tl.constexpr = False):
        """Loaded pairs -> fp16 (BK, 128) (TRANS: its transpose, (128, BK)): one 64-bit funnel shift and a
        mask per element, then the codebook."""
        s = (((hi << 32) | lo) >> shift).to(tl.uint32)
        if ASM >= 2 and CB != 2:
            x = _hash_asm(s, CB)
            q = _two_halves_asm(x)
        else:
            q = _codebook(s & 0xFFFF, CB)
        if TRANS:
            q = tl.reshape(q, (128, BK))
        else:
            q = tl.reshape(q, (BK, 128))
        return q

    @triton.jit
    def _decode_pairs(words_ptr, wbase, off_hi, off_lo, shift, BK: tl.constexpr, CB: tl.constexpr,
                      ASM: tl.constexpr, TRANS: tl.constexpr = False):
        """Decode one (BK, 128) block (TRANS: (128, BK), Q^T) from its word pairs: two u32 loads per block of
        positions, then ``_decode_loaded``."""
        hi, lo = _load_pairs(words_ptr, wbase, off_hi, off_lo)
        return _decode_loaded(hi, lo, shift, BK, CB, ASM, TRANS)

    @triton.jit
    def _hash_asm(s, CB: tl.constexpr):
        """Low 16 bits of s -> the two fp16 bit patterns of the 3inst/mcg codebooks (docs/format.md §3), in PTX so that
        the mask and the xor stay one lop3."""
        if CB == 1:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t;\n"
                "and.b32 t, $1, 0xFFFF;\n"
                "mul.lo.u32 t, t, 0xCBAC1FED;\n"
                "lop3.b32 $0, t, 0x8FFF8FFF, 0x3B603B60, 0x6A; }",
                "=r,r", [s], dtype=tl.uint32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t;\n"
            "and.b32 t, $1, 0xFFFF;\n"
            "mad.lo.u32 t, t, 89226354, 64248484;\n"
            "lop3.b32 $0, t, 0x8FFF8FFF, 0x3B603B60, 0x6A; }",
            "=r,r", [s], dtype=tl.uint32, is_pure=True, pack=1)

    @triton.jit
    def _two_halves_asm(x):
        """PTX form of the two-halves step's final add for two elements at once (one add.rn.f16x2)."""
        return tl.inline_asm_elementwise(
            "{ .reg .b32 lo, hi;\n"
            "prmt.b32 lo, $1, $2, 0x5410;\n"
            "prmt.b32 hi, $1, $2, 0x7632;\n"
            "add.rn.f16x2 $0, lo, hi; }",
            "=r,r,r", [x], dtype=tl.float16, is_pure=True, pack=2)

    @triton.jit
    def _prefetch_l2(ptrs, mask):
        """``prefetch.global.L2`` of each address where mask holds (PTX; the result is a dummy)."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p;\n"
            "setp.ne.b32 p, $2, 0;\n"
            "@p prefetch.global.L2 [$1];\n"
            "mov.b32 $0, 0; }",
            "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _split_bf16_dot(a, h, IEEE: tl.constexpr):
        """a (fp32) @ h (exact bf16 +-1 matrix) with ~16-bit operand precision: two bf16 tensor-core dots.

        IEEE (interpreter only: its dot reads bf16 storage as integers) does one plain fp32 dot instead.
        """
        if IEEE:
            return tl.dot(a, h.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
        a_hi = a.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(a_hi, h, out_dtype=tl.float32)
        return tl.dot(a_lo, h, acc, out_dtype=tl.float32)

    @triton.jit
    def _epilogue(acc, had_ptr, svh_ptr, y_ptr, rm, pid_n, M, N, HSCALE, IEEE: tl.constexpr, BM: tl.constexpr):
        """y[:, block] = ((acc @ Hn) * svh).to(y's dtype): the output side of docs/format.md §1.4 on one 128-column block.

        Small BM (mma.sync path) goes in four 32-column slices, which keeps a quarter of H live and saves
        registers there; for BM >= 64 (wgmma) slicing costs registers instead (measured with ptxas on sm_90).
        """
        m_mask = rm[:, None] < M
        i128 = tl.arange(0, 128)
        if BM < 64:
            i32 = tl.arange(0, 32)
            a_hi = acc.to(tl.bfloat16)
            a_lo = (acc - a_hi.to(tl.float32)).to(tl.bfloat16)
            for j in tl.static_range(4):
                cols = pid_n * 128 + j * 32 + i32
                hj = tl.load(had_ptr + i128[:, None] * 128 + (j * 32 + i32)[None, :])
                if IEEE:
                    yv = tl.dot(acc, hj.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
                else:
                    yv = tl.dot(a_lo, hj, tl.dot(a_hi, hj, out_dtype=tl.float32), out_dtype=tl.float32)
                yv = yv * HSCALE * tl.load(svh_ptr + cols).to(tl.float32)[None, :]
                tl.store(y_ptr + rm[:, None] * N + cols[None, :], yv.to(y_ptr.dtype.element_ty), mask=m_mask)
        else:
            cols = pid_n * 128 + i128
            h = tl.load(had_ptr + i128[:, None] * 128 + i128[None, :])
            yv = _split_bf16_dot(acc, h, IEEE) * HSCALE
            yv = yv * tl.load(svh_ptr + cols).to(tl.float32)[None, :]
            tl.store(y_ptr + rm[:, None] * N + cols[None, :], yv.to(y_ptr.dtype.element_ty), mask=m_mask)

    @triton.jit
    def _load_x(x_ptr, rm, k0, ibk, M, K, TRANS: tl.constexpr):
        """The (BM, BK) slice of the prepared fp16 x at columns k0 .. k0 + BK (TRANS: its transpose)."""
        if TRANS:
            a = tl.load(x_ptr + rm[None, :] * K + (k0 + ibk)[:, None], mask=rm[None, :] < M, other=0.0)
        else:
            a = tl.load(x_ptr + rm[:, None] * K + (k0 + ibk)[None, :], mask=rm[:, None] < M, other=0.0)
        return a

    @triton.jit
    def _epilogue_t(acc, had_ptr, svh_ptr, y_ptr, rm, pid_n, M, N, HSCALE, IEEE: tl.constexpr):
        """``_epilogue`` for a transposed accumulator acc^T (128, BM): y^T = Hn acc^T (Hn is symmetric), in
        four 32-row slices of H, then * svh and the store into y's (BM, 128) block."""
        m_mask = rm[None, :] < M
        i128 = tl.arange(0, 128)
        i32 = tl.arange(0, 32)
        a_hi = acc.to(tl.bfloat16)
        a_lo = (acc - a_hi.to(tl.float32)).to(tl.bfloat16)
        for j in tl.static_range(4):
            cols = pid_n * 128 + j * 32 + i32
            hj = tl.load(had_ptr + (j * 32 + i32)[:, None] * 128 + i128[None, :])
            if IEEE:
                yv = tl.dot(hj.to(tl.float32), acc, input_precision="ieee", out_dtype=tl.float32)
            else:
                yv = tl.dot(hj, a_lo, tl.dot(hj, a_hi, out_dtype=tl.float32), out_dtype=tl.float32)
            yv = yv * HSCALE * tl.load(svh_ptr + cols).to(tl.float32)[:, None]
            tl.store(y_ptr + rm[None, :] * N + cols[:, None], yv.to(y_ptr.dtype.element_ty), mask=m_mask)

    @triton.jit
    def _prep_kernel(x_ptr, suh_ptr, had_ptr, x2_ptr, M, K, HSCALE, BM: tl.constexpr, IEEE: tl.constexpr):
        """x2 = fp16( (x * suh) @ Hn ) per 128-column chunk (the input side of docs/format.md §1.4).

        fp16 x: one fp16 dot against diag(suh) H (exact fp16 entries +-suh; the tensor cores' products are
        exact, so this is (x * suh) @ H with fp32 accumulation). bf16 x: x * suh in fp32, then the bf16 hi/lo
        split against H (two dots).
        """
        pid_m = tl.program_id(0)
        pid_c = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rc = pid_c * 128 + tl.arange(0, 128)
        mask = rm[:, None] < M
        i = tl.arange(0, 128)
        h = tl.load(had_ptr + i[:, None] * 128 + i[None, :])
        xv = tl.load(x_ptr + rm[:, None] * K + rc[None, :], mask=mask, other=0.0)
        if x_ptr.dtype.element_ty == tl.float16:
            hs = (h.to(tl.float16) * tl.load(suh_ptr + rc)[:, None]).to(tl.float16)
            y = tl.dot(xv, hs, out_dtype=tl.float32) * HSCALE
        else:
            xv = xv.to(tl.float32) * tl.load(suh_ptr + rc).to(tl.float32)[None, :]
            y = _split_bf16_dot(xv, h, IEEE) * HSCALE
        # x2 fp32 (GemmConfig.x_f32): the same fp16-rounded values, so that the FMA loop needs no conversion
        tl.store(x2_ptr + rm[:, None] * K + rc[None, :], y.to(tl.float16).to(x2_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _post_kernel(y1_ptr, svh_ptr, had_ptr, y_ptr, M, N, HSCALE, BM: tl.constexpr):
        """y = ((y1 @ Hn) * svh).to(y's dtype) per 128-column block: the output side of docs/format.md §1.4 for the
        reconstruct path's fp16 product y1 (an fp16 operand: one exact-product dot, fp32 accumulation)."""
        pid_m = tl.program_id(0)
        pid_c = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rc = pid_c * 128 + tl.arange(0, 128)
        mask = rm[:, None] < M
        v = tl.load(y1_ptr + rm[:, None] * N + rc[None, :], mask=mask, other=0.0)
        i = tl.arange(0, 128)
        h = tl.load(had_ptr + i[:, None] * 128 + i[None, :]).to(tl.float16)
        y = tl.dot(v, h, out_dtype=tl.float32) * HSCALE
        y = y * tl.load(svh_ptr + rc).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * N + rc[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _recon_kernel(words_ptr, suh_ptr, svh_ptr, had_ptr, w_ptr, N, HSCALE,
                      K_BITS: tl.constexpr, CB: tl.constexpr, S1: tl.constexpr, ASM: tl.constexpr,
                      FOLD: tl.constexpr, BR: tl.constexpr):
        """One (128, 128) block of the weight the reconstruct path hands to cuBLAS, written as fp16.

        FOLD 0: Q itself (docs/format.md §1.3). FOLD 1 (output side folded in): fp16((Q Hn-block product) * svh),
        computed as ((Q @ H) * HSCALE) * svh in fp32. FOLD 2 (input side): fp16(((H @ Q) * HSCALE) * suh).
        FOLD 3: both, i.e. the de-rotated W of docs/format.md §1.4 (FOLD 4: the same with H @ Q rounded to fp16 before
        the second product: one dot less, one more rounding). Q's entries are multiples of 2**-13 below 4 in
        magnitude (mcg/3inst; mul1: 2**-17), so Q @ H with fp16 operands is exact in fp32 in any summation
        order: FOLD 0-2 equal their plain-torch oracle (``fold_weight_reference``) bit for bit. FOLD 3 splits
        the exact H @ Q into fp16 hi and lo parts for the second product, whose fp32 sum is not exact.
        Q is decoded BR rows at a time (pair decode, as in the GEMM).
        """
        WORDS: tl.constexpr = 8 * K_BITS
        pid_n = tl.program_id(0)
        pid_c = tl.program_id(1)
        tiles_n = N // 16
        i128 = tl.arange(0, 128)
        ibr = tl.arange(0, BR)
        cols = pid_n * 128 + i128
        off_hi, off_lo, shift = _pair_pattern(BR, K_BITS, S1, tiles_n)
        wbase = ((pid_c * 8) * tiles_n + pid_n * 8) * WORDS
        step = (BR // 16) * tiles_n * WORDS
        if FOLD >= 2:
            acc = tl.zeros((128, 128), dtype=tl.float32)
            for j in tl.static_range(128 // BR):
                q = _decode_pairs(words_ptr, wbase + j * step, off_hi, off_lo, shift, BR, CB, ASM)
                hj = tl.load(had_ptr + i128[:, None] * 128 + (j * BR + ibr)[None, :]).to(tl.float16)
                acc = tl.dot(hj, q, acc, out_dtype=tl.float32)
            rows = pid_c * 128 + i128
            if FOLD == 2:
                w = (acc * HSCALE) * tl.load(suh_ptr + rows).to(tl.float32)[:, None]
            else:
                h = tl.load(had_ptr + i128[:, None] * 128 + i128[None, :]).to(tl.float16)
                v_hi = acc.to(tl.float16)
                if FOLD == 3:
                    v_lo = (acc - v_hi.to(tl.float32)).to(tl.float16)
                    u = tl.dot(v_lo, h, tl.dot(v_hi, h, out_dtype=tl.float32), out_dtype=tl.float32)
                else:  # FOLD 4: H @ Q rounded to fp16 before the second product (one dot less)
                    u = tl.dot(v_hi, h, out_dtype=tl.float32)
                w = (u * 0.0078125) * tl.load(suh_ptr + rows).to(tl.float32)[:, None]
                w = w * tl.load(svh_ptr + cols).to(tl.float32)[None, :]
            tl.store(w_ptr + rows[:, None] * N + cols[None, :], w.to(tl.float16))
        else:
            if FOLD == 1:
                h = tl.load(had_ptr + i128[:, None] * 128 + i128[None, :]).to(tl.float16)
                sv = tl.load(svh_ptr + cols).to(tl.float32)[None, :]
            for j in tl.static_range(128 // BR):
                q = _decode_pairs(words_ptr, wbase + j * step, off_hi, off_lo, shift, BR, CB, ASM)
                rows = pid_c * 128 + j * BR + ibr
                if FOLD == 1:
                    u = tl.dot(q, h, out_dtype=tl.float32)
                    tl.store(w_ptr + rows[:, None] * N + cols[None, :], ((u * HSCALE) * sv).to(tl.float16))
                else:
                    tl.store(w_ptr + rows[:, None] * N + cols[None, :], q)

    @triton.jit
    def _gemm_kernel(x_ptr, words_ptr, suh_ptr, svh_ptr, had_ptr, y_ptr, ws_ptr, cnt_ptr,
                     M, K, N, HSCALE,
                     K_BITS: tl.constexpr, CB: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                     FUSE_IN: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                     ASM: tl.constexpr, S1: tl.constexpr, PREFETCH: tl.constexpr, TRANS: tl.constexpr = False,
                     L2PF: tl.constexpr = 0, FMA: tl.constexpr = 0):
        """One (BM, 128) output block over one K split: decode Q blocks, tl.dot, then the fused epilogue.

        FUSE_IN: x is the raw activation and this program applies suh and the input Hadamard per 128-chunk;
        otherwise x is the prepared fp16 x2. SPLIT > 1: partials go to a workspace and the last program of the
        block (counter) sums them in fixed order and runs the epilogue. TRANS (prepared input only): the
        product is computed transposed, acc^T (128, BM) = Q^T x2^T, so that the decoded weight is the dot's
        left operand (the one tensor cores can take from registers) and the few rows of x the right one.
        L2PF > 0 (GPU only): before the K loop, the program asks for all its trellis words to be brought into
        L2 (``prefetch.global.L2``, one per 128-byte line, L2PF >= the program's line count), so that the
        word gathers of the loop wait on L2 rather than on HBM. FMA > 0 (prepared input, no TRANS or
        PREFETCH): no tensor cores; each program takes FMA rows of x (not BM: BM, >= 16, is then only the
        epilogue's block, rows past the program's own masked) and accumulates with fp32 FMAs in the decode's own
        layout, where each thread holds all BK rows of one column: (FMA, BK, 128) fp32 partial sums, one FFMA
        per weight and row, reduced once at the end. x may be fp32 (the prep kernel's fp16-rounded values, so
        the same products): no conversion per element in the loop.
        """
        BN: tl.constexpr = 128
        WORDS: tl.constexpr = 8 * K_BITS
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_s = tl.program_id(2)
        tiles_n = N // 16
        n_chunks = K // 128
        per = tl.cdiv(n_chunks, SPLIT)
        c_start = pid_s * per
        c_end = tl.minimum(c_start + per, n_chunks)

        if L2PF > 0:  # a tile row of the block is 8 records = 256 K_BITS bytes = 2 K_BITS lines, contiguous
            LPR: tl.constexpr = 2 * K_BITS
            li = tl.arange(0, L2PF)
            t_row = c_start * 8 + li // LPR
            lines = words_ptr + (t_row * tiles_n + pid_n * (BN // 16)) * WORDS + (li % LPR) * 32
            _prefetch_l2(lines, t_row < c_end * 8)
        if FMA > 0:  # FMA rows per program; the (BM, 128) block from row0 on is the epilogue's
            row0 = pid_m * FMA
            m_lim = tl.minimum(M, row0 + FMA)
        else:
            row0 = pid_m * BM
            m_lim = M
        rm = row0 + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        m_mask = rm[:, None] < m_lim
        i128 = tl.arange(0, 128)
        ibk = tl.arange(0, BK)
        if TRANS:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        wbase0 = ((c_start * 128 // 16) * tiles_n + pid_n * (BN // 16)) * WORDS
        step = (BK // 16) * tiles_n * WORDS
        off_hi, off_lo, shift = _pair_pattern(BK, K_BITS, S1, tiles_n, TRANS)
        if FUSE_IN:
            for ch in range(c_start, c_end):
                k0 = tl.multiple_of(ch * 128, 128)  # alignment hint: vectorised x loads
                # x1 = fp16(x * suh) as the reference kernel rounds it; one fp16 dot per slice keeps only the
                # fp16 operand live (the bf16 hi/lo split of the prep kernel costs 4x the registers here)
                xv = tl.load(x_ptr + rm[:, None] * K + (k0 + i128)[None, :], mask=m_mask, other=0.0)
                xv = (xv.to(tl.float32) * tl.load(suh_ptr + k0 + i128).to(tl.float32)[None, :]).to(tl.float16)
                for j in tl.static_range(128 // BK):
                    kk = tl.multiple_of(k0 + j * BK, BK)
                    hj = tl.load(had_ptr + i128[:, None] * 128 + (j * BK + ibk)[None, :]).to(tl.float16)
                    a = (tl.dot(xv, hj, out_dtype=tl.float32) * HSCALE).to(tl.float16)
                    wbase = ((kk // 16) * tiles_n + pid_n * (BN // 16)) * WORDS
                    q = _decode_pairs(words_ptr, wbase, off_hi, off_lo, shift, BK, CB, ASM)
                    acc = tl.dot(a, q, acc, out_dtype=tl.float32)
        else:
            if PREFETCH:
                # register double buffering: the next step's words and x are loaded before this step's
                # decode, so their latency hides behind it (pipeline stages go through shared memory and
                # cost more than they hide for these 4-byte gathers)
                k_end = c_end * 128
                empty = c_start >= c_end  # a split past the last chunk: load something valid, use nothing
                wb = tl.where(empty, 0, wbase0)
                hi, lo = _load_pairs(words_ptr, wb, off_hi, off_lo)
                k0 = tl.multiple_of(tl.where(empty, 0, c_start * 128), BK)
                a = _load_x(x_ptr, rm, k0, ibk, M, K, TRANS)
                for k_it in range(c_start * 128, k_end, BK):
                    more = k_it + BK < k_end
                    wb_next = tl.where(more, wb + step, wb)  # the last step reloads its own block
                    k_next = tl.multiple_of(tl.where(more, k_it + BK, k_it), BK)
                    hi_n, lo_n = _load_pairs(words_ptr, wb_next, off_hi, off_lo)
                    a_n = _load_x(x_ptr, rm, k_next, ibk, M, K, TRANS)
                    q = _decode_loaded(hi, lo, shift, BK, CB, ASM, TRANS)
                    if TRANS:
                        acc = tl.dot(q, a, acc, out_dtype=tl.float32)
                    else:
                        acc = tl.dot(a, q, acc, out_dtype=tl.float32)
                    hi, lo, a, wb = hi_n, lo_n, a_n, wb_next
            elif FMA == 1:  # one row of x: no tensor cores, so no shared-memory staging and no barrier per step
                acc2 = tl.zeros((BK, BN), dtype=tl.float32)
                for k_it in range(c_start * 128, c_end * 128, BK):
                    kk = tl.multiple_of(k_it, BK)
                    xv = tl.load(x_ptr + row0 * K + kk + ibk).to(tl.float32)
                    wbase = ((kk // 16) * tiles_n + pid_n * (BN // 16)) * WORDS
                    q = _decode_pairs(words_ptr, wbase, off_hi, off_lo, shift, BK, CB, ASM)
                    acc2 += q.to(tl.float32) * xv[:, None]
                acc = tl.where(rm[:, None] == row0, tl.sum(acc2, axis=0)[None, :], 0.0)
            elif FMA > 1:  # a few rows: one FFMA per weight and row, still no staging (x is read by every thread)
                ir = tl.arange(0, FMA)
                rows = tl.minimum(row0 + ir, M - 1)  # rows past M read row M - 1 (no masked loads), stored nowhere
                acc3 = tl.zeros((FMA, BK, BN), dtype=tl.float32)
                for k_it in range(c_start * 128, c_end * 128, BK):
                    kk = tl.multiple_of(k_it, BK)
                    xv = tl.load(x_ptr + rows[:, None] * K + (kk + ibk)[None, :]).to(tl.float32)
                    wbase = ((kk // 16) * tiles_n + pid_n * (BN // 16)) * WORDS
                    q = _decode_pairs(words_ptr, wbase, off_hi, off_lo, shift, BK, CB, ASM)
                    acc3 += q.to(tl.float32)[None, :, :] * xv[:, :, None]
                accr = tl.sum(acc3, axis=1)
                # rows 0 .. FMA - 1 of the epilogue's (BM, 128) block (a select, exact), the others zero
                sel = (tl.arange(0, BM)[:, None] == ir[None, :])[:, :, None]
                acc = tl.sum(tl.where(sel, accr[None, :, :], 0.0), axis=1)
            else:
                for k_it in range(c_start * 128, c_end * 128, BK):
                    kk = tl.multiple_of(k_it, BK)  # alignment hint: 16-byte x loads instead of 2-byte ones
                    a = _load_x(x_ptr, rm, kk, ibk, M, K, TRANS)
                    wbase = ((kk // 16) * tiles_n + pid_n * (BN // 16)) * WORDS
                    q = _decode_pairs(words_ptr, wbase, off_hi, off_lo, shift, BK, CB, ASM, TRANS)
                    if TRANS:
                        acc = tl.dot(q, a, acc, out_dtype=tl.float32)
                    else:
                        acc = tl.dot(a, q, acc, out_dtype=tl.float32)

        if TRANS:  # acc[c, r] is y1[rm[r], rn[c]]
            out_off = rm[None, :] * N + rn[:, None]
            out_mask = (rm[None, :] < M) & (rn[:, None] < N)
        else:
            out_off = rm[:, None] * N + rn[None, :]
            out_mask = m_mask & (rn[None, :] < N)
        if SPLIT > 1:
            tl.store(ws_ptr + pid_s * M * N + out_off, acc, mask=out_mask)
            tl.debug_barrier()  # every thread's partial is stored before the release below
            cnt = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
            done = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT - 1:
                acc = tl.zeros_like(acc)
                for s in range(0, SPLIT):  # fixed order: the result does not depend on who finishes last
                    acc += tl.load(ws_ptr + s * M * N + out_off, mask=out_mask, other=0.0, cache_modifier=".cg")
                if TRANS:
                    _epilogue_t(acc, had_ptr, svh_ptr, y_ptr, rm, pid_n, M, N, HSCALE, IEEE)
                else:
                    _epilogue(acc, had_ptr, svh_ptr, y_ptr, rm, pid_n, m_lim, N, HSCALE, IEEE, BM)
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # ready for the next call
        elif TRANS:
            _epilogue_t(acc, had_ptr, svh_ptr, y_ptr, rm, pid_n, M, N, HSCALE, IEEE)
        else:
            _epilogue(acc, had_ptr, svh_ptr, y_ptr, rm, pid_n, m_lim, N, HSCALE, IEEE, BM)
