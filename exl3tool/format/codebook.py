"""The three procedural EXL3 codebooks (3inst, mcg, mul1): 16-bit trellis state -> fp16 value.

Every codebook is a pure function of the state, so we build each 65,536-entry table once with
exact integer and float64 arithmetic (numpy rounds float64 -> float16 directly, RNE) and index it.
Rules: docs/format.md §3.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

__all__ = ["CODEBOOKS", "CODEBOOK_MARKERS", "check_codebook", "codebook_table", "codebook_table_np", "decode_states",
           "edge_major_table"]

CODEBOOKS = ("3inst", "mcg", "mul1")

# Marker tensors written next to a trellis (0-dim int32); 3inst has none.
CODEBOOK_MARKERS = {"mcg": -877912083, "mul1": -2082680531}


def check_codebook(codebook: str) -> str:
    """Return ``codebook`` if known, else raise a ValueError naming the valid choices."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown codebook {codebook!r}; expected one of {', '.join(CODEBOOKS)}")
    return codebook


def _two_halves(x: np.ndarray) -> np.ndarray:
    """Mask/xor a u32, then add its two fp16 halves with one RNE rounding (cb0 and cb1)."""
    x = (x & np.uint64(0x8FFF8FFF)) ^ np.uint64(0x3B603B60)
    lo = (x & np.uint64(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (x >> np.uint64(16)).astype(np.uint16).view(np.float16).astype(np.float64)
    return (lo + hi).astype(np.float16)  # exact sum in float64, one rounding to fp16


@lru_cache(maxsize=None)
def codebook_table_np(codebook: str = "mcg") -> np.ndarray:
    """The 65,536 fp16 values of ``codebook`` as a read-only numpy array indexed by state."""
    check_codebook(codebook)
    s = np.arange(65536, dtype=np.uint64)
    mask32 = np.uint64(0xFFFFFFFF)
    if codebook == "3inst":
        table = _two_halves((s * np.uint64(89226354) + np.uint64(64248484)) & mask32)
    elif codebook == "mcg":
        table = _two_halves((s * np.uint64(0xCBAC1FED)) & mask32)
    else:  # mul1: byte sum, then one fused multiply-add in fp16
        x = (s * np.uint64(0x83DCD12D)) & mask32
        t = sum((x >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4))
        h = (np.uint64(0x6400) + t).astype(np.uint16).view(np.float16).astype(np.float64)
        a = np.array([0x1EEE], dtype=np.uint16).view(np.float16).astype(np.float64)[0]
        b = np.array([0xC931], dtype=np.uint16).view(np.float16).astype(np.float64)[0]
        table = (h * a + b).astype(np.float16)  # h*a is exact in float64 (11 x 11 bits), one rounding
    table.setflags(write=False)
    return table


_TORCH_TABLES: dict[tuple[str, str], torch.Tensor] = {}


def codebook_table(codebook: str = "mcg", device: torch.device | str | None = None) -> torch.Tensor:
    """The 65,536-entry fp16 table of ``codebook`` as a torch tensor on ``device`` (cached per device)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    key = (check_codebook(codebook), str(dev))
    table = _TORCH_TABLES.get(key)
    if table is None:
        table = torch.from_numpy(codebook_table_np(codebook).copy()).to(dev)
        _TORCH_TABLES[key] = table
    return table


_EDGE_MAJOR: dict[tuple[str, int, str], torch.Tensor] = {}


def edge_major_table(codebook: str, bits: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The codebook's 65,536 values ordered edge by edge for K = ``bits``: entry e * 2^K + k is state
    (k << (16 - K)) | e, the k-th candidate of edge e (cached per device).

    The Viterbi kernel's traceback reads one edge's 2^K candidates at a step: side by side here, one or a few
    cache lines, where the state-major table spreads them 2^(16-K) values apart."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    key = (check_codebook(codebook), bits, str(dev))
    table = _EDGE_MAJOR.get(key)
    if table is None:
        table = codebook_table(codebook, dev).view(1 << bits, 1 << (16 - bits)).t().contiguous().view(-1)
        _EDGE_MAJOR[key] = table
    return table


def decode_states(states: torch.Tensor, codebook: str = "mcg") -> torch.Tensor:
    """Decode 16-bit trellis states (int16 raw bits or any wider integer dtype) to fp16 values.

    >>> decode_states(torch.tensor([0, 1]), "mcg").tolist()
    [1.84375, 0.134521484375]
    """
    if not isinstance(states, torch.Tensor) or states.is_floating_point() or states.is_complex():
        raise ValueError(f"states must be an integer tensor, got {getattr(states, 'dtype', type(states))}")
    if states.dtype == torch.bool:
        raise ValueError("states must be an integer tensor, got torch.bool")
    table = codebook_table(codebook, states.device)
    index = states.to(torch.int64) & 0xFFFF
    return table[index]
