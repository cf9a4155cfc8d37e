"""Warm benchmarks of the models the fork serves: real shapes, synthetic weights, figures extrapolated to the model.

    python benchmarks/bench_fleet.py --preset all --json fleet.json          # on an H200: every preset, minutes
    python benchmarks/bench_fleet.py --preset glm5-tp8 --scale tiny --device cpu   # CPU smoke run, seconds

Each preset writes an EXL3 checkpoint of the model's real geometry (``fleet_models.py``): random BF16 data for the
few layers it encodes, sparse holes for the rest, so the plan is the whole model's. One child process writes it,
another runs ``cache warm`` (``exl3tool.operations.warm.warm``) on those layers' entries into an empty cache, so the peak RSS
and peak GPU memory are the warm's own. Reported per preset:

* whole model (from the plan, no encode): entries, encodes after encoding each distinct shard once, tiles,
  tiles the encoder quantizes, the share saved;
* measured on the encoded layers: entries, encodes saved, wall time of the warm (plan and run), tiles/s per GPU
  (tiles of the entries written per second of the run; encode tiles/s counts each shared encode once), peak GPU
  memory, peak host RSS, seconds per pipeline stage (``worker_stats``);
* extrapolated (labelled so): the whole model's warm time at the measured encode rate;
* with ``--reference DIR`` (the exllamav3 package, e.g. from its wheel), the reference encoder on the same presets
  in the same run: its ``quantize_exl3`` timed as the fork calls it on each distinct shape the warm encoded,
  weighted by the encodes of that shape: its tiles/s per GPU, its peak GPU memory (the timing process's peak: the
  fp32 weight, the call's scratch and the Viterbi scratch it keeps per K) beside the warm's, and the ratios (else
  null, with the reason).

One device call (600 s) holds all of it: the reference's CUDA extension JIT-compiles (about 320 s on 16 cores) in a
background process while the warms run (``warm_during_compile`` says which overlapped it; ``MAX_JOBS`` sets the
compile's processes, fewer leave the warm more host cores), then each preset's reference child gets an equal share
of what is left of ``--budget-s`` and times the shapes carrying the most encode tiles first, until its share is
spent or ``--reference-shapes`` of them are timed (at least one; ``coverage`` is the share of the preset's encode
tiles timed, and the rate is over those). For the whole suite on one device call::

    PYTHONPATH=$PWD:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=12 \
        python benchmarks/bench_fleet.py --preset all --reference /tmp/site/exllamav3 --budget-s 540 --json ref.json

(``bash benchmarks/gpu_fleet_ref.sh`` installs the wheel from ``./.whl`` first and runs exactly that.)

``--no-split`` runs the warm without the two-stream split of the encode (regularisation and scale search of the
next job on a second CUDA stream), the baseline of ``benchmarks/README.md``'s pipeline rows. The current warm
pipeline (lock-deferring, ``exl3tool/operations/warm/pipeline.py``) has no split: both halves run on the calling thread, so
on ``main`` the two modes run the same pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from exl3tool.releases import newest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BOTH = '{"linear": "mxfp8", "shared_experts": "mxfp8"}'


@dataclass(frozen=True)
class Preset:
    model: str
    tp_sizes: tuple[int, ...]
    overlay: str
    layers: tuple[int, ...]  # decoder layers encoded at full scale: a representative slice of the model
    tiny_layers: tuple[int, ...] = (2, 3)
    tiny_modules: tuple[str, ...] = ()  # at tiny scale, only modules whose prefix ends like this (CPU: seconds)
    note: str = ""


def _qwen_overlay() -> str:
    from fleet_models import QWEN38_OVERLAY

    return QWEN38_OVERLAY


PRESETS: dict[str, Preset] = {
    "llama-8b": Preset("llama-8b", (1, 2, 4, 8), '{"linear": "mxfp8"}', (0,), (0,), ("self_attn.o_proj",),
                       note="the issue's 8B shapes: one decoder layer at TP 1,2,4,8"),
    "qwen38-27b": Preset("qwen38-27b", (1, 2, 4, 8), "QWEN38", (2, 3), (2,), ("linear_attn.out_proj",),
                         note="the deployed overlay; a gated-delta-net layer and a full-attention layer"),
    "glm53-flash-tp2": Preset("glm53-flash", (2,), BOTH, (2, 4), (4,), ("self_attn.g_a_proj",),
                              note="a KDA layer with a dense MLP and one with a shared expert; the scope fixes the "
                                   "geometry, so tiny scale encodes only g_a_proj"),
    "deepseek-v3-tp8": Preset("deepseek-v3", (8,), BOTH, (3,), (3,), ("self_attn.kv_b_proj",), note="a MoE layer (58 of the 61 layers are)"),
    "glm5-tp8": Preset("glm5", (8,), BOTH, (3,), (3,), ("self_attn.kv_b_proj", "self_attn.indexer.wq_b"), note="a MoE layer with its indexer (75 of the 78 layers are)"),
}


def _overlay(p: Preset) -> str:
    return _qwen_overlay() if p.overlay == "QWEN38" else p.overlay


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_write(preset: str, scale: str, out: Path) -> dict:
    from fleet_models import write_model

    p = PRESETS[preset]
    t0 = time.perf_counter()
    layers = p.tiny_layers if scale == "tiny" else p.layers
    write_model(out, p.model, layers, tiny=scale == "tiny", seed=1)
    return {"write_seconds": round(time.perf_counter() - t0, 2), "written_bytes": sum(
        f.stat().st_blocks * 512 for f in out.iterdir())}


def _selected(plan_layers_, layers: tuple[int, ...], modules: tuple[str, ...]) -> list[str]:
    """Exact prefixes of the planned modules in ``layers`` (and ending in ``modules`` when given)."""
    out = []
    for layer in plan_layers_:
        m = re.search(r"\.layers\.(\d+)\.", layer.prefix + ".")
        if m and int(m.group(1)) in layers and (not modules or layer.prefix.endswith(modules)):
            out.append(layer.prefix)
    return out


def _reference() -> dict:
    return {"tiles_per_s": None, "why": "no --reference given: the reference encoder was not measured in this run "
                                        "(bench_fleet.py --reference DIR, DIR the exllamav3 package)"}


def sample_shapes(shapes: dict[str, int], cap: int | None = None) -> list[str]:
    """The order the reference times a preset's shapes in: most encode tiles first (tiles x encodes of the shape),
    ties by the key; at most ``cap`` of them (None: all). A budget stops the list early, never reorders it.

    >>> sample_shapes({"512x4096x6": 2, "2048x7168x6": 1, "7168x4608x6": 1}, cap=2)
    ['7168x4608x6', '2048x7168x6']
    """
    def weight(key: str) -> int:
        k, n, _ = (int(v) for v in key.split("x"))
        return (k // 16) * (n // 16) * shapes[key]

    ordered = sorted(shapes, key=lambda key: (-weight(key), key))
    return ordered if cap is None else ordered[:max(1, cap)]


def child_compile(reference: str) -> dict:
    """Import the reference once (its first import JIT-compiles its CUDA extension into TORCH_EXTENSIONS_DIR), so
    the timing children load the built extension."""
    t0 = time.perf_counter()
    sys.path.insert(0, str(HERE.parent / "tests"))
    from _fork_loader import load_quantize_exl3

    load_quantize_exl3(reference, package="_exllamav3_reference")
    return {"compile_import_seconds": round(time.perf_counter() - t0, 1)}


def child_reference(shapes: dict[str, int], reference: str, device: str, deadline_s: float | None = None,
                    cap: int | None = None) -> dict:
    """The reference encoder on the encodes a warm measured: exllamav3's ``quantize_exl3`` called as the fork calls
    it (``bench_dropin.fork_call``) once per distinct (k, n, K), in ``sample_shapes``' order, after one warm-up call
    per K on a small layer (its kernels' set-up; what it keeps allocated after is ``kept_mib``). A shape's seconds
    count once per encode of it. Stops starting shapes once ``deadline_s`` seconds have passed since the process
    started (one shape at least). ``peak_gpu_mib`` is this process's peak over every call (as the warm's is its
    process's peak)."""
    start = time.perf_counter()
    import torch

    from bench_dropin import fork_call, layer_weight  # puts tests/ (the fork's loader) on the path

    from _fork_loader import load_quantize_exl3

    fn = load_quantize_exl3(reference, package="_exllamav3_reference")
    import_seconds = time.perf_counter() - start
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # the reference asserts the weight's device == devices[0]: with
        dev = torch.device("cuda", torch.cuda.current_device())  # "cuda" there, cuda:0 != cuda (seen on an H200)
    torch.cuda.reset_peak_memory_stats(dev)
    first_calls, kept = {}, {}
    for bits in sorted({int(key.split("x")[2]) for key in shapes}):  # set-up per K, untimed for the rate
        before = torch.cuda.memory_allocated(dev)
        first_calls[str(bits)] = round(fork_call(fn, layer_weight(256, 512, 7, dev), bits, 7, dev)["seconds"], 3)
        torch.cuda.synchronize(dev)
        kept[str(bits)] = round((torch.cuda.memory_allocated(dev) - before) / 2**20, 1)
    order = sample_shapes(shapes, cap)
    per_shape, seconds, tiles, skipped = {}, 0.0, 0, []
    for key in order:
        if per_shape and deadline_s is not None and time.perf_counter() - start > deadline_s:
            skipped.append(key)
            continue
        k, n, bits = (int(v) for v in key.split("x"))
        weight = layer_weight(n, k, k * 7 + n, dev)
        r = fork_call(fn, weight, bits, 2, dev)
        del weight
        count = shapes[key]
        per_shape[key] = {"encodes": count, "seconds_per_encode": round(r["seconds"], 4),
                          "call_peak_mib": round(r["peak_bytes"] / 2**20, 1)}
        seconds += r["seconds"] * count
        tiles += (k // 16) * (n // 16) * count
    total = sum((int(key.split("x")[0]) // 16) * (int(key.split("x")[1]) // 16) * c for key, c in shapes.items())
    return {"tiles_per_s": round(tiles / seconds) if seconds else None, "encode_tiles": tiles,
            "seconds": round(seconds, 2), "coverage": round(tiles / total, 4) if total else None,
            "shapes": per_shape, "not_timed": skipped + [key for key in shapes if key not in order],
            "peak_gpu_mib": round(torch.cuda.max_memory_allocated(dev) / 2**20, 1), "kept_mib": kept,
            "first_call_seconds": first_calls, "import_seconds": round(import_seconds, 1),
            "child_seconds": round(time.perf_counter() - start, 1), "package": reference,
            "basis": "exllamav3 quantize_exl3 alone (the fork's call, GPU-resident fp32 weight), one call per "
                     "distinct shape times its encodes, after one warm-up call per K; no reading, hashing or "
                     "writing (the warm's rate has them)"}


def child_warm(preset: str, scale: str, model_dir: Path, cache: Path, device: str, split: bool) -> dict:
    import torch

    from exl3tool.checkpoint import open_checkpoint, plan_layers
    from exl3tool.plan import ServerRequest
    from exl3tool.operations.warm import warm
    from exl3tool.plan.sharing import plan_sharing

    if not split:  # the pipeline as before: the whole encode on the calling thread (see the module docstring)
        import exl3tool.operations.warm.pipeline as pipeline

        original = pipeline._default_encode
        pipeline._default_encode = lambda *a, **kw: original(*a, **kw)
    p = PRESETS[preset]
    overlay = _overlay(p)
    t0 = time.perf_counter()
    full = plan_layers(open_checkpoint(str(model_dir)), overlay=overlay, release=newest())
    whole = plan_sharing(full, p.tp_sizes)
    plan_seconds = time.perf_counter() - t0
    layers = p.tiny_layers if scale == "tiny" else p.layers
    prefixes = _selected(full.layers, layers, p.tiny_modules if scale == "tiny" else ())
    rss_before = _rss_mib()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    summary = warm(ServerRequest(model=str(model_dir), tp_sizes=p.tp_sizes, layers=tuple(prefixes),
                               cache_dir=str(cache), device=device, quantization_config=overlay,
                               encoder_root="/encoders/exllamav3", encoder_revision="bench-fleet"))
    wall = time.perf_counter() - t0
    stats = summary.worker_stats[0]
    encoded = [e for e in summary.entries if e.status == "encoded"]
    tiles = sum((e.input_size // 16) * (e.output_size // 16) for e in encoded)
    encode_tiles = sum((e.input_size // 16) * (e.output_size // 16) for e in encoded if e.reused_from is None)
    shapes: dict[str, int] = {}  # encodes per (k, n, K): what the reference is timed on
    for e in encoded:
        if e.reused_from is None:
            key = f"{e.input_size}x{e.output_size}x{summary.bits}"
            shapes[key] = shapes.get(key, 0) + 1
    run = stats.get("run_seconds", wall)
    rate = encode_tiles / run if run else 0.0
    return {
        "preset": preset, "model": p.model, "scale": scale, "tp_sizes": list(p.tp_sizes), "note": p.note,
        "device": summary.device, "split": split,
        "whole_model": {**whole, "plan_seconds": round(plan_seconds, 2)},
        "measured": {
            "layers": list(layers), "modules": len(prefixes), "entries": len(encoded), "encodes": summary.encodes,
            "encodes_saved": summary.encodes_saved, "failed": summary.counts["failed"], "tiles": tiles,
            "encode_tiles": encode_tiles, "wall_seconds": round(wall, 2), "run_seconds": round(run, 2),
            "tiles_per_s_per_gpu": round(tiles / run) if run else None,
            "encode_tiles_per_s_per_gpu": round(rate) if run else None,
            "peak_gpu_mib": stats.get("peak_cuda_mib"), "peak_rss_mib": stats.get("peak_rss_mib"),
            "rss_before_warm_mib": round(rss_before, 1), "bytes_written": summary.bytes_written,
            "stages": stats.get("stages", {}), "encode_shapes": shapes,
        },
        "extrapolated": {  # labelled: the whole model's warm at the measured encode rate, one GPU
            "whole_model_seconds_one_gpu": round(whole["encode_tiles"] / rate, 1) if rate else None,
            "basis": "whole-model encode tiles / measured encode tiles per second (same GPU, same pipeline)",
        },
        "reference": _reference(),
    }


def _run_child(args: list[str], timeout: float) -> dict:
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout)[-2000:], "args": args}
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_preset(name: str, scale: str, device: str, work: Path, split: bool, timeout: float,
               reference: str | None = None) -> dict:
    model_dir = work / f"{name}-{scale}" / "model"
    if not (model_dir / "config.json").is_file():
        written = _run_child(["--child", "write", "--preset", name, "--scale", scale, "--out", str(model_dir)], timeout)
        if "error" in written:
            return {"preset": name, **written}
    else:
        written = {"write_seconds": 0.0, "reused_checkpoint": True}
    cache = work / f"{name}-{scale}" / f"cache-{'split' if split else 'nosplit'}"
    result = _run_child(["--child", "warm", "--preset", name, "--scale", scale, "--out", str(model_dir),
                         "--cache", str(cache), "--device", device] + ([] if split else ["--no-split"]), timeout)
    result["checkpoint"] = written
    result["cache"] = str(cache)
    if reference and "error" not in result:
        result["reference"] = _time_reference(result, reference, device, timeout)
    return result


def _start_compile(reference: str, work: Path) -> tuple[subprocess.Popen, Path]:
    """The reference's first import (its extension's JIT compile) in the background; its JSON line in the log."""
    log = work / "reference-compile.log"
    fh = log.open("w")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", "compile", "--reference",
                             reference], stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    fh.close()
    return proc, log


def _time_reference(result: dict, reference: str, device: str, timeout: float, deadline_s: float | None = None,
                    cap: int | None = None) -> dict:
    """The reference child on the encodes of a preset's warm ``result``, with the warm's rate and peak over its."""
    args = ["--child", "reference", "--preset", result["preset"], "--shapes",
            json.dumps(result["measured"]["encode_shapes"]), "--reference", reference, "--device", device]
    if deadline_s is not None:
        args += ["--deadline-s", f"{deadline_s:.1f}"]
    if cap is not None:
        args += ["--reference-shapes", str(cap)]
    ref = _run_child(args, timeout)
    m = result["measured"]
    if "error" not in ref and ref.get("tiles_per_s"):
        ref["warm_vs_reference"] = round(m["encode_tiles_per_s_per_gpu"] / ref["tiles_per_s"], 2)
    if "error" not in ref and ref.get("peak_gpu_mib") and m.get("peak_gpu_mib"):
        ref["warm_peak_vs_reference"] = round(m["peak_gpu_mib"] / ref["peak_gpu_mib"], 3)
    return ref


def _wait_compile(proc: subprocess.Popen, log: Path, until: float) -> dict:
    """The background compile's outcome: done, failed (its log's tail) or still running at ``until`` (killed)."""
    while proc.poll() is None and time.monotonic() < until:
        time.sleep(2)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        return {"error": f"the reference's extension was still compiling when the budget ran out ({log})"}
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        last = text.strip().splitlines()[-1] if text.strip() else f"exit {proc.returncode}"
        return {"error": f"importing the reference failed: {last} (log: {log})"}
    return json.loads(text.strip().splitlines()[-1])


def _references(results: list[dict], reference: str, device: str, timeout: float, end: float | None,
                cap: int | None, compiled: dict) -> None:
    """Each preset's reference child in turn, each with an equal share of the time left before ``end``."""
    # the lightest presets first: what they leave of their share goes to the heavier ones after them
    todo = sorted((r for r in results if "error" not in r), key=lambda r: r["measured"]["encode_tiles"])
    for i, r in enumerate(todo):
        if "error" in compiled:
            r["reference"] = {"tiles_per_s": None, **compiled}
            continue
        share = None
        if end is not None:  # an equal share of what is left, at least 30 s while 30 s are left
            left = end - time.monotonic()
            if left < 30:
                r["reference"] = {"tiles_per_s": None, "error": f"--budget-s spent ({left:.0f} s left)"}
                print(_row(r), flush=True)
                continue
            share = max(left / (len(todo) - i), 30.0)
        # the child's own start (torch, CUDA, the extension's load) counts against its share; its kill bound adds 90 s
        r["reference"] = _time_reference(r, reference, device, min(timeout, (share or timeout) + 90),
                                         None if share is None else share - 10, cap)
        r["reference"]["compile"] = compiled
        print(_row(r), flush=True)


def _row(r: dict) -> str:
    if "error" in r:
        return f"{r.get('preset')}: FAILED {r['error'][-300:]}"
    w, m, x = r["whole_model"], r["measured"], r["extrapolated"]
    return (f"{r['preset']:16s} TP {','.join(map(str, r['tp_sizes'])):8s} whole model: {w['entries']} entries, "
            f"{w['encodes']} encodes ({w['encodes_saved']} saved, {100 * w['tiles_saved_share']:.2f}% of "
            f"{w['tiles']:,} tiles) | measured {m['entries']} entries ({m['encodes_saved']} reused), {m['tiles']:,} tiles "
            f"in {m['run_seconds']} s: {m['tiles_per_s_per_gpu']:,} tiles/s/GPU, {m['encode_tiles_per_s_per_gpu']:,} "
            f"encode tiles/s; peak GPU {m['peak_gpu_mib']} MiB, peak RSS {m['peak_rss_mib']} MiB | "
            f"extrapolated whole model: {x['whole_model_seconds_one_gpu']} s on one GPU"
            + _reference_row(r.get("reference", {})))


def _reference_row(ref: dict) -> str:
    if ref.get("tiles_per_s"):
        cover = f", {100 * ref['coverage']:.0f}% of the encode tiles timed" if ref.get("coverage", 1) < 1 else ""
        return (f" | reference quantize_exl3 {ref['tiles_per_s']:,} tiles/s on the same encodes{cover}, peak GPU "
                f"{ref.get('peak_gpu_mib')} MiB: the warm {ref['warm_vs_reference']}x the rate, "
                f"{ref.get('warm_peak_vs_reference')}x the peak")
    return f" | reference not measured: {ref.get('error', ref.get('why', ''))[-200:]}"


def _table(results: list[dict]) -> str:
    """One line per preset: tiles/s per GPU and peak GPU memory of the warm and of the reference, and the ratios."""
    lines = [f"{'preset':16} {'warm tiles/s':>12} {'warm MiB':>9} {'ref tiles/s':>11} {'ref MiB':>8} {'rate x':>6} "
             f"{'peak x':>6} {'timed':>6}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r.get('preset', '?'):16} failed")
            continue
        m, ref = r["measured"], r.get("reference", {})
        rate = f"{ref['tiles_per_s']:,}" if ref.get("tiles_per_s") else "-"
        timed = f"{100 * ref['coverage']:.0f}%" if ref.get("tiles_per_s") and ref.get("coverage") is not None else "-"
        lines.append(f"{r['preset']:16} {m['encode_tiles_per_s_per_gpu']:>12,} {m['peak_gpu_mib']!s:>9} {rate:>11} "
                     f"{ref.get('peak_gpu_mib', '-')!s:>8} {ref.get('warm_vs_reference', '-')!s:>6} "
                     f"{ref.get('warm_peak_vs_reference', '-')!s:>6} {timed:>6}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", default=[], help=f"one of {', '.join(PRESETS)} or all; repeatable")
    ap.add_argument("--scale", choices=("full", "tiny"), default="full")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--no-split", action="store_true", help="the encode without the two-stream split (baseline)")
    ap.add_argument("--both", action="store_true", help="run each preset with and without the split; compare bytes")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--reference", default=None,
                    help="the exllamav3 package directory: also time its quantize_exl3 on each preset's encodes")
    ap.add_argument("--add-reference", metavar="RESULTS_JSON", default=None,
                    help="time the reference (--reference) on the encodes of an earlier run's JSON and write it "
                         "with the reference added (--json): the warm and the reference measured in one run, the "
                         "warm while the reference's extension is still compiling")
    ap.add_argument("--budget-s", type=float, default=None, metavar="S",
                    help="with --reference: the whole run's wall-time budget; the reference's compile overlaps the "
                         "warms, then each preset's reference timing gets an equal share of what is left and times "
                         "its heaviest shapes first (coverage in the JSON). Default: no budget, every shape timed")
    ap.add_argument("--reference-shapes", type=int, default=None, metavar="N",
                    help="with --reference: time at most N distinct shapes per preset, those with the most encode "
                         "tiles (sampling; the rate is over the timed ones)")
    ap.add_argument("--child", choices=("write", "warm", "reference", "compile"), help=argparse.SUPPRESS)
    ap.add_argument("--deadline-s", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shapes", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "write":
        print(json.dumps(child_write(args.preset[0], args.scale, Path(args.out))))
        return
    if args.child == "reference":
        print(json.dumps(child_reference(json.loads(args.shapes), args.reference, args.device, args.deadline_s,
                                         args.reference_shapes)))
        return
    if args.child == "compile":
        print(json.dumps(child_compile(args.reference)))
        return
    if args.reference_shapes is not None and args.reference_shapes < 1:
        ap.error("--reference-shapes must be at least 1")
    if args.child == "warm":
        print(json.dumps(child_warm(args.preset[0], args.scale, Path(args.out), Path(args.cache), args.device,
                                    not args.no_split)))
        return
    if args.add_reference:
        if not args.reference:
            ap.error("--add-reference needs --reference DIR (the exllamav3 package)")
        doc = json.loads(Path(args.add_reference).read_text())
        for r in doc["presets"]:
            if "error" in r:
                continue
            r["reference"] = _time_reference(r, args.reference, "cuda" if args.device == "auto" else args.device,
                                             args.timeout, cap=args.reference_shapes)
            print(_row(r), flush=True)
        Path(args.json_path or args.add_reference).write_text(json.dumps(doc, indent=2) + "\n")
        return
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    names = list(PRESETS) if not args.preset or "all" in args.preset else args.preset
    for n in names:
        if n not in PRESETS:
            ap.error(f"--preset {n!r}: choose from {', '.join(PRESETS)} or all")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="exl3tool-fleet-"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    end = None if args.budget_s is None else start + args.budget_s
    compiling = _start_compile(args.reference, work) if args.reference else None  # overlaps the warms
    results = []
    for name in names:
        for split in ((True, False) if args.both else (not args.no_split,)):
            r = run_preset(name, args.scale, device, work, split, args.timeout, None)
            if compiling is not None and "error" not in r:
                r["warm_during_compile"] = compiling[0].poll() is None  # the compile took host cores meanwhile
                r["reference"] = {"tiles_per_s": None, "why": "timed after every preset's warm (below)"}
            print(_row(r), flush=True)
            results.append(r)
        if args.both and all("error" not in r for r in results[-2:]):
            results[-1]["same_bytes_as_split"] = _same_bytes(Path(results[-2]["cache"]), Path(results[-1]["cache"]))
            print(f"  same bytes with and without the split: {results[-1]['same_bytes_as_split']}", flush=True)
    doc = {"presets": results, "work": str(work)}
    if compiling is not None:
        compiled = _wait_compile(*compiling, until=end if end is not None else time.monotonic() + args.timeout)
        compiled["ready_after_s"] = round(time.monotonic() - start, 1)
        print(f"reference: {compiled}", flush=True)
        _references(results, args.reference, device, args.timeout, end, args.reference_shapes, compiled)
        doc["reference_compile"] = compiled
        print(_table(results), flush=True)
    doc["seconds"] = round(time.monotonic() - start, 1)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(doc, indent=2) + "\n")
    if any("error" in r for r in results):
        sys.exit(1)


def _same_bytes(a: Path, b: Path) -> bool:
    fa = {p.relative_to(a): p.read_bytes() for p in a.rglob("*.safetensors") if not p.name.startswith(".")}
    fb = {p.relative_to(b): p.read_bytes() for p in b.rglob("*.safetensors") if not p.name.startswith(".")}
    return bool(fa) and fa.keys() == fb.keys() and all(fa[k] == fb[k] for k in fa)


if __name__ == "__main__":
    main()
