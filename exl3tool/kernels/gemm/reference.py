"""Plain-torch EXL3 trellis GEMM (any device): the oracle ``verify`` runs on the CPU and the tests compare the
Triton kernels with. Also the argument checks every entry point shares."""

from __future__ import annotations

import torch

from exl3tool.format.codebook import check_codebook
from exl3tool.format.decode import reconstruct
from exl3tool.format.hadamard import HADAMARD_SCALE, hadamard_128
from exl3tool.format.trellis import check_bits
from exl3tool.kernels.gemm.config import _FOLDS, FOLD_BOTH, FOLD_BOTH16, FOLD_IN, FOLD_NONE, FOLD_OUT


__all__ = ["check_inputs", "trellis_matmul_reference", "fold_weight_reference"]


def check_inputs(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: int,
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
    k, n = check_inputs(x, trellis, suh, svh, bits, codebook)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).to(torch.float32) * suh.to(torch.float32)
    hn = hadamard_128(torch.float32, x.device) * HADAMARD_SCALE
    x2 = (x2.reshape(-1, k // 128, 128) @ hn).reshape(-1, k)
    q = reconstruct(trellis, bits, codebook).to(torch.float32)
    y1 = x2 @ q
    y = (y1.reshape(-1, n // 128, 128) @ hn).reshape(-1, n) * svh.to(torch.float32)
    return y.to(x.dtype).reshape(*lead, n)


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
        from exl3tool.format.decode import dequantize_tensors

        return dequantize_tensors(trellis, suh, svh, bits, codebook, torch.float64).half()
    raise ValueError(f"fold must be one of {_FOLDS}, got {fold}")
