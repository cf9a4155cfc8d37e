"""Benchmark of the trellis GEMM against torch fp16 matmul on the materialised weight (one GPU).

run() checks correctness first (relative error vs x @ W in float64, W de-rotated in float64; bound 5e-4 for
every config, reported in the rows), then times each case with CUDA events (warm-up, median of repeats, L2
flushed before every call by writing a 256 MB buffer, and a spin kernel after the flush so that the host's
launch work is off the clock: GPU time). Columns: time, the path taken (fused kernel or reconstruct + cuBLAS),
time ratio to torch fp16 matmul (exl3tool / fp16: the issue's targets are <= 1.15 at m >= 512), TFLOP/s,
and for the default config also the eager call time (no spin: host launch cost included when it is the
longer). With EXL3_BENCH_SWEEP=1 every candidate config is timed and the best one reported (the sweep rows go
to the JSON too); EXL3_BENCH_MS overrides the batch sizes (comma list).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exl3tool.format.decode import reconstruct  # noqa: E402
from exl3tool.format.hadamard import hadamard_128  # noqa: E402
from exl3tool.kernels.gemm import (FOLD_BOTH, FOLD_BOTH16, FOLD_IN, FOLD_NONE, FOLD_OUT, GemmConfig,  # noqa: E402
                                   ReconConfig, choose_config, trellis_matmul)

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
MS = [1, 4, 16, 64, 512, 4096]
ERR_BOUND = 5e-4  # relative to float64, the bound
# exllamav3 1.6.5's own kernels on an H200, from issue 13 (another run: compare ratios to its fp16 column too)
REFERENCE_US = {(4096, 4096, 1): (27.3, 17.4), (4096, 4096, 16): (28.5, 17.6), (4096, 4096, 4096): (217.6, 182.7),
                (4096, 14336, 1): (44.2, 38.5), (4096, 14336, 16): (51.7, 39.4), (4096, 14336, 4096): (733.9, 624.6),
                (14336, 4096, 1): (57.7, 42.0), (14336, 4096, 16): (61.8, 40.3), (14336, 4096, 4096): (723.6, 613.7)}
BITS = 6
CODEBOOK = "mcg"


def _flush_buffer() -> torch.Tensor:
    return torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda")  # 256 MB


SPIN_CYCLES = 1_000_000  # ~0.5 ms at 1.98 GHz: longer than any host-side launch path measured here


def time_cuda(fn, flush: torch.Tensor, warmup: int = 3, reps: int = 20, host: bool = False) -> float:
    """Median seconds of fn() on the GPU with a cold L2 (flush written before every call).

    By default the GPU is kept busy by a spin kernel between the flush and the start event, so that fn's
    launches (Python, Triton's launcher) are already queued when the start event fires: the time is the
    GPU's, from the first kernel of fn to the end of its last. ``host=True`` drops the spin: the time then
    includes the host-side launch cost whenever it exceeds the GPU time (what an eager caller sees).
    """
    for _ in range(warmup):
        fn()
    return statistics.median(cuda_samples(fn, flush, reps, host))


def cuda_samples(fn, flush: torch.Tensor, reps: int, host: bool = False) -> list[float]:
    """``time_cuda``'s seconds of each of ``reps`` calls (no warm-up): the flush, the spin unless ``host``, then
    fn between two events."""
    times = []
    for _ in range(reps):
        flush.fill_(reps)
        if not host:
            torch.cuda._sleep(SPIN_CYCLES)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    return times


def _weight_fp64(tr: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """W = diag(suh) B_k Q B_n diag(svh) in float64 (the torch baseline then uses it rounded to fp16)."""
    q = reconstruct(tr, BITS, CODEBOOK).double()
    hn = hadamard_128(torch.float64, q.device) / 128 ** 0.5
    k, n = q.shape
    w = (hn @ q.reshape(k // 128, 128, n)).reshape(k, n)
    w = (w.reshape(k, n // 128, 128) @ hn).reshape(k, n)
    return suh.double()[:, None] * w * svh.double()[None, :]


def path_of(cfg) -> str:
    """Short name of the path a config takes."""
    if isinstance(cfg, ReconConfig):
        return "recon/" + {FOLD_NONE: "q", FOLD_OUT: "out", FOLD_IN: "in", FOLD_BOTH: "w", FOLD_BOTH16: "w16"}[cfg.fold]
    return "fused" + ("/t" if cfg.trans else "") + ("/l2" if cfg.l2_prefetch else "") + ("/fma" if cfg.fma else "")


def _as_dict(cfg) -> dict:
    return dict(cfg.__dict__, kind=type(cfg).__name__)


def _from_dict(d: dict):
    d = dict(d)
    kind = d.pop("kind", "GemmConfig")
    return ReconConfig(**d) if kind == "ReconConfig" else GemmConfig(**d)


def candidates(m: int, k: int, n: int) -> list:
    """Configs swept per regime, the heuristic's pick first."""
    dev = torch.device("cuda")
    base = choose_config(m, k, n, dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    nb, ch = n // 128, k // 128
    out = [base]
    if m < 128:
        bm = 16 if m <= 16 else 64
        mb = -(-m // bm)
        for mult in ((1, 2, 4, 8) if m <= 16 else (1, 2, 4)):
            split = max(1, min(ch, -(-mult * sms // (nb * mb))))
            for bk, w, pf, tr, l2 in ((32, 4, False, False, False), (32, 4, False, False, True),
                                      (64, 4, False, False, True), (32, 4, False, True, True),
                                      (32, 4, True, False, True)):
                out.append(GemmConfig(bm=bm, bk=bk, split=split, fuse_in=False, num_warps=w, num_stages=1, asm=2,
                                      prefetch=pf, trans=tr, l2_prefetch=l2))
    if m == 1:
        for mult in (4, 8, 16):
            split = max(1, min(ch, -(-mult * sms // nb)))
            for bk, w, l2 in ((32, 4, False), (32, 4, True), (64, 4, True)):
                out.append(GemmConfig(bm=16, bk=bk, split=split, fuse_in=False, num_warps=w, num_stages=1, asm=2,
                                      prefetch=False, l2_prefetch=l2, fma=True))
    if m <= 16:  # balanced split-K: every split gets the same number of 128-row chunks (c per split)
        for split in sorted({-(-ch // c) for c in range(1, 9)}):
            if m == 1:
                out.append(GemmConfig(bm=16, bk=32, split=split, fuse_in=False, num_warps=4, num_stages=1, asm=2,
                                      prefetch=False, l2_prefetch=True, fma=True))
            for l2 in (False, True):
                out.append(GemmConfig(bm=16, bk=32, split=split, fuse_in=False, num_warps=4, num_stages=1, asm=2,
                                      prefetch=False, l2_prefetch=l2))
    if m >= 64:
        out.append(ReconConfig(fold=FOLD_NONE, br=32, num_warps=4, asm=2))
        out.append(ReconConfig(fold=FOLD_NONE, br=64, num_warps=4, asm=2))
    if m >= 512:
        for fold in (FOLD_OUT, FOLD_IN, FOLD_BOTH, FOLD_BOTH16):
            for br, w in ((64, 4), (128, 8), (64, 8)):
                out.append(ReconConfig(fold=fold, br=br, num_warps=w, asm=2))
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def _warm_one(job: tuple) -> str:
    """Worker: compile one (shape, m, config) by calling it once on random data (fills Triton's disk cache)."""
    k, n, m, cfg = job
    try:
        tr = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * BITS), dtype=torch.int16, device="cuda")
        suh = torch.randn(k, device="cuda").half()
        svh = torch.randn(n, device="cuda").half()
        x = torch.randn(m, k, device="cuda").half()
        trellis_matmul(x, tr, suh, svh, bits=BITS, codebook=CODEBOOK, config=_from_dict(cfg))
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def precompile(jobs: list[tuple], workers: int = 12) -> None:
    """Compile every config in parallel processes first: the timed loop then only loads cached binaries."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        res = pool.map(_warm_one, jobs, chunksize=1)
    bad = [(j, r) for j, r in zip(jobs, res) if r != "ok"]
    print(f"precompiled {len(jobs)} configs, {len(bad)} failed", flush=True)
    for j, r in bad[:20]:
        print("  compile failure", j, r, flush=True)


def run(sweep: bool | None = None) -> list[dict]:
    """All shapes x m; returns one row per (shape, m) (plus sweep rows when sweeping)."""
    if sweep is None:
        sweep = os.environ.get("EXL3_BENCH_SWEEP", "0") == "1"
    ms = [int(v) for v in os.environ.get("EXL3_BENCH_MS", ",".join(map(str, MS))).split(",")]
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    if sweep:
        jobs, seen = [], set()
        for k, n in SHAPES:
            for m in ms:
                for c in candidates(m, k, n):
                    key = (c, m) if isinstance(c, ReconConfig) else (c, m, k, n)  # recon: same binaries per shape
                    if key not in seen:
                        seen.add(key)
                        jobs.append((k, n, m, _as_dict(c)))
        precompile(jobs)
    flush = _flush_buffer()
    rows: list[dict] = []
    for k, n in SHAPES:
        tr = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * BITS), dtype=torch.int16, device="cuda")
        suh = (torch.randn(k, device="cuda") * 0.05).half()
        svh = (torch.randn(n, device="cuda").abs() + 0.5).half()
        w64 = _weight_fp64(tr, suh, svh)
        w16 = w64.half()
        tbytes = tr.numel() * 2
        for m in ms:
            x = torch.randn(m, k, device="cuda").half()
            ref = x.double() @ w64
            t_ref = time_cuda(lambda: torch.matmul(x, w16), flush)
            err16 = float((torch.matmul(x, w16).double() - ref).norm() / ref.norm())
            default = choose_config(m, k, n, torch.device("cuda"))
            cfgs = candidates(m, k, n) if sweep else [default]
            best = None
            for cfg in cfgs:
                rec = dict(k=k, n=n, m=m, path=path_of(cfg), config=_as_dict(cfg), default=cfg == default,
                           torch_fp16_us=t_ref * 1e6, torch_fp16_rel_err=err16)
                try:
                    y = trellis_matmul(x, tr, suh, svh, bits=BITS, codebook=CODEBOOK, config=cfg)
                    torch.cuda.synchronize()
                    err = float((y.double() - ref).norm() / ref.norm())
                    rec["rel_err"] = err
                    if not err < ERR_BOUND:
                        rec["error"] = f"rel_err {err:.3e} over {ERR_BOUND}"
                    else:
                        t = time_cuda(lambda: trellis_matmul(x, tr, suh, svh, bits=BITS, codebook=CODEBOOK,
                                                             config=cfg), flush)
                        rec.update(time_us=t * 1e6, gbps=tbytes / t / 1e9, tflops=2 * m * k * n / t / 1e12,
                                   ratio=t / t_ref)
                        if (k, n, m) in REFERENCE_US:
                            r_us, r16 = REFERENCE_US[(k, n, m)]
                            rec.update(reference_us=r_us, reference_fp16_us=r16,
                                       reference_ratio=r_us / r16)
                        if cfg == default:  # also what an eager Python caller waits
                            rec["call_us"] = 1e6 * time_cuda(lambda: trellis_matmul(
                                x, tr, suh, svh, bits=BITS, codebook=CODEBOOK, config=cfg), flush, host=True)
                            rec["torch_fp16_call_us"] = 1e6 * time_cuda(lambda: torch.matmul(x, w16), flush, host=True)
                except Exception as exc:  # a config that fails to compile is reported, not fatal
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                if sweep:
                    rows.append(dict(rec, kind="sweep"))
                    print("  sweep", json.dumps(rec), flush=True)
                if "time_us" in rec and (best is None or rec["time_us"] < best["time_us"]):
                    best = rec
                if cfg == default:
                    rows.append(dict(rec, kind="default"))
            if sweep and best is not None:
                rows.append(dict(best, kind="best"))

    return rows


def _fmt(r: dict) -> str:
    head = f"({r['k']:>5},{r['n']:>5}) m={r['m']:>4}"
    if "time_us" not in r:
        return f"{head}  {r.get('path', '?'):10} ERROR {r.get('error')}"
    c = dict(r["config"])
    c.pop("kind", None)
    ref = ""
    if "reference_us" in r:
        ref = (f" | ref. {r['reference_us']:6.1f} us (x{r['reference_ratio']:.2f} of its fp16): "
               f"{r['reference_us'] / r['time_us']:.2f}x its speed")
    return (f"{head}  {r['path']:10} {r['time_us']:8.1f} us  fp16 {r['torch_fp16_us']:8.1f} us  "
            f"x{r['ratio']:.3f}  {r['tflops']:6.1f} TF/s  err {r['rel_err']:.1e} (fp16 {r['torch_fp16_rel_err']:.1e})"
            + ref + f"  {c}")


def table(rows: list[dict], kind: str = "default") -> str:
    """The summary table (time ratio exl3tool / fp16 per shape and m) of one run."""
    sel = [r for r in rows if r.get("kind") == kind]
    ms = sorted({r["m"] for r in sel})
    lines = ["(in, out)       " + "".join(f"{'m=' + str(m):>18}" for m in ms)]
    for k, n in SHAPES:
        cells = []
        for m in ms:
            r = next((r for r in sel if (r["k"], r["n"], r["m"]) == (k, n, m)), None)
            cell = "ERROR" if r is None or "ratio" not in r else f"{r['ratio']:.3f} {r['path']}"
            cells.append(f"{cell:>18}")
        lines.append(f"({k:>5},{n:>5})   " + "".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    rows = run()
    for r in rows:
        if r["kind"] in ("default", "best"):
            print(r["kind"], _fmt(r))
    print("\nTime ratio exl3tool / torch fp16 (default configs):")
    print(table(rows))
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_gemm.json").write_text(json.dumps(rows, indent=1))
