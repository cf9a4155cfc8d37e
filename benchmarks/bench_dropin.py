"""The drop-in encoder vs exllamav3's quantize_exl3, called as the vLLM fork calls them, on deployed layer shapes.

    # on a GPU machine with the exllamav3 1.6.5 wheel unpacked (pip install --no-deps --target /tmp/site ...):
    TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 PYTHONPATH=$PWD:/tmp/site \\
        python benchmarks/bench_dropin.py --reference /tmp/site/exllamav3 --json out.json

Both encoders are loaded from their directories the way the fork loads VLLM_EXL3_ENCODER_SOURCE (synthetic
packages, no ``__init__.py``; ``tests/_fork_loader.py``): exl3tool's from a fresh ``exl3tool encoder-source`` export,
exllamav3's from its package directory (its first import JIT-compiles the CUDA extension: timed and reported as
``reference_import_s``). Every layer is called with the fork's arguments (the transposed BF16 weight as float32 on
the GPU, a meta-device H, ``K``, ``seed`` = crc32 of the prefix, ``devices``, ``apply_out_scales``, ``mcg``).

Per layer: seconds of each call (synchronised wall time, one call each after a warm-up on a small layer and,
with ``--warm-each``, after an untimed call of each encoder on the same layer: what a server that encodes many
layers of a shape sees; the first call's seconds, which include a Triton compile where a kernel variant is new to
the process, are then reported as ``*_first_s``),
speed-up, peak GPU memory above what was allocated before the call (the weight is allocated before) and the
footprint: that peak plus what the encoder keeps allocated between calls (exllamav3 caches its Viterbi scratch
per K, 133 MiB at K=6 and 532 MiB at K=4 on an H200, which the per-call figure leaves out), and byte
identity of trellis, suh, svh, the proxy error and g against the reference and against ``encode_linear`` (what
``exl3tool encode`` runs) for the same weight and seed. Without ``--reference`` only the drop-in is measured.

Shapes, (in_features, out_features) per rank: DeepSeek-V3 at TP 8 and GLM-5.3-Flash at TP 2 (K=4, the scope's
bits) are every distinct shape exl3tool plans for them (``tests/checkpoint/test_real_configs.py`` geometries, both
overlays); Qwen3.8-27B at TP 1 takes the Qwen3.5-27B geometry (hidden 5120, intermediate 17408, 24 x 256 gated
attention heads, 4 KV heads, 16/48 x 128 linear-attention heads; no real config.json is in the repository), its
full attention (BF16 in the deployed builds) and, where a build ships them BF16, its MLP and GDN projections.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from _fork_loader import fork_seed, load_quantize_exl3  # noqa: E402

from exl3tool.encode.online import encode_linear  # noqa: E402
from exl3tool.serving.encoder_source import write_encoder_source  # noqa: E402

Q = "model.language_model.layers"
G = "language_model.model.layers"
D = "model.layers"
MODELS: dict[str, tuple[int, int, list[tuple[str, int, int]]]] = {
    # name: (TP, bits, [(prefix, in_features per rank, out_features per rank)])
    "Qwen3.8-27B": (1, 6, [
        (f"{Q}.3.self_attn.qkv_proj", 5120, 14336),
        (f"{Q}.3.self_attn.o_proj", 6144, 5120),
        (f"{Q}.0.linear_attn.in_proj_qkvz", 5120, 16384),
        (f"{Q}.0.linear_attn.out_proj", 6144, 5120),
        (f"{Q}.0.mlp.gate_up_proj", 5120, 34816),
        (f"{Q}.0.mlp.down_proj", 17408, 5120),
    ]),
    "GLM-5.3-Flash": (2, 4, [
        (f"{G}.0.self_attn.f_b_proj", 128, 4096),
        (f"{G}.0.self_attn.g_a_proj", 4096, 128),
        (f"{G}.0.self_attn.o_proj", 4096, 4096),
        (f"{G}.0.mlp.gate_up_proj", 4096, 12288),
        (f"{G}.0.mlp.down_proj", 6144, 4096),
        (f"{G}.4.mlp.shared_experts.gate_up_proj", 4096, 2048),
        (f"{G}.4.mlp.shared_experts.down_proj", 1024, 4096),
    ]),
    "DeepSeek-V3": (8, 6, [
        (f"{D}.0.self_attn.q_b_proj", 1536, 3072),
        (f"{D}.0.self_attn.kv_b_proj", 512, 4096),
        (f"{D}.0.self_attn.o_proj", 2048, 7168),
        (f"{D}.0.mlp.gate_up_proj", 7168, 4608),
        (f"{D}.0.mlp.down_proj", 2304, 7168),
        (f"{D}.3.mlp.shared_experts.gate_up_proj", 7168, 512),
        (f"{D}.3.mlp.shared_experts.down_proj", 256, 7168),
    ]),
}


def layer_weight(out_features: int, in_features: int, seed: int, device: torch.device) -> torch.Tensor:
    """A BF16 Linear weight (out, in) with uneven input-channel scales, made on the CPU (same values everywhere)."""
    gen = torch.Generator().manual_seed(seed)
    scale = 0.005 + 0.03 * torch.rand(1, in_features, generator=gen)
    return (torch.randn(out_features, in_features, generator=gen) * scale).to(torch.bfloat16).to(device)


def fork_call(fn, weight: torch.Tensor, bits: int, seed: int, device: torch.device) -> dict:
    """One call with the fork's arguments; seconds and peak memory above the allocation before the call."""
    source = weight.t().float().contiguous()  # made fresh per call: the reference regularises it in place
    k = source.shape[0]
    h_data = {"H": torch.zeros(k, k, dtype=torch.float32, device="meta"), "first_key": "vllm-online", "count": 0,
              "finalized": False, "num_total": 0, "inf_nan": torch.zeros(2, dtype=torch.long, device=device),
              "device": device}
    quant_args = {"K": bits, "seed": seed, "devices": [device], "apply_out_scales": True, "mcg": True}
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    weight_q, proxy, tensors = fn(source, h_data, quant_args, return_weight_q=False, verbose=False)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - base
    del weight_q, source
    if not quant_args.get("q_fallback"):
        raise RuntimeError("online EXL3 Trellis unexpectedly used calibrated LDLQ")
    return {"seconds": seconds, "peak_bytes": peak, "proxy_error": float(proxy), "g_scale": quant_args["g_scale"],
            "tensors": {name: tensors[name] for name in ("trellis", "suh", "svh")}}


def same(a: dict, b: dict) -> bool:
    return (a["proxy_error"] == b["proxy_error"] and a["g_scale"] == b["g_scale"]
            and all(torch.equal(a["tensors"][n], b["tensors"][n]) for n in ("trellis", "suh", "svh")))


def differences(a: dict, b: dict) -> dict:
    """Which parts differ (tiles of the trellis that differ, scales that differ, proxy and g)."""
    out = {}
    ta, tb = a["tensors"]["trellis"], b["tensors"]["trellis"]
    out["trellis_tiles_differing"] = int((ta != tb).any(dim=-1).sum()) if ta.shape == tb.shape else -1
    for n in ("suh", "svh"):
        out[f"{n}_differing"] = int((a["tensors"][n] != b["tensors"][n]).sum())
    out["proxy_error"] = [a["proxy_error"], b["proxy_error"]]
    out["g_scale"] = [a["g_scale"], b["g_scale"]]
    return out


def persistent(fn, bits: int, device: torch.device) -> int:
    """Warm-up call on a small layer (compiles kernels, fills caches); bytes it leaves allocated."""
    before = torch.cuda.memory_allocated(device)
    fork_call(fn, layer_weight(256, 512, 7, device), bits, 7, device)
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device) - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", default=None, help="exllamav3 package directory (the fork's encoder source)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    ap.add_argument("--no-encode-check", action="store_true", help="skip the encode_linear byte comparison")
    ap.add_argument("--warm-each", action="store_true",
                    help="time each encoder's second call of every layer (the first is reported as *_first_s)")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results to this file")
    args = ap.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    doc: dict = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                 "reference": args.reference, "layers": []}

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "exl3tool-encoder"
        write_encoder_source(root)
        start = time.perf_counter()
        dropin = load_quantize_exl3(root)
        doc["dropin_import_s"] = time.perf_counter() - start
        ref = None
        if args.reference:
            start = time.perf_counter()
            ref = load_quantize_exl3(args.reference, package="_exllamav3_reference")
            doc["reference_import_s"] = time.perf_counter() - start  # includes the JIT compile when not cached
            print(f"reference loaded in {doc['reference_import_s']:.1f} s (JIT compile of its extension included)",
                  flush=True)
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        # the process's cuBLAS workspace (32 MiB on an H200), made by its first matmul and kept: exl3tool's
        # Hadamard matmul would make it, the reference's Hadamard kernel would not, and a server's own matmuls
        # keep it anyway. Made here, before either encoder runs, so that neither's "kept" figure holds it
        before = torch.cuda.memory_allocated(device)
        torch.ones(128, 128, device=device) @ torch.ones(128, 128, device=device)
        torch.cuda.synchronize(device)
        doc["cublas_workspace_bytes"] = torch.cuda.memory_allocated(device) - before
        print(f"cuBLAS workspace of the process: {doc['cublas_workspace_bytes'] / 2**20:.1f} MiB (counted for neither)",
              flush=True)
        for bits in sorted({MODELS[m][1] for m in names}):
            doc[f"dropin_persistent_bytes_k{bits}"] = persistent(dropin, bits, device)
            if ref is not None:
                doc[f"reference_persistent_bytes_k{bits}"] = persistent(ref, bits, device)

        header = (f"{'model':14} {'layer':40} {'shape':>14} {'K':>2} {'ref s':>7} {'ours s':>7} {'x':>5} "
                  f"{'ref GiB':>8} {'ours GiB':>8} {'=ref':>5} {'=enc':>5}  (GiB: footprint = call peak + kept between calls)")
        print(header, flush=True)
        for model in names:
            tp, bits, layers = MODELS[model]
            for prefix, k, n in layers:
                seed = fork_seed(prefix)
                weight = layer_weight(n, k, seed, device)
                row = {"model": model, "tp": tp, "prefix": prefix, "k": k, "n": n, "bits": bits, "seed": seed,
                       "tiles": (k // 16) * (n // 16)}
                if args.warm_each:  # the first calls, untimed for the speed-up (a compile is a one-off)
                    if ref is not None:
                        row["reference_first_s"] = fork_call(ref, weight, bits, seed, device)["seconds"]
                    row["dropin_first_s"] = fork_call(dropin, weight, bits, seed, device)["seconds"]
                r = fork_call(ref, weight, bits, seed, device) if ref is not None else None
                ours = fork_call(dropin, weight, bits, seed, device)
                # footprint: the call's peak plus what the encoder keeps allocated between calls (the reference
                # caches its Viterbi scratch per K), i.e. the figure a fresh process would peak at for this layer
                row.update(dropin_s=ours["seconds"], dropin_peak_bytes=ours["peak_bytes"],
                           dropin_footprint_bytes=ours["peak_bytes"] + doc[f"dropin_persistent_bytes_k{bits}"],
                           proxy_error=ours["proxy_error"], g_scale=ours["g_scale"])
                if r is not None:
                    row.update(reference_s=r["seconds"], reference_peak_bytes=r["peak_bytes"],
                               reference_footprint_bytes=r["peak_bytes"] + doc[f"reference_persistent_bytes_k{bits}"],
                               speedup=r["seconds"] / ours["seconds"], identical_to_reference=same(ours, r))
                    if not row["identical_to_reference"]:
                        row["reference_differences"] = differences(ours, r)
                if not args.no_encode_check:
                    enc = encode_linear(weight.t().float().contiguous(), bits=bits, seed=seed, codebook="mcg")
                    mine = {"proxy_error": enc.proxy_error, "g_scale": enc.g_scale,
                            "tensors": {"trellis": enc.trellis, "suh": enc.suh, "svh": enc.svh}}
                    row["identical_to_encode_linear"] = same(ours, mine)
                    del enc, mine
                doc["layers"].append(row)
                del r, ours, weight
                torch.cuda.empty_cache()
                gib = 1 << 30
                print(f"{model:14} {prefix.split('layers.')[-1]:40} {str((k, n)):>14} {bits:>2} "
                      f"{row.get('reference_s', float('nan')):7.3f} {row['dropin_s']:7.3f} "
                      f"{row.get('speedup', float('nan')):5.2f} "
                      f"{row.get('reference_footprint_bytes', float('nan')) / gib:8.3f} "
                      f"{row['dropin_footprint_bytes'] / gib:8.3f} "
                      f"{str(row.get('identical_to_reference', '-')):>5} {str(row.get('identical_to_encode_linear', '-')):>5}",
                      flush=True)

    rows = doc["layers"]
    summary = {"layers": len(rows), "dropin_s": sum(r["dropin_s"] for r in rows),
               "all_identical_to_encode_linear": all(r.get("identical_to_encode_linear", True) for r in rows)}
    if rows and "reference_s" in rows[0]:
        summary.update(reference_s=sum(r["reference_s"] for r in rows),
                       min_speedup=min(r["speedup"] for r in rows),
                       total_speedup=sum(r["reference_s"] for r in rows) / summary["dropin_s"],
                       all_identical_to_reference=all(r["identical_to_reference"] for r in rows),
                       peak_within_reference=all(r["dropin_peak_bytes"] <= r["reference_peak_bytes"] for r in rows),
                       max_peak_ratio=max(r["dropin_peak_bytes"] / r["reference_peak_bytes"] for r in rows),
                       footprint_within_reference=all(r["dropin_footprint_bytes"] <= r["reference_footprint_bytes"]
                                                      for r in rows),
                       max_footprint_ratio=max(r["dropin_footprint_bytes"] / r["reference_footprint_bytes"]
                                               for r in rows))
    if rows and "dropin_first_s" in rows[0]:  # --warm-each: the first calls, compiles included
        summary["dropin_first_s"] = sum(r["dropin_first_s"] for r in rows)
        if "reference_first_s" in rows[0]:
            summary["reference_first_s"] = sum(r["reference_first_s"] for r in rows)
            summary["min_first_call_speedup"] = min(r["reference_first_s"] / r["dropin_first_s"] for r in rows)
    doc["summary"] = summary
    print(json.dumps(summary, indent=2), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
