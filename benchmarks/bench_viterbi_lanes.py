"""The Viterbi kernel with several tiles per program (tile lanes, issue 52) against today's default, one GPU.

A program of ``lanes`` tiles keeps one fp16 cost per tile in each half of its f16x2 words, so one codebook read serves
``lanes`` tiles (``exl3tool.kernels.viterbi``, ``_forward_lanes``). This sweep times, per K, the default launch
(``baseline``) and each variant (lanes, rows, warps, tiles in flight per SM), checks every variant's states against
the baseline's bit for bit, and records registers, the resident wave and the peak GPU memory of each call. With
``--reference`` it also times exllamav3 1.6.5's ``quantize_tiles`` (the reference's CUDA Viterbi) on the same tiles
and checks its states are the baseline's. ``--sass`` writes the SASS of the K = 6 variants and the instruction mix of
their inner loop.

    python benchmarks/bench_viterbi_lanes.py --json out.json [--reference /tmp/site/exllamav3] [--sass DIR]

Variants compile first in parallel worker processes (``--compile-jobs``; Triton's disk cache), then run one at a
time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("EXL3TOOL_RESIDENT_CAP", "0")  # programs as asked: what the per-SM column says

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exl3tool.kernels import viterbi as vmod  # noqa: E402
from _viterbi_compiled import last_compiled, record  # noqa: E402

record()

# (lanes, rows, warps or None for the kernel's rule, tiles in flight per SM); rows 2 only at K <= 6
VARIANTS = {
    "k6": [(1, 1, None, 8), (2, 1, None, 8), (2, 1, None, 16), (4, 1, None, 8), (4, 1, None, 16), (4, 1, None, 24),
           (4, 1, 8, 16), (1, 2, None, 4), (2, 2, None, 4), (4, 2, None, 4), (4, 2, 8, 4), (2, 2, None, 2),
           (4, 2, 8, 2)],
    "k4": [(1, 1, None, 8), (2, 1, None, 8), (4, 1, None, 8), (4, 1, None, 16), (4, 1, 8, 8), (1, 2, None, 4),
           (2, 2, None, 4), (4, 2, None, 4), (4, 2, 8, 4)],
    "k5": [(1, 1, None, 8), (4, 1, None, 8), (4, 1, None, 16)],
    "k7": [(1, 1, None, 8), (4, 1, None, 8), (4, 1, None, 16)],
    "k8": [(1, 1, None, 8), (2, 1, None, 8), (4, 1, None, 8), (4, 1, None, 16), (4, 1, 2, 8)],
}


def timed(x: torch.Tensor, bits: int, reps: int = 3, **kw) -> tuple[float, torch.Tensor, int]:
    """Median seconds of one call after a warm-up call, its states, and the call's peak GPU bytes above its input."""
    _, states = vmod.viterbi_tiles(x, bits, "mcg", **kw)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        vmod.viterbi_tiles(x, bits, "mcg", **kw)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), states, torch.cuda.max_memory_allocated() - before


def _variant_kw(bits: int, v: tuple, sms: int) -> dict:
    lanes, rows, warps, per_sm = v
    return dict(lanes=lanes, rows=rows, num_warps=warps, programs=per_sm * sms)


def _compile_one(job: tuple) -> str:
    """Worker: compile one variant into Triton's disk cache (a tiny launch of the same specialisation)."""
    bits, v = job
    t0 = time.perf_counter()
    try:
        x = torch.randn(8, 256, device="cuda")
        vmod.viterbi_tiles(x, bits, "mcg", **_variant_kw(bits, v, 1))
        torch.cuda.synchronize()
        return f"K={bits} {v} {time.perf_counter() - t0:.1f} s"
    except Exception as exc:  # noqa: BLE001 - reported by the timing pass
        return f"K={bits} {v} failed: {type(exc).__name__}: {str(exc)[:300]}"


def precompile(jobs: list[tuple], workers: int) -> None:
    import multiprocessing as mp

    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        for line in pool.imap_unordered(_compile_one, jobs):
            print("  compiled", line, flush=True)
    print(f"precompile: {len(jobs)} variants in {time.perf_counter() - t0:.1f} s", flush=True)


def inner_loop_mix(sass: str) -> dict:
    """Instruction counts of the smallest loop holding >= 16 HFMA2 (the candidate loop), per candidate step."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    best = None
    for addr, txt in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            n = sum("HFMA2" in t for t in body)
            if n >= 16 and (best is None or len(body) < len(best)):
                best = body
    if best is None:
        return {}
    count = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in best)
    return {"instructions": len(best), "mix": dict(count.most_common())}


def reference_rate(ref_root: str, x: torch.Tensor, bits: int, base_states: torch.Tensor) -> dict:
    """exllamav3 1.6.5's quantize_tiles on x: tiles/s (median of 3 after a warm-up), peak, same states."""
    sys.path.insert(0, str(REPO / "tests"))
    from _fork_loader import load_quantize_exl3

    load_quantize_exl3(ref_root, package="_exllamav3_reference")
    q = sys.modules["_exllamav3_reference.modules.quant.exl3_lib.quantize"]
    args = {"K": bits, "devices": ["cuda:0"], "apply_out_scales": True, "mcg": True}
    _, idx = q.quantize_tiles(x, args)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        q.quantize_tiles(x, args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    sec = statistics.median(times)
    return {"tiles_per_s": x.shape[0] / sec, "seconds": sec, "same_states": bool(torch.equal(idx, base_states)),
            "peak_mib": (torch.cuda.max_memory_allocated() - before) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", default="6,4,8,5,7")
    ap.add_argument("--tiles", type=int, default=32768)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--reference", default=None, help="exllamav3 1.6.5 source root: time its quantize_tiles too")
    ap.add_argument("--reference-bits", default="6,4,8")
    ap.add_argument("--sass", default=None, help="folder for the K = 6 variants' SASS and loop mixes")
    ap.add_argument("--compile-jobs", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting variants after this many seconds")
    ap.add_argument("--variants", default="all", help="all (the table above), none (the default launch only), or "
                    "best=JSON: the fastest variant with the baseline's states per K in an earlier run's JSON")
    args = ap.parse_args()
    t_start = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    bits_list = [int(b) for b in args.bits.split(",")]
    variants = {f"k{b}": [] if args.variants == "none" else VARIANTS[f"k{b}"] for b in bits_list}
    if args.variants.startswith("best="):
        earlier = json.loads(Path(args.variants[5:]).read_text())
        for b in bits_list:
            rows = [r for r in earlier["rows"] if r.get("bits") == b and r.get("same_states") and "lanes" in r]
            best = max(rows, key=lambda r: r["tiles_per_s"], default=None)
            variants[f"k{b}"] = [(best["lanes"], best["rows"], best["warps"], best["per_sm"])] if best else []
    doc = {"gpu": torch.cuda.get_device_name(0), "sms": sms, "tiles": args.tiles, "rows": [], "reference": {},
           "sass": {}}
    print(f"{doc['gpu']}, {sms} SMs, {args.tiles} tiles per call", flush=True)
    if args.compile_jobs > 1:
        jobs = [(b, v) for b in bits_list for v in variants[f"k{b}"]]
        jobs += [(b, (1, None, None, 0)) for b in bits_list]
        precompile([(b, v) for b, v in jobs if v[3]], args.compile_jobs)
    for bits in bits_list:
        gen = torch.Generator(device="cuda").manual_seed(1000 + bits)
        x = torch.randn(args.tiles, 256, device="cuda", generator=gen)
        x *= 0.6 + torch.rand(args.tiles, 1, device="cuda", generator=gen)
        base_s, base_states, base_peak = timed(x, bits)
        doc["rows"].append({"bits": bits, "variant": "baseline", "tiles_per_s": args.tiles / base_s,
                            "peak_mib": base_peak / 2**20, "regs": getattr(last_compiled(), "n_regs", None)})
        print(f"K={bits}: baseline (today's default launch) {args.tiles / base_s:10,.0f} tiles/s, peak "
              f"{base_peak / 2**20:7.0f} MiB", flush=True)
        for v in variants[f"k{bits}"]:
            if args.budget_s and time.perf_counter() - t_start > args.budget_s:
                print("  budget spent: variants left out", flush=True)
                break
            try:
                sec, states, peak = timed(x, bits, **_variant_kw(bits, v, sms))
            except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
                print(f"  {v}: failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            c = last_compiled()
            row = {"bits": bits, "lanes": v[0], "rows": v[1], "warps": getattr(c.metadata, "num_warps", v[2]),
                   "per_sm": v[3], "tiles_per_s": args.tiles / sec, "vs_baseline": base_s / sec,
                   "same_states": bool(torch.equal(states, base_states)), "peak_mib": peak / 2**20,
                   "regs": getattr(c, "n_regs", None), "spills": getattr(c, "n_spills", None),
                   "resident_programs": vmod._occupancy(c, props)}
            doc["rows"].append(row)
            print(f"  lanes {v[0]} rows {v[1]} warps {row['warps']} per-SM {v[3]:2}: {row['tiles_per_s']:10,.0f} "
                  f"tiles/s x{row['vs_baseline']:.2f} same {row['same_states']} regs {row['regs']} resident "
                  f"{row['resident_programs']} peak {row['peak_mib']:.0f} MiB", flush=True)
            if args.sass and bits == 6 and v[1] == 1 and v[3] in (8, 16):
                sass = c.asm.get("sass") if hasattr(c, "asm") else None
                if sass:
                    name = f"k6_lanes{v[0]}_w{row['warps']}"
                    Path(args.sass).mkdir(parents=True, exist_ok=True)
                    Path(args.sass, name + ".sass").write_text(str(sass))
                    doc["sass"][name] = inner_loop_mix(str(sass))
                    print(f"    {name} inner loop: {doc['sass'][name]}", flush=True)
        if args.reference and str(bits) in args.reference_bits.split(","):
            try:
                ref = reference_rate(args.reference, x, bits, base_states)
                ref["ratio_baseline"] = (args.tiles / base_s) / ref["tiles_per_s"]
                best = max((r for r in doc["rows"] if r.get("bits") == bits and r.get("same_states")),
                           key=lambda r: r["tiles_per_s"], default=None)
                if best:
                    ref["ratio_best"] = best["tiles_per_s"] / ref["tiles_per_s"]
                doc["reference"][bits] = ref
                print(f"  reference quantize_tiles: {ref['tiles_per_s']:10,.0f} tiles/s, same {ref['same_states']}, "
                      f"peak {ref['peak_mib']:.0f} MiB; baseline x{ref['ratio_baseline']:.2f}, best "
                      f"x{ref.get('ratio_best', 0):.2f}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"  reference failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(doc, indent=1))
    print(f"total {time.perf_counter() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
