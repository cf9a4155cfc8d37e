"""Tile layout: an (in, out) matrix <-> (tiles_k, tiles_n, 256) sequences in tensor-core (trellis) order.

Position p = 8t + j of a tile holds element (row(p), col(p)) with
row = 2(t mod 4) + (j & 1) + 8((j >> 1) & 1) and col = t // 4 + 8(j >> 2): the B-operand elements
lane t holds for two m16n8k16 MMAs. Rules: docs/format.md §5.
"""

from __future__ import annotations

import torch

__all__ = [
    "TENSOR_CORE_PERM", "TENSOR_CORE_PERM_INV", "tile_element_index", "tile_position", "matrix_to_tiles",
    "tiles_to_matrix",
]


def _perm() -> torch.Tensor:
    p = torch.arange(256)
    t, j = p // 8, p % 8
    row = 2 * (t % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    col = t // 4 + 8 * (j >> 2)
    return 16 * row + col


TENSOR_CORE_PERM = _perm()  # perm[p] = 16*row(p) + col(p): row-major index of position p
TENSOR_CORE_PERM_INV = torch.argsort(TENSOR_CORE_PERM)  # position of row-major element 16r + c


_PERMS: dict[str, torch.Tensor] = {}


def _perm_on(device: torch.device) -> torch.Tensor:
    """TENSOR_CORE_PERM on ``device``, copied there once: a copy from pageable host memory at every call waited for
    the device's queue to drain (a host sync per chunk of an encode, 0.3-0.4 ms of idle GPU each on an H200)."""
    if device.type == "cpu":
        return TENSOR_CORE_PERM
    key = str(device)
    perm = _PERMS.get(key)
    if perm is None:
        perm = _PERMS[key] = TENSOR_CORE_PERM.to(device)
    return perm


def tile_position(r: int, c: int) -> int:
    """Trellis position of tile element (row r = input offset, col c = output offset)."""
    return 32 * (c % 8) + 8 * ((r % 8) // 2) + 4 * (c // 8) + 2 * (r // 8) + (r % 2)


def _check_matrix(m: torch.Tensor, name: str = "matrix") -> None:
    if m.dim() != 2:
        raise ValueError(f"{name} must be 2-D (in_features, out_features), got shape {tuple(m.shape)}")
    k, n = m.shape
    if k % 16 or n % 16:
        raise ValueError(f"{name} shape {tuple(m.shape)} is not a multiple of 16 in both dimensions")


def matrix_to_tiles(m: torch.Tensor) -> torch.Tensor:
    """(k, n) matrix -> (k/16, n/16, 256) tiles, each in trellis-position order.

    One gather from a strided view of ``m``: no intermediate copy, so the only new memory is the result.
    """
    _check_matrix(m)
    k, n = m.shape
    blocks = m.reshape(k // 16, 16, n // 16, 16).permute(0, 2, 1, 3)  # (tk, tn, 16, 16) view
    perm = _perm_on(m.device)
    return blocks[:, :, perm // 16, perm % 16]


def tile_element_index(n: int, tiles: torch.Tensor) -> torch.Tensor:
    """Flat row-major index, in a (k, n) matrix, of every element of the given tiles in trellis order.

    ``tiles`` holds flat tile numbers (tile row * n/16 + tile column); the result is (len(tiles), 256) int64,
    so ``m.reshape(-1)[idx]`` equals ``matrix_to_tiles(m).reshape(-1, 256)[tiles]`` without building every tile.
    """
    tn = n // 16
    perm = _perm_on(tiles.device)
    base = (tiles // tn) * (16 * n) + (tiles % tn) * 16
    return base[:, None] + ((perm // 16) * n + perm % 16)[None, :]


def tiles_to_matrix(tiles: torch.Tensor) -> torch.Tensor:
    """(tk, tn, 256) tiles in trellis-position order -> (16 tk, 16 tn) matrix (inverse of matrix_to_tiles)."""
    if tiles.dim() != 3 or tiles.shape[-1] != 256:
        raise ValueError(f"tiles must have shape (tiles_k, tiles_n, 256), got {tuple(tiles.shape)}")
    tk, tn, _ = tiles.shape
    rowmajor = tiles[..., TENSOR_CORE_PERM_INV.to(tiles.device)]
    return rowmajor.reshape(tk, tn, 16, 16).permute(0, 2, 1, 3).reshape(16 * tk, 16 * tn)
