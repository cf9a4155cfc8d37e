"""EXL3 trellis GEMM: y = x @ W with W = diag(suh) B_k Q B_n diag(svh) (docs/format.md §1.4), in Triton.

Two paths, chosen by ``choose_config`` (``trellis_matmul`` is the entry point):

- Fused (m < RECON_MIN_M): Q is never written to memory. Each program loads the packed u32 words of the tiles
  it needs as one aligned word pair per block of 2-4 consecutive trellis positions (docs/format.md §4.5), cuts each 16-bit
  state out of its pair with one 64-bit shift, decodes it with the codebook (docs/format.md §3) and feeds the block to
  tl.dot with fp32 accumulation (for a few rows: fp32 FMAs instead, ``GemmConfig.fma``). The input side (x * suh,
  128-point Hadamard) is done by a small prep kernel (the GEMM would otherwise redo it for every column block)
  or, on request, fused into the GEMM. The output side (Hadamard, * svh, cast) is always fused into the
  epilogue; split-K partials are reduced by the last program of each output block (serial reduction through a
  counter, in a fixed order), so no extra launch is needed for the reduction either.
- Reconstruct (m >= RECON_MIN_M): ``_recon_kernel`` writes an fp16 weight (Q with none, one or both Hadamard
  sides folded in, ``ReconConfig.fold``), torch.mm (cuBLAS) multiplies, and the prep / post kernels do the
  sides that are not folded.

Hadamards run on tensor cores against the exact +-1 matrix: fp16 operands where they are exact (fp16 x, Q,
fp16 y1), otherwise the fp32 operand split into two bf16 parts (16 mantissa bits, full fp32 range).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from exl3tool.encode.codebook import check_codebook
from exl3tool.encode.decode import reconstruct
from exl3tool.encode.hadamard import HADAMARD_SCALE, hadamard_128
from exl3tool.encode.trellis import check_bits

try:  # triton is optional: the reference path runs without it
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = ["trellis_matmul", "trellis_matmul_reference", "fold_weight", "fold_weight_reference", "GemmConfig",
           "ReconConfig", "choose_config", "config_from_entry", "small_m_entry", "SMALL_M_TABLE", "recon_cost",
           "pair_block_bits", "RECON_MIN_M", "FOLD_NONE", "FOLD_OUT", "FOLD_IN", "FOLD_BOTH", "FOLD_BOTH16",
           "HAVE_TRITON"]

_CB_ID = {"3inst": 0, "mcg": 1, "mul1": 2}

# Under TRITON_INTERPRET the Hadamards use one fp32 dot, because the interpreter's tl.dot reads bf16 storage as
# raw integers. A test that patches the interpreter's dot sets this to False to run the GPU's bf16-split path.
INTERPRETER_EXACT_HADAMARD = True


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ----------------------------------------------------------------------------------------------------------
# Reference (plain torch, any device)
# ----------------------------------------------------------------------------------------------------------


def _check_inputs(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: int,
                  codebook: str) -> tuple[int, int]:
    """Validate shapes/dtypes; return (k, n). Raises ValueError with a message naming the culprit."""
    check_bits(bits)
    check_codebook(codebook)
    for name, t in (("x", x), ("trellis", trellis), ("suh", suh), ("svh", svh)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if trellis.dim() != 3 or trellis.dtype != torch.int16:
        raise ValueError(f"trellis must be a 3-D int16 tensor (k/16, n/16, 16*bits), got {trellis.dtype} "
                         f"{tuple(trellis.shape)}")
    if trellis.shape[2] != 16 * bits:
        raise ValueError(f"trellis last dimension {trellis.shape[2]} != 16*bits = {16 * bits}")
    k, n = 16 * trellis.shape[0], 16 * trellis.shape[1]
    if k == 0 or n == 0 or k % 128 or n % 128:
        raise ValueError(f"weight shape ({k}, {n}) must be non-empty multiples of 128")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float16 or bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x must have shape (..., {k}), got {tuple(x.shape)}")
    if suh.shape != (k,) or not suh.is_floating_point():
        raise ValueError(f"suh must be a floating tensor of shape ({k},), got {suh.dtype} {tuple(suh.shape)}")
    if svh.shape != (n,) or not svh.is_floating_point():
        raise ValueError(f"svh must be a floating tensor of shape ({n},), got {svh.dtype} {tuple(svh.shape)}")
    devs = {t.device for t in (x, trellis, suh, svh)}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devs)}")
    return k, n


def trellis_matmul_reference(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, *,
                             bits: int, codebook: str = "mcg") -> torch.Tensor:
    """Plain-torch y = x @ W (reconstruct Q, Hadamards, fp32 math) in x's dtype; the CPU oracle for verify."""
    k, n = _check_inputs(x, trellis, suh, svh, bits, codebook)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).to(torch.float32) * suh.to(torch.float32)
    hn = hadamard_128(torch.float32, x.device) * HADAMARD_SCALE
    x2 = (x2.reshape(-1, k // 128, 128) @ hn).reshape(-1, k)
    q = reconstruct(trellis, bits, codebook).to(torch.float32)
    y1 = x2 @ q
    y = (y1.reshape(-1, n // 128, 128) @ hn).reshape(-1, n) * svh.to(torch.float32)
    return y.to(x.dtype).reshape(*lead, n)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of the fused kernel. BN is fixed at 128 (the output Hadamard block)."""

    bm: int
    bk: int
    split: int
    fuse_in: bool
    num_warps: int = 4
    num_stages: int = 2
    asm: int = 0
    prefetch: bool = True  # prepared input: load step i + 1's words and x during step i's decode
    trans: bool = False  # prepared input: compute y^T = Q^T x^T (the weight as the dot's left operand)
    l2_prefetch: bool = False  # GPU: prefetch the program's trellis words into L2 before its K loop
    fma: int = 0  # > 0: fp32 FMAs instead of tensor cores, this many rows per program (1, 2, 4, 8 or 16 <= bm;
    # bm is then the epilogue's block only; no prefetch, trans or fuse_in). True is 1 (the one-row form)
    x_f32: bool = False  # fma only: the prep kernel writes x2 as fp32 (same values): no conversion in the loop


# What the reconstruct kernel folds into the fp16 weight it writes (``ReconConfig.fold``)
FOLD_NONE, FOLD_OUT, FOLD_IN, FOLD_BOTH, FOLD_BOTH16 = 0, 1, 2, 3, 4
_FOLDS = (FOLD_NONE, FOLD_OUT, FOLD_IN, FOLD_BOTH, FOLD_BOTH16)


@dataclass(frozen=True)
class ReconConfig:
    """The reconstruct path: a Triton kernel writes an fp16 weight, torch.mm (cuBLAS) multiplies.

    fold: which Hadamard sides (with their scales) the written weight includes, the rest is done on the
    activations: FOLD_NONE = Q (prep kernel on x, post kernel on y, the reference's route), FOLD_OUT = Q B_n
    diag(svh) (prep kernel on x), FOLD_IN = diag(suh) B_k Q (post kernel on y; x goes to cuBLAS as fp16),
    FOLD_BOTH = W (nothing else; FOLD_BOTH16: the same with one dot less and one more fp16 rounding).
    br: rows decoded per step, num_warps: of the reconstruct kernel.
    """

    fold: int = FOLD_OUT
    br: int = 32
    num_warps: int = 4
    asm: int = 0


@functools.lru_cache(maxsize=None)
def pair_block_bits(bits: int) -> int:
    """log2 of how many consecutive trellis positions share one aligned word pair in the pair decode.

    Position p's state is the 16-bit window ending at bit (p + 1) K of the tile's bit stream (docs/format.md §4.5);
    a block of 2**eb positions starting at p0 can be cut out of the 64-bit pair of words holding p0's
    first bit when that first bit's offset in its word + 16 + (2**eb - 1) K <= 64, for every block.
    Four positions fit for every K but 7, two for every K.
    """
    check_bits(bits)
    for eb in (2, 1):
        size = 1 << eb
        fits = all(((p0 * bits + bits - 16 + 256 * bits) % (256 * bits)) % 32 + 16 + (size - 1) * bits <= 64
                   for p0 in range(0, 256, size))
        if fits:
            return eb
    raise AssertionError(f"no pair block size for K={bits}")  # unreachable for K <= 8: (2-1) K <= 17


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


# m at and above which trellis_matmul takes the reconstruct path (measured on the H200: benchmarks/README.md, "Trellis GEMM")
RECON_MIN_M = 128

# The reconstruct path's costs on the H200, in microseconds per million elements (fitted to the sweep in
# benchmarks/results/, benchmarks/README.md): the reconstruct kernel per weight for each fold, then the passes over
# the activations that the fold leaves (prep: x's input side, per element of x; post: y's output side, per
# element of y; to_fp16: bf16 x cast for the folds that hand x to cuBLAS as it is).
RECON_COST_US = {"recon": {FOLD_NONE: 0.88, FOLD_OUT: 1.72, FOLD_IN: 1.64, FOLD_BOTH: 2.77, FOLD_BOTH16: 2.09},
                 "prep": 1.28, "post": 1.45, "to_fp16": 1.0}
_FOLD_PASSES = {FOLD_NONE: ("prep", "post"), FOLD_OUT: ("prep",), FOLD_IN: ("post", "to_fp16"),
                FOLD_BOTH: ("to_fp16",), FOLD_BOTH16: ("to_fp16",)}


def recon_cost(fold: int, m: int, k: int, n: int, dtype: torch.dtype = torch.float16) -> float:
    """Predicted extra time (us) of the reconstruct path over the bare fp16 matmul, from ``RECON_COST_US``."""
    size = {"prep": m * k, "post": m * n, "to_fp16": m * k if dtype != torch.float16 else 0}
    return 1e-6 * (RECON_COST_US["recon"][fold] * k * n
                   + sum(RECON_COST_US[p] * size[p] for p in _FOLD_PASSES[fold]))


def balanced_split(chunks: int, target: int, *, min_chunks: int = 1) -> int:
    """Split-K count near ``target`` whose splits all hold the same number of 128-row chunks, give or take one.

    The kernel gives each split ceil(chunks / split) chunks, so a split count that does not divide evenly leaves
    the last splits empty (32 chunks in 19 splits: 16 of 2 and 3 empty programs). ``min_chunks`` caps the count
    at ceil(chunks / min_chunks) (m = 1: 2, the H200 sweep's best at K = 4096; the gain is within run-to-run
    noise, benchmarks/README.md).
    """
    per = max(min(min_chunks, chunks), -(-chunks // max(1, min(chunks, target))))
    return -(-chunks // per)


# The fused kernel's launch below RECON_MIN_M rows, as data: rows (largest m, entry), the first row with
# m <= largest m applies. An entry holds GemmConfig fields (bm, bk, fma, x_f32, l2_prefetch, num_warps,
# num_stages, prefetch, trans; the rest fixed: prepared input, asm on CUDA) and the split-K rule: ``per_sm``
# programs per SM over the (n / 128) x m-blocks output blocks, ``min_chunks`` 128-row chunks per split at least,
# ``balanced`` (default True: ``balanced_split``; False: the plain ceil). Filled from the H200 sweeps
# (benchmarks/README.md, "Trellis GEMM"; ``benchmarks/gemm_sweep_small_m.py --print-table`` prints rows in this
# form from a sweep's JSON):
# - m == 1: the FMA form (no tensor cores, so no shared-memory staging and no barrier per step: 20-30 % faster
#   than tl.dot at one row), about sixteen programs per SM with at least two chunks per split, L2 prefetch.
# - m <= 16: BM=16 and about four programs per SM, so that enough loads are in flight; one pipeline stage
#   (Triton's shared-memory stages cost 2-3x here) and no register prefetch (its registers cost more occupancy
#   than it hides).
# - up to RECON_MIN_M: BM=64, BK=64, about four programs per SM (plain ceil) and the L2 prefetch.
SMALL_M_TABLE: tuple[tuple[int, dict], ...] = (
    (1, dict(bm=16, bk=32, fma=1, l2_prefetch=True, per_sm=16, min_chunks=2)),
    (16, dict(bm=16, bk=32, per_sm=4)),
    (RECON_MIN_M - 1, dict(bm=64, bk=64, l2_prefetch=True, per_sm=4, balanced=False)),
)

_ENTRY_CONFIG_KEYS = frozenset({"bm", "bk", "fma", "x_f32", "l2_prefetch", "num_warps", "num_stages", "prefetch",
                                "trans"})
_ENTRY_SPLIT_KEYS = frozenset({"per_sm", "min_chunks", "balanced"})


def config_from_entry(entry: dict, m: int, k: int, n: int, device: torch.device) -> GemmConfig:
    """The GemmConfig of one ``SMALL_M_TABLE`` entry for this problem (split-K from the entry's rule and the SM
    count), so that the table and the sweep that fills it build configs the same way."""
    unknown = set(entry) - _ENTRY_CONFIG_KEYS - _ENTRY_SPLIT_KEYS
    if unknown or "bm" not in entry or "bk" not in entry or "per_sm" not in entry:
        raise ValueError(f"table entry {entry}: needs bm, bk, per_sm; unknown keys {sorted(unknown)}")
    fields = {key: entry[key] for key in _ENTRY_CONFIG_KEYS & set(entry)}
    rows = int(fields.get("fma", 0)) or fields["bm"]
    programs = (n // 128) * -(-m // rows)
    target = -(-entry["per_sm"] * _num_sms(device) // programs)
    chunks = k // 128
    if entry.get("balanced", True):
        split = balanced_split(chunks, target, min_chunks=entry.get("min_chunks", 1))
    else:
        split = max(1, min(chunks, target))
    fields.setdefault("num_warps", 4)
    fields.setdefault("num_stages", 1)
    fields.setdefault("prefetch", False)
    return GemmConfig(split=split, fuse_in=False, asm=2 if device.type == "cuda" else 0, **fields)


def small_m_entry(m: int) -> dict:
    """The ``SMALL_M_TABLE`` entry for m rows (1 <= m < RECON_MIN_M)."""
    for largest, entry in SMALL_M_TABLE:
        if m <= largest:
            return entry
    raise ValueError(f"no SMALL_M_TABLE row for m = {m} (the table ends at {SMALL_M_TABLE[-1][0]})")


def choose_config(m: int, k: int, n: int, device: torch.device,
                  dtype: torch.dtype = torch.float16) -> GemmConfig | ReconConfig:
    """The launch for m rows: ``SMALL_M_TABLE`` below RECON_MIN_M (the fused kernel), from there on the
    reconstruct path with the fold of least predicted cost (``recon_cost``): the passes over the activations
    grow with m, the reconstruct kernel's cost with the folded Hadamards."""
    if m >= RECON_MIN_M:
        fold = min(_FOLDS, key=lambda f: recon_cost(f, m, k, n, dtype))
        return ReconConfig(fold=fold, br=32 if fold == FOLD_NONE else 64, num_warps=4,
                           asm=2 if device.type == "cuda" else 0)
    return config_from_entry(small_m_entry(m), m, k, n, device)


_HAD_CACHE: dict[str, torch.Tensor] = {}
_CNT_CACHE: dict[str, torch.Tensor] = {}


def _hadamard_bf16(device: torch.device) -> torch.Tensor:
    key = str(device)
    h = _HAD_CACHE.get(key)
    if h is None:
        h = hadamard_128(torch.float32, device).to(torch.bfloat16).contiguous()
        _HAD_CACHE[key] = h
    return h


def _counters(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters for the serial split-K reduction; kernels reset them, so they are reused."""
    key = str(device)
    c = _CNT_CACHE.get(key)
    if c is None or c.numel() < count:
        c = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _CNT_CACHE[key] = c
    return c


def fold_weight_reference(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, *, bits: int,
                          codebook: str = "mcg", fold: int = FOLD_OUT) -> torch.Tensor:
    """Plain-torch oracle of the reconstruct kernel: the fp16 (k, n) weight it writes for ``fold``.

    FOLD_NONE: ``reconstruct``. FOLD_OUT: fp16(((Q @ H) * HSCALE) * svh) per 128-column block, FOLD_IN:
    fp16(((H @ Q) * HSCALE) * suh) per 128-row block, both in fp32 (Q @ H is exact there: the kernel gives
    the same bits). FOLD_BOTH: fp16 of the float64 ``dequantize_tensors`` (the kernel may differ by one ulp).
    """
    q = reconstruct(trellis, bits, codebook)  # (k, n) fp16
    if fold == FOLD_NONE:
        return q
    k, n = q.shape
    h = hadamard_128(torch.float32, q.device)
    if fold == FOLD_OUT:
        u = (q.float().reshape(k, n // 128, 128) @ h).reshape(k, n)  # exact: Q's entries are multiples of 2**-13
        return ((u * HADAMARD_SCALE) * svh.float()[None, :]).half()
    if fold == FOLD_IN:
        v = (h @ q.float().reshape(k // 128, 128, n)).reshape(k, n)
        return ((v * HADAMARD_SCALE) * suh.float()[:, None]).half()
    if fold in (FOLD_BOTH, FOLD_BOTH16):
        from exl3tool.encode.decode import dequantize_tensors

        return dequantize_tensors(trellis, suh, svh, bits, codebook, torch.float64).half()
    raise ValueError(f"fold must be one of {_FOLDS}, got {fold}")


def _check_triton_device(dev: torch.device) -> None:
    if not HAVE_TRITON:
        raise ValueError("trellis_matmul needs triton; use trellis_matmul_reference")
    if dev.type != "cuda" and not (dev.type == "cpu" and _interpret()):
        raise ValueError(f"trellis_matmul needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {dev}")


def fold_weight(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, *, bits: int, codebook: str = "mcg",
                fold: int = FOLD_OUT, config: ReconConfig | None = None) -> torch.Tensor:
    """The fp16 (k, n) weight of the reconstruct path (Triton kernel), Q with ``fold``'s sides folded in.

    Equal to ``fold_weight_reference`` bit for bit for FOLD_NONE/OUT/IN. Example: ``fold_weight(tr, suh, svh,
    bits=6, fold=FOLD_BOTH)`` is the dequantized weight in fp16.
    """
    if trellis.dim() != 3 or trellis.dtype != torch.int16:
        raise ValueError(f"trellis must be a 3-D int16 tensor (k/16, n/16, 16*bits), got {trellis.dtype} "
                         f"{tuple(trellis.shape)}")
    k = 16 * trellis.shape[0]
    x = torch.empty((0, k), dtype=torch.float16, device=trellis.device)
    _check_inputs(x, trellis, suh, svh, bits, codebook)
    _check_triton_device(trellis.device)
    if fold not in _FOLDS:
        raise ValueError(f"fold must be one of {_FOLDS}, got {fold}")
    cfg = config or ReconConfig(fold=fold, asm=2 if trellis.device.type == "cuda" else 0)
    return _fold_weight(trellis.contiguous().view(torch.int32), suh.contiguous(), svh.contiguous(), k,
                        16 * trellis.shape[1], bits, codebook, fold, cfg)


def _fold_weight(words: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, k: int, n: int, bits: int,
                 codebook: str, fold: int, cfg: ReconConfig) -> torch.Tensor:
    dev = words.device
    if 128 % cfg.br or cfg.br < 16:
        raise ValueError(f"bad config {cfg}")
    w = torch.empty((k, n), dtype=torch.float16, device=dev)
    _recon_kernel[(n // 128, k // 128)](words, suh, svh, _hadamard_bf16(dev), w, n, HADAMARD_SCALE,
                                        K_BITS=bits, CB=_CB_ID[codebook],
                                        S1=1 if pair_block_bits(bits) == 2 else 2,
                                        ASM=cfg.asm if dev.type == "cuda" else 0, FOLD=fold, BR=cfg.br,
                                        num_warps=cfg.num_warps)
    return w


def _prep(x2d: torch.Tensor, suh: torch.Tensor, ieee: bool, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """x2 = fp16((x * suh) @ B_k) (the prep kernel), (m, k), stored as ``dtype`` (fp32: the same fp16 values)."""
    m, k = x2d.shape
    xin = torch.empty((m, k), dtype=dtype, device=x2d.device)
    pbm = 64 if m >= 64 else 16
    _prep_kernel[(-(-m // pbm), k // 128)](x2d, suh, _hadamard_bf16(x2d.device), xin, m, k, HADAMARD_SCALE,
                                           BM=pbm, IEEE=ieee, num_warps=4)
    return xin


def _mm(a: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> None:
    """y = a @ b for fp16 a, b (fp32 accumulation, one rounding to y's dtype): cuBLAS on CUDA."""
    if a.device.type != "cuda":  # the interpreter's CPU tests: the same arithmetic in fp32
        y.copy_(a.float() @ b.float())
    elif y.dtype == torch.float16:
        torch.mm(a, b, out=y)
    else:  # bf16 output: keep the fp32 product (fp16 could overflow where bf16 does not)
        y.copy_(torch.mm(a, b, out_dtype=torch.float32))


def _recon_matmul(x2d: torch.Tensor, words: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, k: int, n: int,
                  bits: int, codebook: str, cfg: ReconConfig, y: torch.Tensor, ieee: bool) -> None:
    """The reconstruct path: y = x @ W through the fp16 weight of ``cfg.fold`` and torch.mm."""
    m = x2d.shape[0]
    w = _fold_weight(words, suh, svh, k, n, bits, codebook, cfg.fold, cfg)
    if cfg.fold in (FOLD_NONE, FOLD_OUT):
        xin = _prep(x2d, suh, ieee)
    else:  # the input side is in w: x goes to cuBLAS as it is (fp16)
        xin = x2d.to(torch.float16)
    if cfg.fold in (FOLD_OUT, FOLD_BOTH, FOLD_BOTH16):
        _mm(xin, w, y)
        return
    y1 = torch.empty((m, n), dtype=torch.float16, device=x2d.device)
    _mm(xin, w, y1)
    _post_kernel[(-(-m // 64), n // 128)](y1, svh, _hadamard_bf16(x2d.device), y, m, n, HADAMARD_SCALE, BM=64,
                                          num_warps=4)


def trellis_matmul(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, *, bits: int,
                   codebook: str = "mcg", config: GemmConfig | ReconConfig | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W for an EXL3-encoded weight, decoding Q inside Triton kernels; y has x's dtype.

    x: float16/bfloat16 (..., k) on CUDA (or CPU under TRITON_INTERPRET=1). Below ``RECON_MIN_M`` rows the
    fused kernel decodes Q inside the GEMM; from there on a Triton kernel writes an fp16 weight and cuBLAS
    multiplies (``choose_config``). ``config`` overrides the heuristic (used by the benchmark sweep). Not safe
    to run concurrently on two streams of one device with split-K (the reduction counters are shared per
    device). ``out``: optional contiguous (m, n) tensor of x's dtype to write into (tests poison it to prove
    every element is written).
    """
    k, n = _check_inputs(x, trellis, suh, svh, bits, codebook)
    dev = x.device
    _check_triton_device(dev)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, k).contiguous()
    m = x2d.shape[0]
    if out is None:
        y = torch.empty((m, n), dtype=x.dtype, device=dev)
    else:
        if out.shape != (m, n) or out.dtype != x.dtype or out.device != dev or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous ({m}, {n}) {x.dtype} tensor on {dev}")
        y = out
    if m == 0:
        return y.reshape(*lead, n)
    cfg = config or choose_config(m, k, n, dev, x.dtype)
    words = trellis.contiguous().view(torch.int32)
    suh_c = suh.contiguous()
    svh_c = svh.contiguous()
    ieee = dev.type == "cpu" and INTERPRETER_EXACT_HADAMARD
    if isinstance(cfg, ReconConfig):
        if cfg.fold not in _FOLDS:
            raise ValueError(f"bad config {cfg}")
        _recon_matmul(x2d, words, suh_c, svh_c, k, n, bits, codebook, cfg, y, ieee)
        return y.reshape(*lead, n)
    if 128 % cfg.bk or cfg.bm < 16 or (cfg.trans and cfg.fuse_in):
        raise ValueError(f"bad config {cfg}")
    fma = int(cfg.fma)
    if fma and (fma not in (1, 2, 4, 8, 16) or fma > cfg.bm or cfg.trans or cfg.fuse_in or cfg.prefetch):
        raise ValueError(f"config {cfg}: fma takes 1, 2, 4, 8 or 16 rows (<= bm) and the plain prepared-input loop")
    if cfg.x_f32 and not fma:
        raise ValueError(f"config {cfg}: x_f32 is for the fma form only")
    had = _hadamard_bf16(dev)
    n_blocks = n // 128
    m_blocks = -(-m // (fma or cfg.bm))
    split = max(1, min(cfg.split, k // 128))
    xin = x2d if cfg.fuse_in else _prep(x2d, suh_c, ieee, torch.float32 if cfg.x_f32 else torch.float16)
    if split > 1:
        ws = torch.empty((split, m, n), dtype=torch.float32, device=dev)
        cnt = _counters(dev, m_blocks * n_blocks)
    else:
        ws = y  # unused
        cnt = _counters(dev, 1)
    l2pf = 0
    if cfg.l2_prefetch and not ieee:  # the interpreter runs no PTX
        l2pf = triton.next_power_of_2(-(-(k // 128) // split) * 16 * bits)  # lines: chunks x 8 tile rows x 2K
    grid = (n_blocks, m_blocks, split)
    _gemm_kernel[grid](xin, words, suh_c, svh_c, had, y, ws, cnt, m, k, n, HADAMARD_SCALE,
                       K_BITS=bits, CB=_CB_ID[codebook], BM=cfg.bm, BK=cfg.bk, FUSE_IN=cfg.fuse_in, SPLIT=split,
                       IEEE=ieee, ASM=0 if ieee else cfg.asm,
                       S1=1 if pair_block_bits(bits) == 2 else 2, PREFETCH=cfg.prefetch, TRANS=cfg.trans,
                       L2PF=l2pf, FMA=fma, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.reshape(*lead, n)
