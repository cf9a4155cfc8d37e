"""encode_linear wall time: seconds and tiles/s per weight shape, CPU and (when present) CUDA.

    python benchmarks/bench_encode.py                 # CPU: (256, 512) and (1024, 1024)
    python benchmarks/bench_encode.py --json out.json # also write the figures as JSON

On CUDA it adds (4096, 4096) and (4096, 14336). Each encode includes the sign draw, regularisation,
the global-scale search and the quantization of every tile; "tiles/s" counts the layer's tiles only
(the search quantizes ~15 x its sample on top).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from exl3tool.encode.online import encode_linear

CPU_SHAPES = [(256, 512), (1024, 1024)]
CUDA_SHAPES = [(4096, 4096), (4096, 14336)]


def bench(shape: tuple[int, int], device: str, bits: int, repeats: int) -> dict:
    """Encode a fresh random (k, n) weight ``repeats`` times on ``device``; report the best wall time."""
    k, n = shape
    gen = torch.Generator().manual_seed(k * 7919 + n)
    weight = (torch.randn(k, n, generator=gen) * 0.02).to(device)
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        enc = encode_linear(weight, bits=bits, seed=1234)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    tiles = (k // 16) * (n // 16)
    return {"device": device, "k": k, "n": n, "bits": bits, "seconds": best, "tiles": tiles,
            "tiles_per_s": tiles / best, "g_scale": enc.g_scale, "proxy_error": enc.proxy_error}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1, help="encodes per shape; the fastest is reported")
    ap.add_argument("--cpu-only", action="store_true", help="skip CUDA even when available")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results to this file")
    args = ap.parse_args()
    runs = [(shape, "cpu") for shape in CPU_SHAPES]
    if torch.cuda.is_available() and not args.cpu_only:
        runs += [(shape, "cuda") for shape in CPU_SHAPES + CUDA_SHAPES]
    results = []
    print(f"{'device':6} {'shape':>14} {'seconds':>9} {'tiles/s':>10}")
    for shape, device in runs:
        r = bench(shape, device, args.bits, args.repeats)
        results.append(r)
        print(f"{device:6} {str(shape):>14} {r['seconds']:9.2f} {r['tiles_per_s']:10.1f}", flush=True)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"bits": args.bits, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
