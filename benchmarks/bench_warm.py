"""Warm benchmark: time and peak memory of `cache warm` on a synthetic Llama model, cold and all-hits.

    python benchmarks/bench_warm.py                       # CPU, the test model (hidden 256, 2 layers)
    python benchmarks/bench_warm.py --preset gpu --device cuda   # real-size layers (hidden 4096), 1 layer

Prints a table (cold seconds, all-hits seconds, tiles/s per layer, peak RSS / CUDA memory) and, with
--json FILE, writes the figures. The all-hits run is the baseline the cold run is compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch

from exl3tool.checkpoint.synthetic import write_llama_checkpoint
from exl3tool.plan import ServerRequest
from exl3tool.operations.warm import warm

PRESETS = {
    "cpu": dict(hidden=256, heads=4, kv_heads=2, intermediate=512, layers=2),
    "gpu": dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336, layers=1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=PRESETS, default="cpu")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tp-sizes", default="1,2")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    shape = PRESETS[args.preset]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="exl3tool-bench-"))
    t0 = time.perf_counter()
    ckpt = write_llama_checkpoint(work / "model", dtype=torch.bfloat16, seed=1, shards=2, **shape)
    t_write = time.perf_counter() - t0
    request = ServerRequest(
        model=str(ckpt), tp_sizes=tuple(int(t) for t in args.tp_sizes.split(",")), cache_dir=str(work / "cache"),
        device=args.device, encoder_root="/encoders/exllamav3", encoder_revision="bench",
    )
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    cold = warm(request)
    t_cold = time.perf_counter() - t0
    rss_cold = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cuda_peak = torch.cuda.max_memory_allocated() / 2**20 if args.device.startswith("cuda") else None
    t0 = time.perf_counter()
    hits = warm(request)
    t_hits = time.perf_counter() - t0
    assert hits.counts["hit"] == cold.counts["encoded"] + cold.counts["hit"], "second warm was not all hits"

    per_layer = []
    for e in cold.entries:
        if e.status == "encoded":
            tiles = e.input_size * e.output_size // 256
            per_layer.append({"prefix": e.prefix, "tp": e.tp_size, "rank": e.tp_rank, "tiles": tiles,
                              "seconds": e.seconds, "tiles_per_s": tiles / e.seconds if e.seconds else None})
    total_tiles = sum(r["tiles"] for r in per_layer)
    result = {
        "preset": args.preset, "shape": shape, "device": args.device, "tp_sizes": args.tp_sizes,
        "checkpoint_write_s": round(t_write, 2), "cold_s": round(t_cold, 2), "all_hits_s": round(t_hits, 3),
        "ratio_cold_over_hits": round(t_cold / t_hits, 1), "entries": cold.counts, "tiles": total_tiles,
        "tiles_per_s": round(total_tiles / t_cold, 1), "peak_rss_mib": round(rss_cold, 1),
        "peak_cuda_mib": None if cuda_peak is None else round(cuda_peak, 1),
        "bytes_written": cold.bytes_written, "per_layer": per_layer, "torch_threads": torch.get_num_threads(),
    }
    print(f"{'preset':>8} {'device':>7} {'entries':>7} {'tiles':>9} {'cold s':>8} {'hits s':>7} {'cold/hits':>9} "
          f"{'tiles/s':>8} {'RSS MiB':>8} {'CUDA MiB':>8}")
    print(f"{args.preset:>8} {args.device:>7} {cold.counts['encoded']:>7} {total_tiles:>9} {t_cold:>8.1f} {t_hits:>7.2f} "
          f"{t_cold / t_hits:>9.0f} {total_tiles / t_cold:>8.0f} {rss_cold:>8.0f} {cuda_peak or 0:>8.0f}")
    print("per layer (tiles/s):", ", ".join(f"{r['prefix'].split('.', 3)[-1]}@tp{r['tp']}r{r['rank']}={r['tiles_per_s']:.0f}" for r in per_layer[:12]))
    out = args.json_path or (os.path.join(os.environ["OUT"], "bench_warm.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
