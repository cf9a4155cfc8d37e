"""Where one encode's time goes, stage by stage (``StageTimer``), on the deployed layer shapes: a profile, not a
comparison (``bench_dropin.py`` compares with the reference).

    python benchmarks/profile_encode.py --shapes 4096x4096:4,128x4096:4,512x4096:6 --json out.json

Per shape: the median of 3 encodes (after a warm-up) of each stage's seconds (h2d, regularize, scale_search, viterbi,
pack), the Viterbi tiles of the layer and of the scale search, and the plan's slots and chunk. ``--trace`` adds, per
shape, a torch.profiler summary of one more encode: GPU time of the Viterbi kernel and of everything else, the
number of kernel launches and of host syncs, and the busiest other kernels (where a small layer's time goes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exl3tool.encode.memory import sample_tile_count  # noqa: E402
from exl3tool.encode.online import encode_linear, encode_memory_plan  # noqa: E402
from exl3tool.timing import StageTimer  # noqa: E402


def trace_encode(w: torch.Tensor, bits: int) -> dict:
    """One encode under torch.profiler: GPU time of the Viterbi kernel and of the rest, launches, syncs."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        encode_linear(w, bits=bits, seed=11)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    kernels: dict[str, list[float]] = {}
    syncs = 0
    for ev in prof.key_averages():
        self_gpu = getattr(ev, "self_device_time_total", 0) or 0  # us; only kernels, copies and memsets have it
        if self_gpu > 0:
            kernels[ev.key[:70]] = [self_gpu / 1e6 / ev.count] * ev.count
        if ev.key in ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize"):
            syncs += ev.count
    total = {name: (len(v), sum(v)) for name, v in kernels.items()}
    vit = sum(t for name, (c, t) in total.items() if "viterbi" in name)
    rest = sorted(((t, c, name) for name, (c, t) in total.items() if "viterbi" not in name), reverse=True)
    out = {"wall_s": wall, "viterbi_gpu_s": vit, "other_gpu_s": sum(t for t, _, _ in rest),
           "launches": sum(c for c, _ in total.values()), "syncs": syncs,
           "top_other": [{"name": n, "count": c, "gpu_s": t} for t, c, n in rest[:12]]}
    print(f"  trace: wall {wall * 1e3:.1f} ms, viterbi GPU {vit * 1e3:.1f} ms, other GPU "
          f"{out['other_gpu_s'] * 1e3:.1f} ms in {out['launches']} launches, {syncs} syncs", flush=True)
    for r in out["top_other"]:
        print(f"    {r['gpu_s'] * 1e3:7.2f} ms {r['count']:5}x  {r['name']}")
    return out


def layer_weights(shapes: str, seed_of=lambda k, n: k + n):
    """(k, n, bits, weight on the GPU) for each ``KxN:BITS`` of a comma-separated list: Gaussian columns of scales
    0.005 to 0.05, the generator seeded by ``seed_of(k, n)`` (the same weight in every run)."""
    for item in shapes.split(","):
        shape, bits = item.split(":")
        k, n = (int(v) for v in shape.split("x"))
        gen = torch.Generator().manual_seed(seed_of(k, n))
        w = (torch.randn(k, n, generator=gen) * torch.empty(1, n).uniform_(0.005, 0.05, generator=gen)).cuda()
        yield k, n, int(bits), w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096:4,128x4096:4,4096x12288:4,512x4096:6,256x7168:6,5120x6144:6")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--trace", action="store_true", help="also a torch.profiler summary of one encode per shape")
    args = ap.parse_args()
    rows = []
    for k, n, bits, w in layer_weights(args.shapes):
        encode_linear(w, bits=bits, seed=5)  # warm-up (compile)
        runs = []
        for rep in range(3):
            timer = StageTimer()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            encode_linear(w, bits=bits, seed=5 + rep, timer=timer)
            torch.cuda.synchronize()
            stages = {name: v["seconds"] for name, v in timer.as_dict().items()}
            stages["total"] = time.perf_counter() - t0
            runs.append(stages)
        med = {name: statistics.median(r.get(name, 0.0) for r in runs) for name in runs[0]}
        plan = encode_memory_plan(k, n, bits, "cuda")
        search = sample_tile_count(k, n)
        row = {"k": k, "n": n, "bits": bits, "tiles": (k // 16) * (n // 16), "search_tiles": search + 2 * search // 5,
               "slots": plan.slots, "rows": plan.rows, "chunk": plan.chunk_tiles, "seconds": med}
        if args.trace:
            row["trace"] = trace_encode(w, bits)
        rows.append(row)
        print(f"({k}, {n}) K={bits}: tiles {row['tiles']:,} + search {row['search_tiles']:,}; slots {plan.slots} (rows {plan.rows}) chunk "
              f"{plan.chunk_tiles}; " + ", ".join(f"{s} {v * 1e3:.1f} ms" for s, v in med.items()), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
