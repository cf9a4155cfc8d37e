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
* with ``--reference DIR`` (the exllamav3 package, e.g. from its wheel), the reference encoder's rate in the same
  run: its ``quantize_exl3`` timed as the fork calls it on each distinct shape the warm encoded, weighted by the
  encodes of that shape, and the warm's encode rate over it (else null, with the reason).

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


def child_reference(shapes: dict[str, int], reference: str, device: str) -> dict:
    """The reference encoder's rate on the encodes a warm measured: exllamav3's ``quantize_exl3`` called as the
    fork calls it (``bench_dropin.fork_call``) once per distinct (k, n, K), after one warm-up call per K; its
    seconds for the measured encodes are each shape's seconds times the encodes of that shape."""
    import torch

    from bench_dropin import fork_call, layer_weight  # puts tests/ (the fork's loader) on the path

    from _fork_loader import load_quantize_exl3

    fn = load_quantize_exl3(reference, package="_exllamav3_reference")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # the reference asserts the weight's device == devices[0]: with
        dev = torch.device("cuda", torch.cuda.current_device())  # "cuda" there, cuda:0 != cuda (seen on an H200)
    per_shape, seconds, tiles, warmed = {}, 0.0, 0, set()
    for key, count in sorted(shapes.items()):
        k, n, bits = (int(v) for v in key.split("x"))
        weight = layer_weight(n, k, k * 7 + n, dev)
        if bits not in warmed:  # the first call of a K sets up the reference's kernels and scratch
            fork_call(fn, weight, bits, 1, dev)
            warmed.add(bits)
        t = fork_call(fn, weight, bits, 2, dev)["seconds"]
        per_shape[key] = {"encodes": count, "seconds_per_encode": round(t, 4)}
        seconds += t * count
        tiles += (k // 16) * (n // 16) * count
    return {"tiles_per_s": round(tiles / seconds) if seconds else None, "encode_tiles": tiles,
            "seconds": round(seconds, 2), "shapes": per_shape, "package": reference,
            "basis": "exllamav3 quantize_exl3 alone (the fork's call, GPU-resident fp32 weight), one call per "
                     "distinct shape times its encodes; no reading, hashing or writing (the warm's rate has them)"}


def child_warm(preset: str, scale: str, model_dir: Path, cache: Path, device: str, split: bool) -> dict:
    import torch

    from exl3tool.checkpoint import open_checkpoint, plan_layers
    from exl3tool.plan import WarmRequest
    from exl3tool.operations.warm import warm
    from exl3tool.plan.sharing import plan_sharing

    if not split:  # the pipeline as before: the whole encode on the calling thread (see the module docstring)
        import exl3tool.operations.warm.pipeline as pipeline

        original = pipeline._default_encode
        pipeline._default_encode = lambda *a, **kw: original(*a, **kw)
    p = PRESETS[preset]
    overlay = _overlay(p)
    t0 = time.perf_counter()
    full = plan_layers(open_checkpoint(str(model_dir)), overlay=overlay)
    whole = plan_sharing(full, p.tp_sizes)
    plan_seconds = time.perf_counter() - t0
    layers = p.tiny_layers if scale == "tiny" else p.layers
    prefixes = _selected(full.layers, layers, p.tiny_modules if scale == "tiny" else ())
    rss_before = _rss_mib()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    summary = warm(WarmRequest(model=str(model_dir), tp_sizes=p.tp_sizes, layers=tuple(prefixes),
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


def _time_reference(result: dict, reference: str, device: str, timeout: float) -> dict:
    """The reference child on the encodes of a preset's warm ``result``, with the warm's rate over it."""
    ref = _run_child(["--child", "reference", "--preset", result["preset"], "--shapes",
                      json.dumps(result["measured"]["encode_shapes"]), "--reference", reference, "--device", device],
                     timeout)
    if "error" not in ref and ref.get("tiles_per_s"):
        ref["warm_vs_reference"] = round(result["measured"]["encode_tiles_per_s_per_gpu"] / ref["tiles_per_s"], 2)
    return ref


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
        return (f" | reference quantize_exl3 {ref['tiles_per_s']:,} tiles/s on the same encodes: the warm "
                f"{ref['warm_vs_reference']}x")
    return f" | reference not measured: {ref.get('error', ref.get('why', ''))[-200:]}"


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
    ap.add_argument("--child", choices=("write", "warm", "reference"), help=argparse.SUPPRESS)
    ap.add_argument("--shapes", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "write":
        print(json.dumps(child_write(args.preset[0], args.scale, Path(args.out))))
        return
    if args.child == "reference":
        print(json.dumps(child_reference(json.loads(args.shapes), args.reference, args.device)))
        return
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
                                             args.timeout)
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
    results = []
    for name in names:
        for split in ((True, False) if args.both else (not args.no_split,)):
            r = run_preset(name, args.scale, device, work, split, args.timeout, args.reference)
            print(_row(r), flush=True)
            results.append(r)
        if args.both and all("error" not in r for r in results[-2:]):
            results[-1]["same_bytes_as_split"] = _same_bytes(Path(results[-2]["cache"]), Path(results[-1]["cache"]))
            print(f"  same bytes with and without the split: {results[-1]['same_bytes_as_split']}", flush=True)
    doc = {"presets": results, "work": str(work)}
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
