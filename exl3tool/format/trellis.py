"""Trellis packing: 256 16-bit states per tile <-> a 16*K-word int16 record (docs/format.md §4).

Only the low K bits of each state are stored, MSB-first, as 16-bit chunks with every pair of
chunks swapped (T[c] = chunk(c ^ 1)); the upper state bits follow from the tail-biting ring.
"""

from __future__ import annotations

import torch

__all__ = ["PACK_SLICE_TILES", "check_bits", "pack_trellis", "unpack_trellis"]

PACK_SLICE_TILES = 2048  # tiles packed at once: bounds the bit streams' temporaries (encode/memory counts them)


def check_bits(bits: int) -> int:
    """Return ``bits`` if it is an integer in 1..8, else raise ValueError."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer from 1 to 8, got {bits!r}")
    return bits


def _check_int(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {getattr(t, 'dtype', type(t))}")


def pack_trellis(states: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., 256) states (int16 raw bits or wider ints) -> (..., 16*bits) int16 packed records."""
    check_bits(bits)
    _check_int(states, "states")
    if states.dim() < 1 or states.shape[-1] != 256:
        raise ValueError(f"states must have last dimension 256, got shape {tuple(states.shape)}")
    lead = states.shape[:-1]
    flat = states.reshape(-1, 256)
    out = torch.empty((flat.shape[0], 16 * bits), dtype=torch.int16, device=flat.device)
    shifts = torch.arange(bits - 1, -1, -1, device=flat.device, dtype=torch.int32)
    weights = 1 << torch.arange(15, -1, -1, device=flat.device, dtype=torch.int32)
    for lo in range(0, flat.shape[0], PACK_SLICE_TILES):  # the bit streams take ~20 bytes per state: in slices
        v = flat[lo : lo + PACK_SLICE_TILES].to(torch.int32) & ((1 << bits) - 1)  # (T, 256) low K bits
        stream = ((v.unsqueeze(-1) >> shifts) & 1).reshape(-1, 256 * bits // 16, 16)  # MSB-first bits
        chunks = (stream * weights).sum(-1, dtype=torch.int32)  # (T, 16K) values 0..65535
        swapped = chunks.reshape(-1, 8 * bits, 2).flip(-1).reshape(-1, 16 * bits)
        out[lo : lo + PACK_SLICE_TILES] = _to_int16(swapped)
    return out.reshape(*lead, 16 * bits)


def _to_int16(x: torch.Tensor) -> torch.Tensor:
    """Reinterpret 0..65535 values as int16 raw bits (two's complement)."""
    return torch.where(x >= 32768, x - 65536, x).to(torch.int16)


def unpack_trellis(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., 16*bits) int16 packed records -> (..., 256) int16 full 16-bit states (raw bits)."""
    check_bits(bits)
    _check_int(packed, "packed")
    if packed.dim() < 1 or packed.shape[-1] != 16 * bits:
        raise ValueError(f"packed trellis must have last dimension 16*bits = {16 * bits}, got shape {tuple(packed.shape)}")
    lead = packed.shape[:-1]
    t = packed.to(torch.int64).reshape(-1, 16 * bits) & 0xFFFF
    chunks = t.reshape(-1, 8 * bits, 2).flip(-1).reshape(-1, 16 * bits)  # undo the pair swap
    stream = ((chunks.unsqueeze(-1) >> torch.arange(15, -1, -1, device=t.device)) & 1).reshape(-1, 256, bits)
    v = (stream * (1 << torch.arange(bits - 1, -1, -1, device=t.device))).sum(-1)  # (T, 256) K-bit values
    # state i = the last ceil(16/K) values of the ring ending at i, masked to 16 bits
    state = torch.zeros_like(v)
    for back in range((16 + bits - 1) // bits):
        state |= torch.roll(v, shifts=back, dims=-1) << (back * bits)
    return _to_int16(state & 0xFFFF).reshape(*lead, 256)
