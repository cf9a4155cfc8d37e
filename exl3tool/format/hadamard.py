"""The 128-point Sylvester Hadamard matrix and its blockwise application (docs/format.md §2).

H[i, j] = (-1)^popcount(i & j); the normalised Hn = H * f32(1/sqrt(128)) is its own inverse.
"Left"/input side mixes rows (input features) in blocks of 128; "right"/output side mixes columns.
"""

from __future__ import annotations

from functools import lru_cache

import torch

__all__ = ["HADAMARD_SCALE", "hadamard_128", "hadamard_left", "hadamard_right"]

# f32(1/sqrt(128)) = 0x3DB504F3, the constant both the encoder and the kernels use.
HADAMARD_SCALE = float(torch.tensor(0x3DB504F3, dtype=torch.int32).view(torch.float32))


def hadamard_128(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The unnormalised 128x128 +-1 Sylvester Hadamard matrix (symmetric, H @ H = 128 I)."""
    i = torch.arange(128, device=device)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    for b in range(7):
        parity ^= (bits >> b) & 1
    return (1 - 2 * parity).to(dtype)


@lru_cache(maxsize=16)
def _normalised(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Hn for (dtype, device), built once: its ~60 small ops per call were a tenth of a small layer's launches on
    a GPU. Callers only read it."""
    return hadamard_128(dtype, device) * torch.tensor(HADAMARD_SCALE, dtype=torch.float32).to(dtype)


def hadamard_right(m: torch.Tensor) -> torch.Tensor:
    """Multiply every 128-column block of every row by Hn (mixes output features); returns a new tensor."""
    if m.shape[-1] % 128:
        raise ValueError(f"last dimension {m.shape[-1]} is not a multiple of 128 (shape {tuple(m.shape)})")
    hn = _normalised(m.dtype, m.device)
    return (m.reshape(*m.shape[:-1], -1, 128) @ hn).reshape(m.shape)


def hadamard_left(m: torch.Tensor) -> torch.Tensor:
    """Multiply every 128-row block of a (k, n) matrix on the left by Hn (mixes input features)."""
    if m.dim() != 2 or m.shape[0] % 128:
        raise ValueError(f"expected a (k, n) matrix with k a multiple of 128, got shape {tuple(m.shape)}")
    return hadamard_right(m.t().contiguous()).t().contiguous()  # Hn is symmetric: (Hn M)^T = M^T Hn
