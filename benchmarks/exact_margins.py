"""The margins behind ``exl3tool.operations.exact.TILE_TOLERANCE``: how far another platform's tiles and a flipped bit move a tile.

For each bit width, a fresh recipe-like weight is encoded on this CPU, then as "another platform" would (Hadamard
products summed in float64 and rounded once, and a global scale 1.1e-5 away, golden case0's CPU/H200 difference).
Reported: how many tiles differ and the largest ratio of such a tile's error to this platform's (under this
platform's W_r), then the smallest and median ratio over random single-bit flips of this platform's trellis.
``TILE_TOLERANCE`` (1.25) must sit above the first and below the second.

    python benchmarks/exact_margins.py [--bits 3,6,8] [--flips 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch

import exl3tool.encode.online as online
from exl3tool.format.codebook import decode_states
from exl3tool.format.layout import matrix_to_tiles
from exl3tool.format.trellis import unpack_trellis
from exl3tool.operations.exact import TILE_TOLERANCE


def _errors(trellis: torch.Tensor, tiles: torch.Tensor, bits: int) -> torch.Tensor:
    values = decode_states(unpack_trellis(trellis.reshape(-1, trellis.shape[-1]), bits), "mcg")
    return (values.double() - tiles.double()).square().sum(-1)


def measure(bits: int, flips: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(256, 256, generator=g) * 0.02 * torch.exp(0.5 * torch.randn(256, 1, generator=g))).float()
    mine, w_r = online.encode_linear_with_input(w, bits=bits, seed=11)
    plain_r, plain_l = online.hadamard_right, online.hadamard_left
    online.hadamard_right = lambda m: plain_r(m.double()).float()
    online.hadamard_left = lambda m: online.hadamard_right(m.t().contiguous()).t().contiguous()
    try:
        other, _ = online.encode_linear_with_input(w, bits=bits, seed=11, g_scale=mine.g_scale * (1 + 1.1e-5))
    finally:
        online.hadamard_right, online.hadamard_left = plain_r, plain_l
    tiles = matrix_to_tiles(w_r).reshape(-1, 256)
    best = _errors(mine.trellis, tiles, bits)
    differ = (other.trellis != mine.trellis).any(-1).reshape(-1)
    cross = (_errors(other.trellis, tiles, bits) / best)[differ]
    ratios = []
    for _ in range(flips):
        t = mine.trellis.clone().reshape(-1, 16 * bits)
        tile = int(torch.randint(0, t.shape[0], (1,), generator=g))
        word = int(torch.randint(0, 16 * bits, (1,), generator=g))
        bit = int(torch.randint(0, 16, (1,), generator=g))
        t[tile, word] ^= (1 << bit) if bit < 15 else -32768
        ratios.append(float(_errors(t[tile:tile + 1], tiles[tile:tile + 1], bits)[0] / best[tile]))
    r = torch.tensor(ratios)
    return {"bits": bits, "tiles": int(differ.numel()), "tiles_differing": int(differ.sum()),
            "other_platform_max_ratio": float(cross.max()) if cross.numel() else None,
            "flip_min_ratio": float(r.min()), "flip_median_ratio": float(r.median()), "flips": flips,
            "flips_within_tolerance": int((r <= TILE_TOLERANCE).sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", default="3,6,8")
    ap.add_argument("--flips", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [measure(int(b), args.flips) for b in args.bits.split(",")]
    for row in rows:
        print(f"K={row['bits']}: {row['tiles_differing']} of {row['tiles']} tiles differ on another platform, max "
              f"ratio {row['other_platform_max_ratio']}; flipped bit min {row['flip_min_ratio']:.3g}, median "
              f"{row['flip_median_ratio']:.3g} ({row['flips']} flips, {row['flips_within_tolerance']} within the tolerance "
              f"{TILE_TOLERANCE})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"tolerance": TILE_TOLERANCE, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
