"""Kernel benchmark: correctness first, then the Triton Viterbi (tiles/s vs the CPU path and the reference
CUDA kernel) and the trellis GEMM (vs torch fp16 matmul on the dequantized weight, cold L2).

    python benchmarks/bench_kernels.py            # on a CUDA machine; writes $OUT/bench_kernels.json if OUT is set

Env: VITERBI_VARIANTS (comma list, default m4_auto,m1_w4), VITERBI_BENCH_TILES (default 65536),
EXL3_BENCH_SWEEP=1 to sweep every GEMM config instead of timing the one `choose_config` picks,
EXL3_BENCH_MS to change the GEMM batch sizes (default 1,4,16,64,512,4096), EXL3_BENCH_PARTS=gemm (or viterbi)
to run one half only.

The GEMM part prints, per shape and m, exl3tool's time, the path `trellis_matmul` chose (fused kernel or
reconstruct + cuBLAS), torch fp16 matmul's time and the ratio, then one table of the ratios.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_gemm  # noqa: E402
import _bench_viterbi  # noqa: E402


def cpu_viterbi_rate(n_tiles: int = 256, bits: int = 6) -> float:
    """tiles/s of the numba CPU path on this machine (the baseline of the ratio)."""
    from exl3tool.encode import quantize_tiles

    tiles = torch.randn(n_tiles, 256)
    quantize_tiles(tiles[:2], bits)  # compile
    t0 = time.perf_counter()
    quantize_tiles(tiles, bits)
    return n_tiles / (time.perf_counter() - t0)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA device")
    out = os.environ.get("OUT")
    n = int(os.environ.get("VITERBI_BENCH_TILES", "65536"))
    parts = os.environ.get("EXL3_BENCH_PARTS", "viterbi,gemm").split(",")
    import triton

    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "triton": triton.__version__, "viterbi": {}, "gemm": []}
    cpu_rate = cpu_viterbi_rate() if "viterbi" in parts else float("nan")
    result["cpu_viterbi_tiles_per_s"] = cpu_rate
    variants = os.environ.get("VITERBI_VARIANTS", "m4_auto,m1_w4").split(",") if "viterbi" in parts else []
    for name in variants:
        try:
            res = _bench_viterbi.run(n, 6, "mcg", **_bench_viterbi.VARIANTS[name])
        except Exception as exc:
            res = {"error": f"{type(exc).__name__}: {str(exc)[:1000]}"}
        result["viterbi"][name] = res
        print("viterbi", name, {k: res.get(k) for k in ("tiles_per_s", "ms", "check", "error")}, flush=True)
    try:
        if "gemm" in parts:
            result["gemm"] = _bench_gemm.run()
    except Exception as exc:
        result["gemm_error"] = f"{type(exc).__name__}: {exc}"
    if out:
        Path(out, "bench_kernels.json").write_text(json.dumps(result, indent=1, default=str))

    if variants:
        print(f"\nViterbi, K=6 mcg, {n} Gaussian tiles ({result['device']}); CPU path {cpu_rate:.0f} tiles/s")
        print(f"{'variant':10} {'tiles/s':>10} {'x CPU':>8} {'x ref CUDA':>10} {'golden':>8}")
    for name, r in result["viterbi"].items():
        if "tiles_per_s" in r:
            ok = "ok" if not (r["check"].get("bad_states") or r["check"].get("bad_values")) else "BAD"
            print(f"{name:10} {r['tiles_per_s']:>10.0f} {r['tiles_per_s'] / cpu_rate:>8.0f} "
                  f"{r['tiles_per_s'] / 77283:>10.2f} {ok:>8}")
        else:
            print(f"{name:10} ERROR {r['error'][:200]}")
    if result["gemm"]:
        print("\nTrellis GEMM (K=6 mcg), GPU time, cold L2, vs torch fp16 matmul on the dequantized weight")
        for r in result["gemm"]:
            if r.get("kind") in ("default", "best"):
                print(r["kind"], _bench_gemm._fmt(r))
        print("\nTime ratio exl3tool / torch fp16 (default configs, this run; target <= 1.15 at m >= 512):")
        print(_bench_gemm.table(result["gemm"]))
    if "gemm_error" in result:
        print("GEMM ERROR", result["gemm_error"])


if __name__ == "__main__":
    main()
