"""Benchmark of the Triton Viterbi tile quantizer (exl3tool.kernels.viterbi) on one GPU.

``run()`` checks correctness on a golden configuration first (every tile, bit for bit), then times the
kernel on fresh Gaussian tiles with CUDA events (one warm-up, median of several runs) and returns
tiles/s. Run as a script it also sweeps kernel variants and bit widths, prints a table and writes
JSON (and the default variant's PTX / resource report) to $OUT when set.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from exl3tool.kernels import viterbi as vmod  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _viterbi_compiled import last_compiled, record  # noqa: E402

record()

REFERENCE_MS_65536 = 848.0  # reference CUDA kernel, K=6 mcg, 65,536 tiles, H200 (from the brief)


def _golden_path() -> Path | None:
    env = os.environ.get("EXL3TOOL_GOLDEN")
    for p in ([Path(env)] if env else []) + [REPO / "golden", REPO.parent / "shared" / "golden"]:
        if (p / "tiles_golden.safetensors").is_file():
            return p
    return None


def check_golden(bits: int = 6, codebook: str = "mcg", **variant) -> dict:
    """Every golden tile of one configuration through the kernel; counts of differing tiles."""
    from safetensors.torch import load_file

    path = _golden_path()
    if path is None:
        return {"golden": "missing"}
    g = load_file(str(path / "tiles_golden.safetensors"))
    tag = f"k{bits}_{codebook}"
    if f"{tag}.input" not in g:
        return {"golden": f"no {tag}"}
    vals, states = vmod.viterbi_tiles(g[f"{tag}.input"].cuda(), bits, codebook, **variant)
    bad = int((states.cpu() != g[f"{tag}.indices"]).any(dim=1).sum())
    badv = int((vals.cpu() != g[f"{tag}.output"]).any(dim=1).sum())
    return {"golden": tag, "tiles": int(states.shape[0]), "bad_states": bad, "bad_values": badv}


def time_kernel(n_tiles: int, bits: int, codebook: str = "mcg", reps: int = 3, **variant) -> dict:
    """Median wall time (CUDA events) of viterbi_tiles on n_tiles fresh N(0,1) tiles, after a warm-up."""
    x = torch.randn(n_tiles, 256, device="cuda")
    vmod.viterbi_tiles(x[: min(n_tiles, 256)], bits, codebook, **variant)  # compile + warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        x.normal_()  # fresh data every run
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        vmod.viterbi_tiles(x, bits, codebook, **variant)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    return {"n_tiles": n_tiles, "bits": bits, "codebook": codebook, "ms": ms, "ms_all": times,
            "tiles_per_s": n_tiles / (ms / 1e3)}


def _resources() -> dict:
    c = last_compiled()
    out = {}
    for name in ("n_regs", "n_spills"):
        out[name] = getattr(c, name, None)
    md = getattr(c, "metadata", None)
    out["shared"] = getattr(md, "shared", None)
    return out


def run(n_tiles: int = 65536, bits: int = 6, codebook: str = "mcg", reps: int = 3, **variant) -> dict:
    """Correctness on the golden K=6 mcg set, then tiles/s for n_tiles tiles of ``bits``/``codebook``."""
    if not torch.cuda.is_available():
        raise RuntimeError("the Viterbi benchmark needs a CUDA device")
    check = check_golden(6, "mcg", **variant)
    if check.get("bad_states") or check.get("bad_values"):
        raise AssertionError(f"viterbi kernel disagrees with the golden tiles: {check}")
    res = time_kernel(n_tiles, bits, codebook, reps=reps, **variant)
    res.update(check=check, variant=variant, resources=_resources(), device=torch.cuda.get_device_name())
    if bits == 6 and codebook == "mcg":
        res["reference_tiles_per_s"] = 65536 / (REFERENCE_MS_65536 / 1e3)
    return res


VARIANTS = {
    "m4_auto": dict(mode=4),
    "m4_w4": dict(mode=4, num_warps=4),
    "m4_w2": dict(mode=4, num_warps=2),
    "m4_w8": dict(mode=4, num_warps=8),
    "m1_w4": dict(mode=1, num_warps=4),
    "m4_w4_be512": dict(mode=4, num_warps=4, block_edges=512),
}


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark")
        return
    out_dir = os.environ.get("OUT")
    n = int(os.environ.get("VITERBI_BENCH_TILES", "65536"))
    names = os.environ.get("VITERBI_VARIANTS", ",".join(VARIANTS)).split(",")
    results = {"variants": {}, "bits_sweep": {}}
    for name in names:
        variant = VARIANTS[name]
        t0 = time.time()
        try:
            # a short probe first so a very slow variant cannot eat the run
            probe = time_kernel(4096, 6, "mcg", reps=1, **variant)
            nn = n if probe["tiles_per_s"] > 20000 else 8192
            res = run(nn, 6, "mcg", **variant)
        except Exception as exc:  # keep sweeping: a variant may fail to assemble
            res = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
        res["wall_s"] = time.time() - t0
        results["variants"][name] = res
        print(name, json.dumps(res), flush=True)
        if out_dir and name == names[0] and last_compiled() is not None:
            asm = getattr(last_compiled(), "asm", {})
            for key in ("ptx", "sass"):
                try:
                    if key in asm:
                        Path(out_dir, f"viterbi_{name}.{key}").write_text(str(asm[key]))
                except Exception as exc:  # sass needs a disassembler
                    print("no", key, exc)
    ok = [k for k, v in results["variants"].items() if "tiles_per_s" in v]
    best = max(ok, key=lambda k: results["variants"][k]["tiles_per_s"]) if ok else None
    if best is not None and os.environ.get("VITERBI_SWEEP", "1") == "1":
        for bits in range(1, 9):
            try:
                results["bits_sweep"][bits] = {
                    "check": check_golden(bits, "mcg", **VARIANTS[best]) if bits >= 2 else None,
                    **time_kernel(8192 if bits >= 3 else 2048, bits, "mcg", reps=2, **VARIANTS[best]),
                }
            except Exception as exc:
                results["bits_sweep"][bits] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            print("bits", bits, json.dumps(results["bits_sweep"][bits]), flush=True)
    results["best"] = best
    if out_dir:
        Path(out_dir, "bench_viterbi.json").write_text(json.dumps(results, indent=1))
    print("\nvariant        tiles/s     ms(65536-eq)  regs spills  golden")
    for k, v in results["variants"].items():
        if "tiles_per_s" in v:
            print(f"{k:14s} {v['tiles_per_s']:10.0f} {65536 / v['tiles_per_s'] * 1e3:10.1f}   "
                  f"{v['resources'].get('n_regs')} {v['resources'].get('n_spills')}  {v['check']}")
        else:
            print(f"{k:14s} ERROR {v['error'][:300]}")
    for b, v in results["bits_sweep"].items():
        if "tiles_per_s" in v:
            print(f"K={b} {v['tiles_per_s']:10.0f} tiles/s  check={v['check']}")
        else:
            print(f"K={b} ERROR {v['error'][:200]}")
    print("reference CUDA kernel: %.0f tiles/s; target 77000, goal 116000" % (65536 / REFERENCE_MS_65536 * 1e3))


if __name__ == "__main__":
    main()
