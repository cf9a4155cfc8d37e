"""Sweep of the fused trellis GEMM's small-m launches (SMALL_M_TABLE in exl3tool/kernels/gemm/tuning.py), one GPU.

Why: at m = 2 .. 32 the tl.dot kernel is 0.75-0.91x of exllamav3's speed (benchmarks/README.md, "Trellis GEMM").
This times, for the three benchmark shapes and m in 1, 2, 4, 8, 16, 32, 128, the current default (choose_config,
the baseline of the same run) and candidate table entries (the FMA form with 1-8 rows per program and x2 in
fp32, BM=16/32 tl.dot with other split-K, BK, L2 prefetch, warps). Every candidate's output is checked against
float64 (relative error < 5e-4, _bench_gemm's bound) and compared with the default's output.

Timing: the GPU time of _bench_gemm (L2 flushed before every call, a spin kernel so that launches are off the
clock), in interleaved rounds (every candidate of a (shape, m) once per round) so that drift hits them alike;
the median of all samples. Configs are compiled first in parallel processes (Triton's disk cache).

    python3 benchmarks/gemm_sweep_small_m.py --json $OUT/gemm_small_m.json      # on the GPU, about 2 minutes
    python3 benchmarks/gemm_sweep_small_m.py --print-table $OUT/gemm_small_m.json  # SMALL_M_TABLE rows to paste
    TRITON_INTERPRET=1 python3 benchmarks/gemm_sweep_small_m.py --tiny          # CPU smoke test (times meaningless)

Per (shape, m) it prints the default's time, the best candidate (label, time, ratio to the default) and, where
the earlier H200 runs (benchmarks/results/*.json) have them, exllamav3's time and our earlier default's time.
At the end: the suggested SMALL_M_TABLE (per m, the entry with the best geometric-mean time over the three
shapes, kept only if it gains at least 2 % on that mean and loses no more than 2 % on any shape).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from exl3tool.kernels import gemm as g  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
TINY_SHAPES = [(256, 256), (384, 128)]
MS = [2, 4, 8, 16, 32, 1, 128]  # targets first: a run cut short by --budget-s still has them
BITS = 6
CODEBOOK = "mcg"
ERR_BOUND = 5e-4  # relative to float64, as benchmarks/_bench_gemm.py
GAIN = 0.98  # a table change must bring the geometric mean over the shapes to <= 0.98x the default's time
WORST = 1.02  # ... and leave no shape slower than 1.02x
RESULTS = ROOT / "benchmarks" / "results"
# earlier H200 runs: exllamav3's time (reference_us) and our default's time there (time_us, kind "default")
EARLIER_FILES = ["bench_gemm_speed_h200.json", "gemm_sweep_balanced_h200.json", "gemm_sweep_issue13_h200.json"]


def _fma(rows: int, bk: int, per_sm: int, *, x_f32: bool = True, l2: bool = True, **extra) -> dict:
    return dict(bm=16, bk=bk, fma=rows, x_f32=x_f32, l2_prefetch=l2, per_sm=per_sm, **extra)


def _dot(bm: int, bk: int, per_sm: int, *, l2: bool = False, **extra) -> dict:
    return dict(bm=bm, bk=bk, l2_prefetch=l2, per_sm=per_sm, **extra)


# Candidate SMALL_M_TABLE entries per m (the default is added by the sweep). Chosen from sm_90 SASS (Triton's
# offline compile, the loop per 32 weights and thread): m = 1 FMA 348 instructions (x2 in fp32: 322); 2-row FMA
# BK=32 361 (172 registers), BK=16 396 (116); 4 rows BK=16 466 (232 registers); 8 rows BK=16 694 with x staged in
# shared memory; BM=16 tl.dot 317 plus 32 STS.U16 and two barriers per step (the L1-bound staging of
# benchmarks/README.md). Two warps or 8 warps put x or the decode through shared memory: left out. Register
# counts move with the split and the L2 prefetch (fma4 BK=16 on (4096,14336): 232 at 16 splits, 195 at 8), so
# a variant without the prefetch is timed too. None of them spills (sm_90, Triton 3.9).
CANDIDATES: dict[int, dict[str, dict]] = {
    1: {"fma1/x32": _fma(1, 32, 16, min_chunks=2),
        "fma1/x32/sm8": _fma(1, 32, 8, min_chunks=2)},
    2: {"fma2/bk32/sm16": _fma(2, 32, 16, min_chunks=2),
        "fma2/bk32/sm8": _fma(2, 32, 8),
        "fma2/bk16/sm16": _fma(2, 16, 16, min_chunks=2),
        "fma2/bk32/x16/sm16": _fma(2, 32, 16, x_f32=False, min_chunks=2),
        "fma2/bk32/nol2/sm16": _fma(2, 32, 16, l2=False, min_chunks=2),
        "fma1x2/bk32/sm16": _fma(1, 32, 16, min_chunks=2)},
    4: {"fma4/bk16/sm16": _fma(4, 16, 16, min_chunks=2),
        "fma4/bk16/nol2/sm16": _fma(4, 16, 16, l2=False, min_chunks=2),
        "fma4/bk16/sm8": _fma(4, 16, 8),
        "fma4/bk32/sm8": _fma(4, 32, 8),
        "fma2x2/bk32/sm16": _fma(2, 32, 16, min_chunks=2),
        "dot16/bk32/l2/sm4": _dot(16, 32, 4, l2=True)},
    8: {"fma8/bk16/sm8": _fma(8, 16, 8),
        "fma4x2/bk16/sm16": _fma(4, 16, 16),
        "dot16/bk32/l2/sm4": _dot(16, 32, 4, l2=True),
        "dot16/bk64/l2/sm2": _dot(16, 64, 2, l2=True),
        "dot16/bk32/sm8": _dot(16, 32, 8)},
    16: {"dot16/bk32/l2/sm4": _dot(16, 32, 4, l2=True),
         "dot16/bk64/l2/sm2": _dot(16, 64, 2, l2=True),
         "dot16/bk32/sm8": _dot(16, 32, 8),
         "dot16/bk32/sm2": _dot(16, 32, 2),
         "dot16/bk32/w8/sm2": _dot(16, 32, 2, num_warps=8),
         "fma8x2/bk16/sm8": _fma(8, 16, 8)},
    32: {"dot32/bk32/sm4": _dot(32, 32, 4),
         "dot32/bk32/l2/sm4": _dot(32, 32, 4, l2=True),
         "dot32/bk64/l2/sm2": _dot(32, 64, 2, l2=True),
         "dot32/bk32/sm8": _dot(32, 32, 8),
         "dot16x2/bk32/sm4": _dot(16, 32, 4),
         "dot64/bk64/l2/sm8": _dot(64, 64, 8, l2=True, balanced=False)},
    128: {},  # the reconstruct path: the default only (a regression check)
}


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _config_dict(cfg) -> dict:
    d = dict(cfg.__dict__, kind=type(cfg).__name__)
    if isinstance(cfg, g.GemmConfig):
        d["fma"] = int(cfg.fma)  # True -> 1
    return d


def _config_from_dict(d: dict):
    d = dict(d)
    kind = d.pop("kind")
    return g.ReconConfig(**d) if kind == "ReconConfig" else g.GemmConfig(**d)


def _weight(k: int, n: int, device: str, seed: int):
    """A random encoded (k, n) weight (every bit pattern is a valid trellis): trellis, suh, svh."""
    gen = torch.Generator().manual_seed(seed)
    tr = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * BITS), dtype=torch.int16, generator=gen)
    suh = (torch.randn(k, generator=gen) * 0.05).half()
    svh = (torch.randn(n, generator=gen).abs() + 0.5).half()
    return tr.to(device), suh.to(device), svh.to(device)


def _x(m: int, k: int, device: str, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).half().to(device)


def plan(shapes: list[tuple[int, int]], ms: list[int], device: torch.device) -> list[dict]:
    """Per (shape, m): the default config and every candidate's config; a candidate whose config equals an
    earlier one there is timed once, under the first label, with its own label in that row's ``aliases``."""
    jobs = []
    for m in ms:
        for k, n in shapes:
            default_entry = g.small_m_entry(m) if m < g.RECON_MIN_M else None
            cands = [dict(label="default", entry=default_entry, cfg=g.choose_config(m, k, n, device), aliases=[])]
            for label, entry in CANDIDATES.get(m, {}).items():
                cfg = g.config_from_entry(entry, m, k, n, device)
                same = next((c for c in cands if c["cfg"] == cfg), None)
                if same is None:
                    cands.append(dict(label=label, entry=entry, cfg=cfg, aliases=[]))
                else:
                    same["aliases"].append(label)
            jobs.append(dict(k=k, n=n, m=m, cands=cands))
    return jobs


_WORKER_INPUTS: dict = {}


def _warm_one(job: tuple) -> str:
    """Worker: compile one config by calling it once on random data (fills Triton's disk cache)."""
    k, n, m, cfg, device = job
    try:
        if (k, n) not in _WORKER_INPUTS:  # at most the three shapes, 44 MB each
            _WORKER_INPUTS[(k, n)] = _weight(k, n, device, 0)
        tr, suh, svh = _WORKER_INPUTS[(k, n)]
        x = _x(m, k, device, 0)
        g.trellis_matmul(x, tr, suh, svh, bits=BITS, codebook=CODEBOOK, config=_config_from_dict(cfg))
        if device == "cuda":
            torch.cuda.synchronize()
        return "ok"
    except Exception as exc:  # reported, and the config is then reported as failing in the timed run too
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def precompile(jobs: list[dict], deadline_s: float, device: str = "cuda") -> dict:
    """Compile every distinct config in parallel processes, until ``deadline_s``; returns counts."""
    import multiprocessing as mp

    work, seen = [], set()
    for j in jobs:
        mclass = 1 if j["m"] == 1 else (16 if j["m"] % 16 == 0 else 0)  # Triton specialises M == 1, M % 16 == 0
        for cand in j["cands"]:
            cfg = cand["cfg"]
            key = (cfg, mclass, j["k"], j["n"])
            if key not in seen:
                seen.add(key)
                work.append((j["k"], j["n"], j["m"], _config_dict(cfg), device))
    workers = max(1, min(len(work), (os.cpu_count() or 2) - 2, 16))
    t0 = time.time()
    done, failed = 0, []
    pool = mp.get_context("spawn").Pool(workers)
    try:
        for res in pool.imap_unordered(_warm_one, work, chunksize=1):
            done += 1
            if res != "ok":
                failed.append(res)
            if time.time() - t0 > deadline_s:
                print(f"precompile: deadline after {done}/{len(work)} configs; the rest compile when first timed",
                      flush=True)
                break
    finally:
        pool.terminate()
        pool.join()
    print(f"precompiled {done}/{len(work)} configs in {time.time() - t0:.0f} s with {workers} workers, "
          f"{len(failed)} failed", flush=True)
    for f in failed[:10]:
        print("  compile failure:", f, flush=True)
    return dict(configs=len(work), compiled=done, failed=len(failed), seconds=round(time.time() - t0, 1))


def _samples(fn, flush: torch.Tensor | None, reps: int) -> list[float]:
    """GPU microseconds of fn(), reps times, L2 flushed and the launch queue primed before each
    (``_bench_gemm.cuda_samples``); on the CPU (interpreter) wall time, meaningless but exercising the code."""
    if flush is not None:
        from _bench_gemm import cuda_samples

        return [t * 1e6 for t in cuda_samples(fn, flush, reps)]
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return out


def _weight_fp64(tr: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    from exl3tool.format.decode import dequantize_tensors

    return dequantize_tensors(tr, suh, svh, BITS, CODEBOOK, torch.float64)


def earlier_runs() -> dict:
    """(k, n, m) -> {reference_us, earlier_default_us, source}: exllamav3's times and our default's, from the
    H200 results in benchmarks/results (the first file that has a figure wins)."""
    out: dict = {}
    for name in EARLIER_FILES:
        path = RESULTS / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        rows = data.get("gemm", []) if isinstance(data, dict) else data
        for r in rows:
            if not isinstance(r, dict) or "k" not in r:
                continue
            rec = out.setdefault(f"{r['k']},{r['n']},{r['m']}", {})
            if "reference_us" in r and "reference_us" not in rec:
                rec["reference_us"] = r["reference_us"]
            if r.get("kind") == "default" and "time_us" in r and "earlier_default_us" not in rec:
                rec["earlier_default_us"] = r["time_us"]
                rec["source"] = name
    return out


def run(args) -> dict:
    interp = _interpret()
    if not interp and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or TRITON_INTERPRET=1 with --tiny for a CPU smoke test)")
    device = torch.device("cpu" if interp else "cuda")
    shapes = TINY_SHAPES if args.tiny else SHAPES
    ms = [int(v) for v in args.ms.split(",")] if args.ms else MS
    t_start = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    jobs = plan(shapes, ms, device)
    n_cfg = sum(len(j["cands"]) for j in jobs)
    print(f"{len(jobs)} (shape, m) points, {n_cfg} configs to time on {device}", flush=True)
    result = dict(device=torch.cuda.get_device_name() if not interp else "cpu (TRITON_INTERPRET)",
                  torch=torch.__version__, triton=getattr(g.triton, "__version__", None),
                  shapes=shapes, ms=ms, bits=BITS, codebook=CODEBOOK, err_bound=ERR_BOUND,
                  candidates={str(m): c for m, c in CANDIDATES.items()},
                  default_table=[[largest, entry] for largest, entry in g.SMALL_M_TABLE],
                  earlier=earlier_runs(), rows=[], summary=[])
    if not interp and not args.no_precompile:
        result["precompile"] = precompile(jobs, args.compile_deadline_s)
    flush = None if interp else torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda")  # 256 MB
    reps = 1 if interp else args.reps
    rounds = 1 if interp else args.rounds
    weights: dict = {}
    for j in jobs:
        k, n, m = j["k"], j["n"], j["m"]
        if time.time() - t_start > args.budget_s:
            print(f"budget of {args.budget_s} s spent: ({k},{n}) m={m} and later points not timed", flush=True)
            result["cut_short"] = True
            break
        if (k, n) not in weights:  # kept for the run: three float64 weights, 1.2 GB on the GPU
            tr, suh, svh = _weight(k, n, str(device), 1000 * k + n)
            weights[(k, n)] = (tr, suh, svh, _weight_fp64(tr, suh, svh))
        tr, suh, svh, w64 = weights[(k, n)]
        x = _x(m, k, str(device), 7 * m + k)
        ref = x.double() @ w64
        rows, live, y_default = [], [], None
        for cand in j["cands"]:
            label, cfg = cand["label"], cand["cfg"]
            rec = dict(k=k, n=n, m=m, label=label, entry=cand["entry"], aliases=cand["aliases"],
                       config=_config_dict(cfg), default=label == "default")
            try:
                y = g.trellis_matmul(x, tr, suh, svh, bits=BITS, codebook=CODEBOOK, config=cfg)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                rec["rel_err"] = float((y.double() - ref).norm() / ref.norm())
                if label == "default":
                    y_default = y
                if y_default is not None:
                    rec["rel_diff_default"] = float((y.double() - y_default.double()).norm()
                                                    / y_default.double().norm())
                if not rec["rel_err"] < ERR_BOUND or not bool(torch.isfinite(y).all()):
                    rec["error"] = f"rel_err {rec['rel_err']:.3e} over {ERR_BOUND} (or non-finite)"
                else:
                    live.append((rec, cfg))
            except Exception as exc:  # a config that fails is reported, not fatal
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(rec)
        for rec, cfg in live:  # warm-up (compiles what precompile missed)
            _samples(lambda: g.trellis_matmul(x, tr, suh, svh, bits=BITS, codebook=CODEBOOK, config=cfg), flush, 2)
        samples: dict[int, list[float]] = {id(rec): [] for rec, _ in live}
        for _ in range(rounds):
            for rec, cfg in live:
                samples[id(rec)] += _samples(
                    lambda: g.trellis_matmul(x, tr, suh, svh, bits=BITS, codebook=CODEBOOK, config=cfg), flush, reps)
        for rec, _ in live:
            s = samples[id(rec)]
            rec["time_us"] = statistics.median(s)
            q = statistics.quantiles(s, n=4) if len(s) >= 4 else [0.0, 0.0, 0.0]
            rec["spread_us"] = q[2] - q[0]  # interquartile range
        result["rows"] += rows
        summ = summarize_point(rows, result["earlier"].get(f"{k},{n},{m}", {}),
                               reference_bracket(result["earlier"], k, n, m))
        result["summary"].append(summ)
        print(format_point(summ), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    result["table"] = suggest_table(result)
    result["seconds"] = round(time.time() - t_start, 1)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def reference_bracket(earlier: dict, k: int, n: int, m: int) -> list:
    """exllamav3's times (earlier run) at the nearest measured m below and above m, as [[m_lo, us], [m_hi, us]]
    (either may be None): where its time grows with m, its time at m lies between them."""
    have = sorted((int(key.split(",")[2]), v["reference_us"]) for key, v in earlier.items()
                  if key.startswith(f"{k},{n},") and "reference_us" in v)
    lo = [[mm, us] for mm, us in have if mm < m]
    hi = [[mm, us] for mm, us in have if mm > m]
    return [lo[-1] if lo else None, hi[0] if hi else None]


def summarize_point(rows: list[dict], earlier: dict, bracket: list | None = None) -> dict:
    """The default's and the best candidate's times at one (shape, m), with the earlier run's figures."""
    timed = [r for r in rows if "time_us" in r]
    d = next((r for r in rows if r["default"]), None)
    out = dict(k=rows[0]["k"], n=rows[0]["n"], m=rows[0]["m"], errors=[r["label"] for r in rows if "error" in r],
               **{key: earlier[key] for key in ("reference_us", "earlier_default_us") if key in earlier})
    if "reference_us" not in out and bracket is not None:
        out["reference_bracket"] = bracket
    if d is not None and "time_us" in d:
        out["default_us"] = d["time_us"]
        out["default_spread_us"] = d["spread_us"]
    if timed:
        best = min(timed, key=lambda r: r["time_us"])
        out.update(best=best["label"], best_us=best["time_us"], best_entry=best["entry"], best_config=best["config"])
        if "default_us" in out:
            out["best_vs_default"] = best["time_us"] / out["default_us"]
        if "reference_us" in out:
            out["best_speed_vs_reference"] = out["reference_us"] / best["time_us"]
            if "default_us" in out:
                out["default_speed_vs_reference"] = out["reference_us"] / out["default_us"]
    return out


def format_point(s: dict) -> str:
    head = f"({s['k']:>5},{s['n']:>5}) m={s['m']:<4}"
    if "best_us" not in s:
        return f"{head} nothing timed; errors: {s['errors']}"
    txt = f"{head} default {s.get('default_us', float('nan')):7.1f} us (+-{s.get('default_spread_us', 0):.1f})"
    txt += f" | best {s['best']:<20} {s['best_us']:7.1f} us x{s.get('best_vs_default', float('nan')):.3f} of default"
    if "reference_us" in s:
        txt += (f" | exllamav3 {s['reference_us']:.1f} us (earlier run): speed {s['best_speed_vs_reference']:.2f}x"
                f" (default {s.get('default_speed_vs_reference', float('nan')):.2f}x)")
    elif s.get("reference_bracket"):
        lo, hi = s["reference_bracket"]
        parts = [f"m={b[0]}: {b[1]:.1f} us" for b in (lo, hi) if b]
        if parts:
            txt += " | exllamav3 (earlier run) " + ", ".join(parts)
    if "earlier_default_us" in s:
        txt += f" | our default earlier {s['earlier_default_us']:.1f} us"
    if s["errors"]:
        txt += f" | FAILED: {s['errors']}"
    return txt


def suggest_table(result: dict) -> list:
    """Per measured m < RECON_MIN_M: the label whose time over every shape has the best geometric mean ratio
    to the default (only labels timed on every shape), if it gains GAIN and loses no more than WORST anywhere;
    else the default entry. Returns [[largest m, entry, note], ...] with the old rows beyond the largest m."""
    rows = [r for r in result["rows"] if "time_us" in r]
    shapes = [tuple(s) for s in result["shapes"]]
    table = []
    for m in sorted({r["m"] for r in rows if r["m"] < g.RECON_MIN_M}):
        base = {(r["k"], r["n"]): r for r in rows if r["m"] == m and r["default"]}
        if len(base) < len(shapes):
            continue
        by_label: dict[str, dict] = {}
        for r in rows:
            if r["m"] == m:
                for label in [r["label"]] + r.get("aliases", []):  # an alias was timed as the row it equals
                    by_label.setdefault(label, {})[(r["k"], r["n"])] = r
        best, best_score = "default", 1.0
        for label, per_shape in by_label.items():
            if len(per_shape) < len(shapes) or label == "default":
                continue
            ratios = [per_shape[s]["time_us"] / base[s]["time_us"] for s in shapes]
            score = math.exp(sum(map(math.log, ratios)) / len(ratios))
            if score <= GAIN and max(ratios) <= WORST and score < best_score:
                best, best_score = label, score
        chosen = by_label[best]
        entry = base[shapes[0]]["entry"] if best == "default" else result["candidates"][str(m)][best]
        note = " ".join(f"({s[0]},{s[1]}) {chosen[s]['time_us']:.1f} us" for s in shapes)
        note = f"{best}: x{best_score:.3f} of the default (geo. mean); {note}"
        table.append([m, entry, note])
    largest = table[-1][0] if table else 0
    for bound, entry in result.get("default_table", []):
        if bound > largest:
            table.append([bound, entry, "unchanged (not swept)"])
            largest = bound
    merged: list = []
    for m, entry, note in table:  # consecutive buckets with one entry: one row, the larger bound
        if merged and merged[-1][1] == entry:
            merged[-1] = [m, entry, merged[-1][2] + f" | up to m={m}: " + note]
        else:
            merged.append([m, entry, f"m={m}: " + note])
    return merged


def _entry_src(entry: dict) -> str:
    return "dict(" + ", ".join(f"{k}={v!r}" for k, v in entry.items()) + ")"


def table_source(table: list) -> str:
    """SMALL_M_TABLE as Python source, to paste into exl3tool/kernels/gemm/tuning.py."""
    lines = ["SMALL_M_TABLE: tuple[tuple[int, dict], ...] = ("]
    for bound, entry, note in table:
        b = "RECON_MIN_M - 1" if bound == g.RECON_MIN_M - 1 else str(bound)
        lines.append(f"    # {note}")
        lines.append(f"    ({b}, {_entry_src(entry)}),")
    lines.append(")")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results (rows, per-point summary, suggested table) here")
    ap.add_argument("--print-table", metavar="JSON", help="print SMALL_M_TABLE from a sweep's JSON and exit")
    ap.add_argument("--tiny", action="store_true", help="small shapes (a TRITON_INTERPRET=1 smoke test)")
    ap.add_argument("--ms", help="comma list of m (default 2,4,8,16,32,1,128)")
    ap.add_argument("--reps", type=int, default=6, help="timed calls per config and round (default 6)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5: 30 samples per config)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop timing new points after this (default 150)")
    ap.add_argument("--compile-deadline-s", type=float, default=90.0, help="stop the parallel precompile after this")
    ap.add_argument("--no-precompile", action="store_true")
    args = ap.parse_args()
    if args.print_table:
        result = json.loads(Path(args.print_table).read_text())
        print(table_source(suggest_table(result)))
        return
    result = run(args)
    print("\nSuggested SMALL_M_TABLE (exl3tool/kernels/gemm/tuning.py; also: --print-table on the JSON):")
    print(table_source(result["table"]))
    print(f"\ndone in {result['seconds']} s")


if __name__ == "__main__":
    main()
