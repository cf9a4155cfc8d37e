"""A sequential fp32 sum along dim 0 in one launch: x[0] + x[1] + ... + x[R-1], rounded after every add.

The encoder's fixed-order reductions (``exl3tool.encode.online._sequential_sum``) add block sums one row at a
time, as the reference's CUDA reductions do; written as torch ops that is one launch per row (224 for a row RMS
over 7,168 columns), which made the regularisation of a small layer launch-bound (5-8 ms on an H200 for a
(256, 7168) weight, against well under 1 ms of GPU work). Here every output element is one lane that walks the
rows in order, so the sums are the torch loop's bit for bit (fp32 adds in the same order; nothing to contract).
"""

from __future__ import annotations

import torch

try:  # triton is optional for the CPU-only parts of the package
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    _HAVE_TRITON = False

__all__ = ["sequential_sum_dim0", "available"]

_BLOCK = 512

if _HAVE_TRITON:

    @triton.jit
    def _sequential_sum_kernel(x_ptr, out_ptr, R, B, C, stride_r, stride_b, stride_c, BLOCK: tl.constexpr):
        """out[b, c] = x[0, b, c] + x[1, b, c] + ... in row order, one lane per (b, c)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < B * C
        b = offs // C
        c = offs - b * C
        ptrs = x_ptr + b.to(tl.int64) * stride_b + c.to(tl.int64) * stride_c
        acc = tl.load(ptrs, mask=mask, other=0.0)
        for _ in range(1, R):
            ptrs += stride_r
            acc += tl.load(ptrs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, acc, mask=mask)


def available(x: torch.Tensor) -> bool:
    """Whether ``sequential_sum_dim0`` can run on ``x``: Triton, and a CUDA tensor (or CPU tensors under
    TRITON_INTERPRET=1, the tests' path)."""
    if not _HAVE_TRITON or x.dtype != torch.float32 or x.dim() < 2:
        return False
    if x.is_cuda:
        return True
    from exl3tool.kernels.viterbi import interpreter_active

    return interpreter_active()


def _as_rbc(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` viewed (never copied) as (R, B, C), or None when its strides allow no such view."""
    r = x.shape[0]
    for shape in ((r, 1, -1), (r, x.shape[1], -1)):
        try:
            return x.view(*shape)
        except RuntimeError:
            continue
    return None


def sequential_sum_dim0(x: torch.Tensor) -> torch.Tensor | None:
    """``x[0] + x[1] + ... + x[-1]`` along dim 0 of an fp32 tensor (any strides that view as (R, B, C)), as a new
    contiguous tensor of shape ``x.shape[1:]``; None when the kernel cannot take ``x`` (the caller loops)."""
    if not available(x) or x.shape[0] == 0:
        return None
    x3 = _as_rbc(x)
    if x3 is None:
        return None
    r, b, c = x3.shape
    out = torch.empty((b, c), dtype=torch.float32, device=x.device)
    if b * c:
        grid = (triton.cdiv(b * c, _BLOCK),)
        _sequential_sum_kernel[grid](x3, out, r, b, c, x3.stride(0), x3.stride(1), x3.stride(2), BLOCK=_BLOCK)
    return out.view(x.shape[1:])
