"""The plain-PyTorch decode: the oracle for every fast path (docs/format.md §1).

reconstruct() gives the inner fp16 matrix Q of a packed trellis; dequantize() the de-rotated weight
W = diag(suh) B_k Q B_n diag(svh), so that a layer computes y = x @ W.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from exl3tool.format.codebook import decode_states
from exl3tool.format.hadamard import hadamard_left, hadamard_right
from exl3tool.format.layout import tiles_to_matrix
from exl3tool.format.trellis import check_bits, unpack_trellis

if TYPE_CHECKING:
    from exl3tool.format.encoded import EncodedLinear

__all__ = ["reconstruct", "dequantize", "dequantize_tensors"]


def reconstruct(trellis: torch.Tensor, bits: int, codebook: str = "mcg") -> torch.Tensor:
    """Packed (k/16, n/16, 16*bits) int16 trellis -> the inner fp16 matrix Q of shape (k, n)."""
    check_bits(bits)
    if trellis.dim() != 3 or trellis.dtype != torch.int16:
        raise ValueError(f"trellis must be a 3-D int16 tensor (k/16, n/16, 16*bits), got {trellis.dtype} {tuple(trellis.shape)}")
    states = unpack_trellis(trellis, bits)  # (tk, tn, 256) in trellis-position order
    return tiles_to_matrix(decode_states(states, codebook))  # (k, n) fp16


def dequantize_tensors(
    trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: int, codebook: str = "mcg",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W = diag(suh) B_k Q B_n diag(svh), computed in float64 and returned as ``dtype`` (k, n)."""
    q = reconstruct(trellis, bits, codebook).to(torch.float64)  # (k, n)
    k, n = q.shape
    if suh.shape != (k,) or svh.shape != (n,):
        raise ValueError(f"suh {tuple(suh.shape)} / svh {tuple(svh.shape)} do not match trellis for a ({k}, {n}) weight")
    w = hadamard_right(hadamard_left(q))  # B_k Q B_n
    w = suh.to(torch.float64)[:, None] * w * svh.to(torch.float64)[None, :]
    return w.to(dtype)


def dequantize(encoded: "EncodedLinear", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full de-rotated weight of an encoded layer, (in, out), so that y = x @ W.

    Args:
        encoded: the encoded layer (a cache entry's tensors with its bits and codebook).
        dtype: the dtype of the result.

    Returns:
        The (in_features, out_features) weight.
    """
    return dequantize_tensors(encoded.trellis, encoded.suh, encoded.svh, encoded.bits, encoded.codebook, dtype)
