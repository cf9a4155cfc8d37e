"""Hydrate's encodes of the deployed layers of a Qwen3.8-27B-shaped and a GLM-5-shaped checkpoint, against exllamav3's
quantize_exl3 called as the fork calls it (tests/_fork_loader.py), on one GPU. Not run by the tests.

    PYTHONPATH=$PWD:/tmp/site python benchmarks/bench_hydrate.py --reference /tmp/site/exllamav3 --per-shape \
        --time-budget 240 --json hydrate.json

The module list is `exl3tool hydrate`'s plan (``plan_hydrate``) of a synthetic checkpoint (benchmarks/fleet_models.py
shapes; random BF16 data for the layers timed, holes elsewhere). ``--per-shape`` times each distinct (K, N) once
and multiplies by its count (the output says so). ``--time-budget`` stops starting new shapes after that many seconds
and prints what it has. Prints per shape and in total: our seconds, the reference's, the ratio, peak GPU memory of
each (torch.cuda.max_memory_allocated around each call), and the process's peak host RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from _fork_loader import fork_call, load_quantize_exl3  # noqa: E402
from fleet_models import write_model  # noqa: E402

MODELS = {"qwen38-27b": "Qwen3.8-27B", "glm5": "GLM-5"}
QWEN38_OVERLAY = ('{"linear":{"weight":"mxfp8"},"ignore":["re:.*visual\\\\..*","re:.*in_proj_a$",'
                  '"re:.*in_proj_b$","re:.*in_proj_ba$","re:.*mtp\\\\..*","lm_head"]}')
OVERLAYS = {"qwen38-27b": QWEN38_OVERLAY, "glm5": '{"linear": "mxfp8", "shared_experts": "mxfp8"}'}


def shapes_of(model: str, work: Path, bits: int, tiny: bool = False) -> Counter:
    """(K, N) -> how many modules `exl3tool hydrate` stores with that shape (its plan, headers only)."""
    from exl3tool.operations.hydrate import plan_hydrate
    from exl3tool.plan import ServerRequest

    src = write_model(work / model, model, real_layers=(), tiny=tiny)
    plan = plan_hydrate(ServerRequest(model=str(src), quantization_config=OVERLAYS[model], bits=bits), work / f"{model}-out")
    return Counter((m.source.in_features, m.source.out_features) for m in plan.modules)


def timed(fn, device) -> tuple[float, int]:
    """Seconds of ``fn()`` and the peak GPU memory it allocated above what was allocated before (0 on a CPU)."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start, 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start, torch.cuda.max_memory_allocated(device) - base


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", default=None, help="exllamav3 1.6.5 package directory (loaded as the fork loads it)")
    ap.add_argument("--models", default="qwen38-27b,glm5")
    ap.add_argument("--bits", type=int, default=6)
    ap.add_argument("--per-shape", action="store_true", help="time each distinct shape once, multiply by its count")
    ap.add_argument("--time-budget", type=float, default=1e9, help="seconds after which no new shape is started")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run, with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="the models' tiny configs (tests/test_bench_hydrate.py)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_hydrate needs a CUDA GPU (or --device cpu --tiny for a smoke run)")
    import exl3tool.encode as enc

    encode_linear = enc.encode_linear
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    ref = load_quantize_exl3(args.reference, package="_exllamav3_reference") if args.reference else None
    start = time.perf_counter()
    doc = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "bits": args.bits, "per_shape": args.per_shape, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            counts = shapes_of(model, Path(tmp), args.bits, args.tiny)
            rows, partial = [], False
            for (k, n), count in sorted(counts.items(), key=lambda kv: -kv[0][0] * kv[0][1]):
                if time.perf_counter() - start > args.time_budget:
                    partial = True
                    break
                reps = 1 if args.per_shape else count
                w = (torch.randn(n, k, generator=torch.Generator().manual_seed(k * 7 + n)) * 0.02).to(torch.bfloat16)
                src = w.t().float().contiguous()
                encode_linear(src[:256, :256].to(device), bits=args.bits, seed=1, device=device)  # compile once
                ours = [timed(lambda: encode_linear(src.to(device), bits=args.bits, seed=1, device=device), device)
                        for _ in range(reps)]
                row = {"k": k, "n": n, "count": count, "timed": reps,
                       "ours_s": sum(t for t, _ in ours) * count / reps, "ours_peak": max(p for _, p in ours)}
                if ref is not None:
                    theirs = [timed(lambda: fork_call(ref, w.to(device), args.bits, 1, device), device)
                              for _ in range(reps)]
                    row.update(ref_s=sum(t for t, _ in theirs) * count / reps, ref_peak=max(p for _, p in theirs))
                    row["ratio"] = row["ref_s"] / row["ours_s"]
                rows.append(row)
                print(f"{model} {k}x{n} x{count}{' (timed once, x count)' if args.per_shape else ''}: ours "
                      f"{row['ours_s']:.2f} s peak {row['ours_peak'] / 2**20:.0f} MiB"
                      + (f"; reference {row['ref_s']:.2f} s peak {row['ref_peak'] / 2**20:.0f} MiB; ratio "
                         f"{row['ratio']:.2f}x" if ref is not None else ""), flush=True)
            total = {"ours_s": sum(r["ours_s"] for r in rows), "shapes_done": len(rows), "shapes": len(counts),
                     "modules": sum(counts.values()), "partial": partial,
                     "ours_peak": max((r["ours_peak"] for r in rows), default=0)}
            if ref is not None and rows:
                total.update(ref_s=sum(r["ref_s"] for r in rows), ref_peak=max(r["ref_peak"] for r in rows))
                total["ratio"] = total["ref_s"] / total["ours_s"]
            doc["models"][model] = {"rows": rows, "total": total}
            print(f"{MODELS.get(model, model)}: {total}", flush=True)
    doc["host_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak host RSS {doc['host_peak_rss_mib']:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
