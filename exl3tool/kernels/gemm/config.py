"""Launch configurations of the trellis GEMM's two paths (fused, reconstruct) and the pair decode's geometry."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from exl3tool.format.trellis import check_bits


__all__ = ["GemmConfig", "ReconConfig", "pair_block_bits", "FOLD_NONE", "FOLD_OUT", "FOLD_IN", "FOLD_BOTH",
           "FOLD_BOTH16"]


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
