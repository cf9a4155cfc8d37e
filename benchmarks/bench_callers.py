"""The drop-in encoder against exllamav3's quantize_exl3 in the conventions of the fork loader's three callers.

    # on a GPU machine with the exllamav3 1.6.5 wheel unpacked in /tmp/site (benchmarks/gpu_callers.sh does it):
    PYTHONPATH=$PWD:/tmp/site python benchmarks/bench_callers.py --reference /tmp/site/exllamav3 --json out.json

Both encoders are loaded the way the fork's ``_load_exl3_online_quantizer`` loads ``VLLM_EXL3_ENCODER_SOURCE``
(``tests/_fork_loader.py``): exl3tool's from a fresh ``exl3tool encoder-source`` export, exllamav3's from its package
directory. The calls, each as its caller makes it:

* ``online``: the fork's online linear method (BF16 layer weight transposed to float32, the fork's H_data with a
  meta H, ``first_key``, ``num_total``, ``inf_nan``; ``K``, crc32 seed, ``devices=[torch.device]``, ``mcg``;
  ``return_weight_q=False``) on deployed small and mid-size layers at K = 4, 6 and 8;
* ``gate``: the image-build gate (an fp32 (1024, 512) weight, K = 6, seed 0, ``return_weight_q=True``, then
  ``q_fallback`` checked and weight_q compared): weight_q is compared too;
* ``tool``: the K8/K4 round-trip tools for vision towers and ``lm_head`` (a Linear weight zero-padded to
  multiples of 128, ``devices=[str(device)]``, H_data with ``L`` and a bare ``torch.device("cuda")``, seed 0,
  ``return_weight_q=False``); the lm_head call is one vocabulary chunk scaled down to 8,192 rows.

Per call: the first call's seconds (the process's first call of that layer: a kernel variant new to the process
compiles for the drop-in, the reference allocates a K's scratch), the steady seconds (the next call, same arguments), the ratio, the
peak GPU memory above what was allocated before the call and what each encoder keeps allocated between calls, and
the bytes compared (every returned tensor, proxy error, g, every quant_args / H_data key the reference writes; for
the gate also weight_q). Kept bytes: what each encoder's calls of a K left allocated once their answers were freed
(the reference caches its Viterbi scratch per K); footprint = a call's peak (first or steady, the larger) plus
what is kept for its K. The MiB columns printed are the steady call's peak. ``--probe`` measures the cross-process first call: two fresh processes, one after the
other, each making one call per K of the table with ``VLLM_EXL3_ONLINE_CACHE_DIR`` on one new folder: the first
compiles (Triton's cache is empty), the second loads what the first left in ``<cache root>/exl3tool-triton``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from _fork_loader import fork_seed, load_quantize_exl3  # noqa: E402

from exl3tool.serving.encoder_source import write_encoder_source  # noqa: E402

MIB = 1 << 20
# (caller, label, source (k, n) as the caller passes it, K, weight kind)
CALLS: list[tuple[str, str, tuple[int, int], int, str]] = [
    ("online", "GLM-5.3 f_b_proj", (128, 4096), 4, "bf16"),
    ("online", "GLM-5.3 shared down_proj", (1024, 4096), 4, "bf16"),
    ("online", "Qwen-VL attn qkv", (1152, 3456), 4, "bf16"),
    ("online", "DeepSeek-V3 kv_b_proj", (512, 4096), 6, "bf16"),
    ("online", "DeepSeek-V3 o_proj", (2048, 7168), 6, "bf16"),
    ("online", "DeepSeek-V3 gate_up_proj", (7168, 4608), 6, "bf16"),
    ("online", "K8 (2048, 2048)", (2048, 2048), 8, "bf16"),
    ("gate", "gate (1024 x 512) weight_q", (512, 1024), 6, "fp32"),
    ("tool", "vision fc1 (4304, 1152) padded", (1152, 4352), 8, "pad:4304x1152"),
    ("tool", "vision fc2 (1152, 4304) padded", (4352, 1152), 8, "pad:1152x4304"),
    ("tool", "vision fc1 K4 padded", (1152, 4352), 4, "pad:4304x1152"),
    ("tool", "lm_head chunk (8192, 5120)", (5120, 8192), 8, "pad:8192x5120"),
    ("tool", "lm_head chunk K4", (5120, 8192), 4, "pad:8192x5120"),
]


def source_of(kind: str, k: int, n: int, seed: int) -> torch.Tensor:
    """The caller's (k, n) float32 source on the CPU: a BF16 Linear (n, k) transposed, an fp32 one (the gate), or a
    (out, in) Linear zero-padded to (n, k) (the round-trip tools); uneven input-channel scales."""
    gen = torch.Generator().manual_seed(seed)
    if kind.startswith("pad:"):
        out_f, in_f = (int(x) for x in kind[4:].split("x"))
        w = torch.zeros(n, k)
        scale = 0.005 + 0.03 * torch.rand(1, in_f, generator=gen)
        w[:out_f, :in_f] = (torch.randn(out_f, in_f, generator=gen) * scale).to(torch.bfloat16).float()
        return w.t().contiguous()
    if kind == "fp32":
        return (torch.randn(n, k, generator=gen) * 0.02).t().contiguous()
    scale = 0.005 + 0.03 * torch.rand(1, k, generator=gen)
    return (torch.randn(n, k, generator=gen) * scale).to(torch.bfloat16).float().t().contiguous()


def arguments(caller: str, k: int, bits: int, seed: int, device: torch.device) -> tuple[dict, dict, bool]:
    """(H_data, quant_args, return_weight_q) as ``caller`` builds them."""
    if caller == "tool":
        return ({"H": torch.empty(k, k, device="meta"), "L": None, "device": torch.device("cuda"), "count": 0,
                 "finalized": False},
                {"K": bits, "seed": 0, "devices": [str(device)], "apply_out_scales": True, "mcg": True}, False)
    h = {"H": torch.zeros(k, k, dtype=torch.float32, device="meta"), "first_key": "vllm-online", "count": 0,
         "finalized": False, "num_total": 0, "inf_nan": torch.zeros(2, dtype=torch.long, device=device),
         "device": device}
    qa = {"K": bits, "seed": 0 if caller == "gate" else seed, "devices": [device], "apply_out_scales": True,
          "mcg": True}
    return h, qa, caller == "gate"


def one_call(fn, caller: str, source_cpu: torch.Tensor, bits: int, seed: int, device: torch.device) -> dict:
    """One call as ``caller`` makes it: seconds, peak bytes above the allocation before the call, the bytes the
    encoder left allocated once its answer is freed (``kept_bytes``: caches, scratch), the answer on the CPU."""
    torch.cuda.synchronize(device)
    start_bytes = torch.cuda.memory_allocated(device)
    source = source_cpu.to(device)  # fresh per call: the reference regularises it in place
    h, qa, want_q = arguments(caller, source.shape[0], bits, seed, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    weight_q, proxy, tensors = fn(source, h, qa, return_weight_q=want_q, verbose=False)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - base
    if not qa.get("q_fallback"):
        raise RuntimeError(f"{caller}: q_fallback not set (the callers refuse this answer)")
    out = {"seconds": seconds, "peak_bytes": peak, "proxy": float(proxy), "qa": qa,
           "h": {key: (v.cpu() if isinstance(v, torch.Tensor) and not v.is_meta else v) for key, v in h.items()},
           "tensors": {key: t.cpu() for key, t in tensors.items()},
           "weight_q": weight_q.cpu() if want_q else None}
    del weight_q, tensors, source, h
    torch.cuda.synchronize(device)
    out["kept_bytes"] = torch.cuda.memory_allocated(device) - start_bytes
    return out


def compare(ours: dict, ref: dict) -> dict:
    """What agrees: every returned tensor byte for byte, proxy error, the keys the reference wrote, weight_q."""
    out = {"tensors": list(ours["tensors"]) == list(ref["tensors"]) and all(
        ours["tensors"][key].dtype == ref["tensors"][key].dtype and torch.equal(ours["tensors"][key], t)
        for key, t in ref["tensors"].items())}
    out["proxy_error"] = ours["proxy"] == ref["proxy"]
    out["quant_args"] = all(ours["qa"].get(key) == value for key, value in ref["qa"].items())
    out["h_data"] = all(ours["h"].get(key) == ref["h"].get(key) for key in ("L", "finalized", "diag", "q_fallback")) \
        and torch.equal(ours["h"]["su"].cpu(), ref["h"]["su"].cpu())
    tr_o, tr_r = ours["tensors"].get("trellis"), ref["tensors"].get("trellis")
    if tr_o is not None and tr_r is not None and tr_o.shape == tr_r.shape and not torch.equal(tr_o, tr_r):
        out["trellis_tiles_differing"] = int((tr_o != tr_r).any(dim=-1).sum())
    if ours["weight_q"] is not None:
        a, b = ours["weight_q"], ref["weight_q"]
        out["weight_q_identical"] = bool(torch.equal(a, b))
        out["weight_q_rel_diff"] = float((a - b).norm() / b.norm())
        out["weight_q_elements_differing"] = int((a != b).sum())
    out["bytes_compared"] = sum(t.numel() * t.element_size() for t in ours["tensors"].values()) + (
        ours["weight_q"].numel() * 4 if ours["weight_q"] is not None else 0)
    out["identical"] = out["tensors"] and out["proxy_error"] and out["quant_args"] and out["h_data"] and \
        out.get("weight_q_identical", True)
    return out


def probe(export: Path) -> None:
    """Child process: the first call of each K in CALLS (a small gate-shaped layer), seconds printed as JSON."""
    device = torch.device("cuda", 0)
    start = time.perf_counter()
    fn = load_quantize_exl3(export)
    times = {"import_s": time.perf_counter() - start}
    start = time.perf_counter()  # the process's CUDA context and cuBLAS handle: any first GPU work pays them
    torch.ones(128, 128, device=device) @ torch.ones(128, 128, device=device)
    torch.cuda.synchronize(device)
    times["cuda_init_s"] = time.perf_counter() - start
    for bits in sorted({c[3] for c in CALLS}):
        r = one_call(fn, "online", source_of("bf16", 512, 1024, bits), bits, 7, device)
        times[f"first_call_k{bits}_s"] = r["seconds"]
    print(json.dumps(times))


def cross_process(export: Path) -> dict:
    """Two fresh processes on one new cache root: cold Triton cache, then the first's kernels from disk."""
    with tempfile.TemporaryDirectory() as root:
        env = {key: value for key, value in os.environ.items() if key != "TRITON_CACHE_DIR"}
        env["VLLM_EXL3_ONLINE_CACHE_DIR"] = root
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            out = subprocess.run([sys.executable, __file__, "--probe-child", str(export)], env=env,
                                 capture_output=True, text=True, timeout=600)
            if out.returncode:
                raise RuntimeError(f"probe failed: {out.stderr[-2000:]}")
            runs.append(dict(json.loads(out.stdout.strip().splitlines()[-1]), process_s=time.perf_counter() - start))
        files = sum(1 for p in Path(root, "exl3tool-triton").rglob("*") if p.is_file())
    return {"cold": runs[0], "from_disk_cache": runs[1], "triton_cache_files": files}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", default=None, help="exllamav3 package directory (loaded as the fork loads it)")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--probe", action="store_true", help="also time the first call in two fresh processes")
    ap.add_argument("--probe-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe_child:
        probe(Path(args.probe_child))
        return
    device = torch.device("cuda", 0)
    doc: dict = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "reference": args.reference,
                 "calls": []}
    with tempfile.TemporaryDirectory() as tmp:
        export = Path(tmp) / "exl3tool-encoder"
        write_encoder_source(export)
        os.environ["VLLM_EXL3_ONLINE_CACHE_DIR"] = str(Path(tmp) / "cache")  # a cold Triton cache for this process
        if args.probe:
            doc["cross_process"] = cross_process(export)
            print("first call in a fresh process:", json.dumps(doc["cross_process"]), flush=True)
        fns = {"dropin": load_quantize_exl3(export)}
        if args.reference:
            start = time.perf_counter()
            fns["reference"] = load_quantize_exl3(args.reference, package="_exllamav3_reference")
            doc["reference_import_s"] = time.perf_counter() - start
        torch.ones(128, 128, device=device) @ torch.ones(128, 128, device=device)  # the process's cuBLAS workspace
        print(f"{'caller':7} {'call':32} {'(k, n)':>14} {'K':>2} {'ref 1st':>8} {'our 1st':>8} {'ref s':>7} "
              f"{'our s':>7} {'x':>5} {'ref MiB':>8} {'our MiB':>8} same", flush=True)
        for caller, label, (k, n), bits, kind in CALLS:
            seed = fork_seed(f"bench.{label}")
            source = source_of(kind, k, n, seed)
            row: dict = {"caller": caller, "call": label, "k": k, "n": n, "bits": bits, "tiles": k * n // 256}
            results = {}
            for name, fn in fns.items():
                # the first call of this layer in the process: a kernel variant new to it compiles (the drop-in)
                # or a K's scratch is allocated and kept (the reference); then the steady call
                r = one_call(fn, caller, source, bits, seed, device)
                row[f"{name}_first_s"] = r["seconds"]
                row[f"{name}_first_peak_bytes"] = r["peak_bytes"]
                kept = doc.setdefault(f"{name}_kept_bytes_by_k", {})
                kept[str(bits)] = kept.get(str(bits), 0) + r["kept_bytes"]
                del r
                results[name] = one_call(fn, caller, source, bits, seed, device)
                row[f"{name}_s"] = results[name]["seconds"]
                row[f"{name}_peak_bytes"] = results[name]["peak_bytes"]
                kept[str(bits)] += results[name]["kept_bytes"]
            if "reference" in results:
                row["speedup"] = row["reference_s"] / row["dropin_s"]
                row.update(compare(results["dropin"], results["reference"]))
            doc["calls"].append(row)
            del results
            torch.cuda.empty_cache()
            print(f"{caller:7} {label:32} {str((k, n)):>14} {bits:>2} {row.get('reference_first_s', float('nan')):8.3f} "
                  f"{row.get('dropin_first_s', float('nan')):8.3f} {row.get('reference_s', float('nan')):7.3f} "
                  f"{row['dropin_s']:7.3f} {row.get('speedup', float('nan')):5.2f} "
                  f"{row.get('reference_peak_bytes', float('nan')) / MIB:8.1f} {row['dropin_peak_bytes'] / MIB:8.1f} "
                  f"{row.get('identical', '-')}", flush=True)
    rows = doc["calls"]
    for r in rows:  # footprint: the call's peak plus what the encoder keeps for this K between calls
        for name in fns:
            r[f"{name}_footprint_bytes"] = max(r[f"{name}_peak_bytes"], r[f"{name}_first_peak_bytes"]) + \
                max(0, doc[f"{name}_kept_bytes_by_k"][str(r["bits"])])
    if "reference" in fns:
        print("footprint MiB (peak + kept for its K), reference / drop-in:", ", ".join(
            f"{r['call']} {r['reference_footprint_bytes'] / MIB:.0f}/{r['dropin_footprint_bytes'] / MIB:.0f}"
            for r in rows), flush=True)
    summary = {"calls": len(rows), "dropin_s": sum(r["dropin_s"] for r in rows),
               "dropin_first_s": sum(r["dropin_first_s"] for r in rows),
               "dropin_kept_mib_by_k": {k: v / MIB for k, v in doc["dropin_kept_bytes_by_k"].items()}}
    if args.reference:
        summary.update(reference_s=sum(r["reference_s"] for r in rows),
                       reference_first_s=sum(r["reference_first_s"] for r in rows),
                       reference_kept_mib_by_k={k: v / MIB for k, v in doc["reference_kept_bytes_by_k"].items()},
                       total_speedup=sum(r["reference_s"] for r in rows) / summary["dropin_s"],
                       first_call_speedup=sum(r["reference_first_s"] for r in rows) / summary["dropin_first_s"],
                       min_speedup=min(r["speedup"] for r in rows),
                       identical=sum(bool(r["identical"]) for r in rows),
                       bytes_compared=sum(r["bytes_compared"] for r in rows),
                       max_footprint_ratio=max(r["dropin_footprint_bytes"] / r["reference_footprint_bytes"]
                                               for r in rows))
        for caller in ("online", "gate", "tool"):
            part = [r for r in rows if r["caller"] == caller]
            summary[f"{caller}_speedup"] = sum(r["reference_s"] for r in part) / sum(r["dropin_s"] for r in part)
    doc["summary"] = summary
    print(json.dumps(summary, indent=2), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
