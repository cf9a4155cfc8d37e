"""Throughput of the CPU tile quantizer (numba) per K, and of the pure-torch path for a ratio.

Usage: python benchmarks/bench_quantize_tiles.py [--tiles 2048] [--small 256] [--torch-tiles 2] [--torch-threads 1] [--json]
Gaussian tiles (fixed seed). The numba kernel is compiled (or loaded from its cache) before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from exl3tool.encode.viterbi import quantize_tiles, quantize_tiles_torch  # noqa: E402


def _rate(fn, tiles: torch.Tensor) -> float:
    t0 = time.perf_counter()
    fn(tiles)
    return tiles.shape[0] / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=2048, help="tiles for the K=6 mcg headline figure")
    ap.add_argument("--small", type=int, default=256, help="tiles for each K in 2..8")
    ap.add_argument("--torch-tiles", type=int, default=2, help="tiles for the torch path (slow); 0 skips it")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch threads for the torch path (many tiny ops: 1 was fastest on a busy 2-core box)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()

    g = torch.Generator().manual_seed(20240611)
    x = torch.randn(max(args.tiles, args.small, args.torch_tiles), 256, generator=g)
    t0 = time.perf_counter()
    for K in range(2, 9):
        quantize_tiles(x[:2], K, "mcg", backend="numba")  # compile or load the cached kernel
    warm_s = time.perf_counter() - t0

    result: dict = {"threads": __import__("numba").get_num_threads(), "warmup_s": round(warm_s, 2)}
    result["k6_mcg"] = {"tiles": args.tiles, "tiles_per_s": round(_rate(lambda t: quantize_tiles(t, 6), x[: args.tiles]), 2)}
    result["per_k"] = {}
    for K in range(2, 9):
        rate = _rate(lambda t: quantize_tiles(t, K, "mcg", backend="numba"), x[: args.small])
        result["per_k"][str(K)] = {"tiles": args.small, "tiles_per_s": round(rate, 2)}
    if args.torch_tiles:
        torch.set_num_threads(args.torch_threads)
        n_thr = torch.get_num_threads()
        rate = _rate(lambda t: quantize_tiles_torch(t, 6), x[: args.torch_tiles])
        result["torch_k6"] = {"tiles": args.torch_tiles, "tiles_per_s": round(rate, 3), "torch_threads": n_thr}
        result["numba_over_torch"] = round(result["k6_mcg"]["tiles_per_s"] / rate, 1)
    try:
        result["loadavg_1min"] = os.getloadavg()[0]
    except OSError:
        pass

    if args.json:
        print(json.dumps(result))
        return
    print(f"numba threads {result['threads']}, warm-up {result['warmup_s']} s, load average {result.get('loadavg_1min')}")
    print(f"K=6 mcg, {args.tiles} tiles: {result['k6_mcg']['tiles_per_s']} tiles/s")
    for K, r in result["per_k"].items():
        print(f"K={K} mcg, {r['tiles']} tiles: {r['tiles_per_s']} tiles/s")
    if "torch_k6" in result:
        print(f"torch path K=6, {args.torch_tiles} tiles: {result['torch_k6']['tiles_per_s']} tiles/s "
              f"(numba is {result['numba_over_torch']}x faster)")


if __name__ == "__main__":
    main()
