"""Where a small layer's wall time goes on a GPU: the GPU's busy and idle time over one ``encode_linear`` (as the
drop-in calls it: no stage timer, the default budget), the Viterbi launches one by one, the idle gaps with the
kernels around them, and every host sync with the line that made it.

    python benchmarks/timeline_encode.py --shapes 128x4096:4,512x4096:6 --json out.json

Per shape, after two warm-up encodes: the wall time of one plain encode (median of 5); a CUDA-only
torch.profiler trace of one encode (kernels, copies and memsets with their device timestamps: little overhead on
the host), from which the busy time, each Viterbi launch's duration and the gaps over ``--gap-us`` come; and one
encode under ``torch.cuda.set_sync_debug_mode("warn")``, whose warnings give each synchronizing call's line.
A diagnosis, not a comparison: ``bench_dropin.py`` compares with the reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exl3tool.encode.online import encode_linear, encode_memory_plan  # noqa: E402
from profile_encode import layer_weights  # noqa: E402  (benchmarks/ is the script's folder)


def _gpu_events(w: torch.Tensor, bits: int) -> tuple[float, list[dict]]:
    """One encode under a CUDA-only profiler: (wall seconds, GPU activities sorted by start, in us)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        encode_linear(w, bits=bits, seed=23)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    acts = [e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    acts.sort(key=lambda e: e["ts"])
    return wall, [{"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"]),
                   "grid": e.get("args", {}).get("grid")} for e in acts]


def _timeline(acts: list[dict], gap_us: float) -> dict:
    """Busy time (activities merged), the Viterbi launches and the idle gaps between activities."""
    busy, end, gaps = 0.0, None, []
    prev = None
    for a in acts:
        s, e = a["ts"], a["ts"] + a["dur"]
        if end is None or s >= end:
            if end is not None and s - end >= gap_us:
                gaps.append({"us": s - end, "after": prev["name"][:60], "before": a["name"][:60]})
            busy += a["dur"]
            end = e
        elif e > end:
            busy += e - end
            end = e
        prev = a
    span = (acts[-1]["ts"] + acts[-1]["dur"] - acts[0]["ts"]) if acts else 0.0
    vit = [{"ms": a["dur"] / 1e3, "grid": a["grid"]} for a in acts if "viterbi" in a["name"]]
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "activities": len(acts), "viterbi": vit,
            "viterbi_ms": sum(v["ms"] for v in vit), "gaps": gaps, "gap_ms": sum(g["us"] for g in gaps) / 1e3}


def _syncs(w: torch.Tensor, bits: int) -> list[dict]:
    """The synchronizing calls of one encode, by source line (sync debug mode's warnings)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            encode_linear(w, bits=bits, seed=29)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines = Counter(f"{Path(c.filename).name}:{c.lineno}" for c in caught if "synchroniz" in str(c.message))
    return [{"line": line, "count": n} for line, n in lines.most_common()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="128x4096:4,4096x128:4,1024x4096:4,512x4096:6,256x7168:6,1536x3072:6")
    ap.add_argument("--gap-us", type=float, default=50.0, help="list idle gaps at least this long")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    rows = []
    for k, n, bits, w in layer_weights(args.shapes, lambda k, n: k * 7 + n):
        for seed in (3, 4):  # compile, caches
            encode_linear(w, bits=bits, seed=seed)
        walls = []
        for rep in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            encode_linear(w, bits=bits, seed=11 + rep)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        traced_wall, acts = _gpu_events(w, bits)
        tl = _timeline(acts, args.gap_us)
        plan = encode_memory_plan(k, n, bits, w.device)
        row = {"k": k, "n": n, "bits": bits, "wall_ms": statistics.median(walls) * 1e3,
               "traced_wall_ms": traced_wall * 1e3, "slots": plan.slots, "rows": plan.rows, "chunk": plan.chunk_tiles, **tl,
               "syncs": _syncs(w, bits)}
        rows.append(row)
        print(f"({k}, {n}) K={bits}: wall {row['wall_ms']:.1f} ms (traced {row['traced_wall_ms']:.1f}); GPU span "
              f"{tl['span_ms']:.1f}, busy {tl['busy_ms']:.1f} in {tl['activities']} activities; Viterbi "
              f"{tl['viterbi_ms']:.1f} ms in {len(tl['viterbi'])} launches "
              f"({', '.join('%.2f' % v['ms'] for v in tl['viterbi'])}); slots {plan.slots} (rows {plan.rows}); gaps >= "
              f"{args.gap_us:.0f} us: {len(tl['gaps'])}, {tl['gap_ms']:.1f} ms", flush=True)
        for g in sorted(tl["gaps"], key=lambda g: -g["us"])[:12]:
            print(f"    gap {g['us'] / 1e3:6.2f} ms after {g['after']} | before {g['before']}")
        print("    syncs: " + ", ".join(f"{s['line']} x{s['count']}" for s in row["syncs"]), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
