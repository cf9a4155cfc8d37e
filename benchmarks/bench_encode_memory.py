"""Peak memory and time of one uncalibrated K6 encode per layer shape: exl3tool, and exllamav3 where importable.

GPU (``--device cuda``): peak is ``torch.cuda.max_memory_allocated`` above the fp32 weight already on the device,
for exl3tool at its default budget (the reference's: 3.5x the weight and its cached scratch) and, with ``--unbounded``, at a budget that
never binds (the pre-budget speed); the reference is called as the serving fork calls it (fp32 (k, n) weight on
the GPU, meta Hessian, K/seed/devices/apply_out_scales/mcg, ``return_weight_q=False``) and its bytes are compared.
CPU (``--device cpu``): each shape runs in a fresh process; peak is the host's resident high-water mark (VmHWM,
reset through /proc/self/clear_refs) above the resident size with the weight allocated. ``--phases`` (CPU) gives
that peak phase by phase against the plan's figure of each phase (``host_peak.py``), for the large shapes in
seconds: every phase and every chunk runs, but the numba kernel only on ``--real-tiles`` tiles of each call (its
memory does not depend on the tiles' values; the rows of the rest are copies); a calibration call compares the
stand-in with the real kernel on one chunk of the first shape.

    python benchmarks/bench_encode_memory.py --device cuda --unbounded --json $OUT/bench_encode_memory.json
    python benchmarks/bench_encode_memory.py --device cpu --shapes 512x1024,1024x1024,1024x2048
    python benchmarks/bench_encode_memory.py --device cpu --phases --json benchmarks/results/bench_encode_memory_cpu_large.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

# (k, n) and where the shape comes from (the issue's table; the deployed models' planned jobs)
SHAPES = [
    ((5120, 6144), "issue 24"),
    ((16384, 7168), "DeepSeek-V3 o_proj TP1"),
    ((18432, 7168), "DeepSeek-V3 dense down_proj TP1"),
    ((7168, 36864), "DeepSeek-V3 dense gate_up_proj TP1"),
    ((1536, 24576), "DeepSeek-V3 q_b_proj TP1"),
    ((512, 32768), "DeepSeek-V3 kv_b_proj TP1"),
    ((7168, 4608), "DeepSeek-V3 dense gate_up_proj TP8"),
    ((2048, 7168), "DeepSeek-V3 o_proj TP8"),
    ((4096, 12288), "GLM-5.3-Flash dense gate_up_proj TP2"),
    ((6144, 4096), "GLM-5.3-Flash dense down_proj TP2"),
    ((4096, 4096), "GLM-5.3-Flash o_proj TP2"),
    ((5120, 34816), "Qwen3.8-27B gate_up_proj TP1"),
    ((17408, 5120), "Qwen3.8-27B down_proj TP1"),
    ((4096, 14336), "Llama-3.1-8B gate_proj"),
]
SEED = 1234


def _weight(k: int, n: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(k * 131 + n)
    w = torch.randn(k, n, generator=gen) * torch.empty(1, n).uniform_(0.005, 0.05, generator=gen)
    return w.to(device)


def _reference(root: str | None = None):
    """exllamav3's quantize_exl3, or None where it is not importable.

    With ``root`` (an exllamav3 package directory) it is loaded as the serving fork loads its encoder source
    (synthetic namespace packages, no package ``__init__``: ``tests/_fork_loader.py``), else imported normally.
    """
    try:
        if root:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
            from _fork_loader import load_quantize_exl3

            quantize_exl3 = load_quantize_exl3(root, package="_exllamav3_reference")
        else:
            from exllamav3.modules.quant.exl3_lib.quantize import quantize_exl3
    except Exception as exc:  # not installed, or its CUDA extension does not build here
        print(f"reference not importable ({type(exc).__name__}: {exc}); exl3tool only", file=sys.stderr)
        return None
    return quantize_exl3


def _measure_cuda(fn, w: torch.Tensor) -> tuple[float, int, object]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn(w)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base, out


def _run_reference(quantize_exl3, w: torch.Tensor):
    k = w.shape[0]
    h_data = {"H": torch.empty(k, k, device="meta"), "L": None, "device": w.device, "count": 0, "finalized": False}
    args = {"K": 6, "seed": SEED, "devices": [str(w.device)], "apply_out_scales": True, "mcg": True}
    _, _, tensors = quantize_exl3(w, h_data, args, return_weight_q=False, verbose=False)
    return tensors


def bench_cuda(shapes, unbounded: bool, with_reference: bool, reference_root: str | None = None) -> list[dict]:
    from exl3tool.encode.memory import default_budget
    from exl3tool.encode.online import encode_linear, encode_memory_plan

    # warm-ups compile the kernels outside the timings; what each leaves allocated (the reference caches its
    # Viterbi scratch between calls) is part of what that encoder holds while it encodes a layer: its footprint.
    # The process's cuBLAS workspace (made by the first matmul, kept; exl3tool's Hadamard matmul would make it, a
    # server's own matmuls keep it anyway) is made first, so neither encoder's figure holds it
    before = torch.cuda.memory_allocated()
    torch.ones(128, 128, device="cuda") @ torch.ones(128, 128, device="cuda")
    torch.cuda.synchronize()
    print(f"cuBLAS workspace of the process: {(torch.cuda.memory_allocated() - before) / 2**20:.1f} MiB "
          "(counted for neither encoder)", file=sys.stderr, flush=True)
    before = torch.cuda.memory_allocated()
    encode_linear(_weight(256, 512, "cuda"), bits=6, seed=1)
    torch.cuda.synchronize()
    tool_kept = torch.cuda.memory_allocated() - before
    ref = _reference(reference_root) if with_reference else None
    ref_kept = 0
    if ref is not None:
        before = torch.cuda.memory_allocated()
        _run_reference(ref, _weight(256, 512, "cuda"))
        torch.cuda.synchronize()
        ref_kept = torch.cuda.memory_allocated() - before
    print(f"kept allocated between calls: exl3tool {tool_kept / 2**20:.1f} MiB, reference {ref_kept / 2**20:.1f} MiB",
          file=sys.stderr, flush=True)
    rows = []
    for (k, n), where in shapes:
        w = _weight(k, n, "cuda")
        mib = 4 * k * n / 2**20
        plan = encode_memory_plan(k, n, 6, "cuda")
        row = {"k": k, "n": n, "source": where, "weight_mib": round(mib, 1), "budget_mib": round(plan.budget_bytes / 2**20, 1),
               "predicted_peak_mib": round(plan.peak_bytes / 2**20, 1), "chunk_tiles": plan.chunk_tiles,
               "slots": plan.slots, "rows": plan.rows, "reference_estimate_mib": round(plan.budget_bytes / 2**20, 1)}
        sec, peak, enc = _measure_cuda(lambda x: encode_linear(x, bits=6, seed=SEED), w)
        row.update(tool_s=round(sec, 3), tool_peak_mib=round(peak / 2**20, 1), tool_peak_x=round(peak / 2**20 / mib, 2),
                   tool_footprint_mib=round((peak + tool_kept) / 2**20, 1))
        if unbounded:
            sec_u, peak_u, enc_u = _measure_cuda(lambda x: encode_linear(x, bits=6, seed=SEED, memory_budget_bytes=64 << 30), w)
            same = all(torch.equal(getattr(enc, t), getattr(enc_u, t)) for t in ("trellis", "suh", "svh"))
            row.update(unbounded_s=round(sec_u, 3), unbounded_peak_mib=round(peak_u / 2**20, 1),
                       unbounded_same_bytes=same and enc.proxy_error == enc_u.proxy_error)
            del enc_u
        if ref is not None:
            w_ref = w.clone()  # the reference regularises its input in place
            sec_r, peak_r, tensors = _measure_cuda(lambda x: _run_reference(ref, x), w_ref)
            del w_ref
            same = all(torch.equal(getattr(enc, t).cpu().reshape(-1), tensors[t].cpu().reshape(-1).view(getattr(enc, t).dtype))
                       for t in ("trellis", "suh", "svh"))
            row.update(ref_s=round(sec_r, 3), ref_peak_mib=round(peak_r / 2**20, 1), ref_peak_x=round(peak_r / 2**20 / mib, 2),
                       ref_footprint_mib=round((peak_r + ref_kept) / 2**20, 1),
                       peak_ratio=round(peak / peak_r, 3),
                       footprint_ratio=round((peak + tool_kept) / (peak_r + ref_kept), 3),
                       speedup=round(sec_r / sec, 2), same_bytes_as_ref=same)
        del enc, w
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert all(r["budget_mib"] >= default_budget(r["k"], r["n"], 6, "cuda", sms) / 2**20 - 0.1 for r in rows)
    return rows


def _child(k: int, n: int) -> None:
    """One CPU encode in this fresh process; prints its host peak (VmHWM above the RSS with the weight) and time."""
    from exl3tool.encode.memory import default_budget
    from exl3tool.encode.online import encode_linear

    encode_linear(_weight(128, 256, "cpu"), bits=6, seed=1)  # numba compile and thread start outside the figure
    w = _weight(k, n, "cpu")

    def status(field: str) -> int:
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    rss0 = status("VmRSS:")
    t0 = time.perf_counter()
    encode_linear(w, bits=6, seed=SEED)
    sec = time.perf_counter() - t0
    peak = status("VmHWM:") - rss0
    mib = 4 * k * n / 2**20
    print(json.dumps({"k": k, "n": n, "weight_mib": round(mib, 1), "host_peak_mib": round(peak / 2**20, 1),
                      "host_peak_x": round(peak / 2**20 / mib, 2), "budget_mib":
                      round(default_budget(k, n, 6, "cpu") / 2**20, 1), "seconds": round(sec, 2)}))


def bench_cpu(shapes) -> list[dict]:
    rows = []
    for (k, n), where in shapes:
        out = subprocess.run([sys.executable, __file__, "--child", f"{k}x{n}"], capture_output=True, text=True,
                             env=dict(os.environ))
        if out.returncode != 0:
            raise SystemExit(f"{k}x{n}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["source"] = where
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


ISSUE_SHAPES = [s for s in SHAPES if s[0] in {(5120, 6144), (16384, 7168), (18432, 7168), (7168, 36864)}]


def _host_peak():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import host_peak

    return host_peak


def _mib(b: float) -> float:
    return round(b / 2**20, 1)


def phase_row(r: dict) -> dict:
    """One shape's ``host_peak.measure_encode`` result as a JSON row: each phase measured and modelled, the peak
    against the plan's and 3.5 W."""
    k, n, w, plan = r["k"], r["n"], r["weight_bytes"], r["plan"]
    peaks, model = r["peaks"], r["model"]
    top = max(peaks, key=peaks.get)
    step = min(plan.chunk_tiles, 65536)  # the encoder's call size without a progress callback (online._step)
    return {
        "k": k, "n": n, "bits": r["bits"], "weight_mib": _mib(w), "budget_mib": _mib(plan.budget_bytes),
        "chunk_tiles": step, "chunks": math.ceil((k // 16) * (n // 16) / step),
        "plan_peak_mib": _mib(plan.peak_bytes), "x3_5_mib": _mib(3.5 * w),
        "phases": {p: {"measured_mib": _mib(peaks[p]), "x_w": round(peaks[p] / w, 2), "model_mib": _mib(model[p]),
                       "seconds": round(r["seconds"].get(p, 0.0), 2)} for p in peaks},
        "peak_mib": _mib(peaks[top]), "peak_x": round(peaks[top] / w, 2), "peak_phase": top,
        "within_plan": peaks[top] <= plan.peak_bytes, "within_3_5w": peaks[top] <= 3.5 * w,
        "phases_within_model": all(peaks[p] <= model[p] for p in peaks),
        "viterbi": r["viterbi"], "wall_s": round(r["wall_s"], 1),
    }


def _phases_child(k: int, n: int, real_tiles: int | None) -> None:
    hp = _host_peak()
    hp.warm_up()
    print(json.dumps(phase_row(hp.measure_encode(k, n, real_tiles=real_tiles))))


def _calibrate_child(tiles: int, real_tiles: int) -> None:
    hp = _host_peak()
    hp.warm_up()
    c = hp.calibrate(tiles, real_tiles)
    print(json.dumps({"tiles": tiles, "real_tiles": real_tiles, "standin_mib": _mib(c["standin_bytes"]),
                      "real_mib": _mib(c["real_bytes"]), "standin_s": round(c["standin_s"], 1),
                      "real_s": round(c["real_s"], 1)}))


def _run_child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=dict(os.environ))
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_cpu_phases(shapes, real_tiles: int | None, calibrate_tiles: int | None) -> dict:
    """Each shape's phases in a fresh process; first a calibration call (``calibrate_tiles`` None: one chunk of the
    first shape's plan, 0: none)."""
    from exl3tool.encode.memory import plan_encode_memory

    result: dict = {"device": "cpu", "threads": torch.get_num_threads(), "real_tiles": real_tiles}
    rt = "all" if real_tiles is None else str(real_tiles)
    if calibrate_tiles is None:
        (k, n), _ = shapes[0]
        calibrate_tiles = plan_encode_memory(k, n, 6, "cpu").chunk_tiles
    if calibrate_tiles and real_tiles is not None:
        result["calibration"] = _run_child(["--child-calibrate", str(calibrate_tiles), "--real-tiles", rt])
        print(json.dumps(result["calibration"]), file=sys.stderr, flush=True)
    rows = []
    for (k, n), where in shapes:
        row = _run_child(["--child-phases", f"{k}x{n}", "--real-tiles", rt])
        row["source"] = where
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    result["rows"] = rows
    return result


def phases_table(result: dict) -> str:
    """Markdown: per shape each phase's measured peak / the model's figure (MiB above the weight), then the peak."""
    rows = result["rows"]
    phases = list(rows[0]["phases"])
    head = ["layer (k, n)", "W", *phases, "peak (x W)", "plan peak", "3.5 W"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"({r['k']}, {r['n']})", f"{r['weight_mib']:,.0f}"]
        cells += [f"{r['phases'][p]['measured_mib']:,.0f} / {r['phases'][p]['model_mib']:,.0f}" for p in phases]
        cells += [f"{r['peak_mib']:,.0f} ({r['peak_x']:.2f}, {r['peak_phase']})", f"{r['plan_peak_mib']:,.0f}",
                  f"{r['x3_5_mib']:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"{r['k']}x{r['n']}: {r['chunks']} chunks of {r['chunk_tiles']} tiles all run; Viterbi {r['viterbi']['tiles']:,}"
             f" tiles in {r['viterbi']['calls']} calls, {r['viterbi']['real_tiles']:,} through the real kernel; "
             f"{r['wall_s']} s" if r["viterbi"] else f"{r['k']}x{r['n']}: every tile through the real kernel; {r['wall_s']} s"
             for r in rows]
    c = result.get("calibration")
    if c:
        notes.append(f"calibration, one Viterbi call on {c['tiles']:,} tiles: real kernel {c['real_mib']} MiB "
                     f"({c['real_s']} s), stand-in with {c['real_tiles']} real tiles {c['standin_mib']} MiB ({c['standin_s']} s)")
    return "\n".join(lines + [""] + notes)


def _table(rows: list[dict]) -> str:
    keys = [c for c in ("k", "n", "weight_mib", "budget_mib", "slots", "chunk_tiles", "tool_peak_mib", "tool_peak_x",
                        "tool_s", "unbounded_s", "unbounded_peak_mib", "ref_peak_mib", "ref_s", "peak_ratio",
                        "tool_footprint_mib", "ref_footprint_mib", "footprint_ratio", "speedup",
                        "same_bytes_as_ref", "host_peak_mib", "host_peak_x", "reference_estimate_mib", "seconds",
                        "source") if any(c in r for r in rows)]
    lines = [" | ".join(keys)]
    for r in rows:
        lines.append(" | ".join(str(r.get(c, "")) for c in keys))
    return "\n".join(lines)


def _parse_shapes(text: str | None):
    if not text:
        return SHAPES
    out = []
    for part in text.split(","):
        k, n = part.lower().split("x")
        out.append(((int(k), int(n)), "command line"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shapes", help="comma-separated KxN (default: the issue's and the deployed models' shapes)")
    ap.add_argument("--unbounded", action="store_true", help="also time each shape at a budget that never binds")
    ap.add_argument("--reference", help="exllamav3 package directory, loaded as the fork loads its encoder source")
    ap.add_argument("--no-reference", action="store_true", help="skip exllamav3 even where it is importable")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--phases", action="store_true",
                    help="CPU: peak per phase against the plan's figures (default shapes: issue 24's four)")
    ap.add_argument("--real-tiles", default="4",
                    help="--phases: tiles of each Viterbi call through the real numba kernel (the rest are copies); "
                         "'all' for every tile (hours for the large shapes)")
    ap.add_argument("--calibrate-tiles", type=int,
                    help="--phases: tiles of the calibration call, real kernel against the stand-in (default: one "
                         "chunk of the first shape; 0: none)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-phases", help=argparse.SUPPRESS)
    ap.add_argument("--child-calibrate", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    real_tiles = None if a.real_tiles == "all" else int(a.real_tiles)
    if a.child:
        k, n = (int(x) for x in a.child.split("x"))
        _child(k, n)
        return
    if a.child_phases:
        k, n = (int(x) for x in a.child_phases.split("x"))
        _phases_child(k, n, real_tiles)
        return
    if a.child_calibrate:
        _calibrate_child(a.child_calibrate, real_tiles or 4)
        return
    if a.phases:
        if a.device != "cpu":
            raise SystemExit("--phases measures the host: use it with --device cpu")
        result = bench_cpu_phases(_parse_shapes(a.shapes) if a.shapes else ISSUE_SHAPES, real_tiles, a.calibrate_tiles)
        print(phases_table(result))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    shapes = _parse_shapes(a.shapes)
    rows = bench_cuda(shapes, a.unbounded, not a.no_reference, a.reference) if a.device == "cuda" else bench_cpu(shapes)
    print(_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
