"""Multi-GPU warm scaling: one process on one GPU vs `torchrun --nproc-per-node N` on N GPUs.

    python benchmarks/bench_warm_torchrun.py --nproc 2            # hidden 4096, 14336, 32/8 heads, 4 layers
    python benchmarks/bench_warm_torchrun.py --nproc 2 --cpu --hidden 256 --heads 4 --kv-heads 2 --intermediate 512 --layers 2

Writes a random BF16 Llama-style checkpoint, warms it at the given TP sizes into two fresh cache
directories (first one process, then torchrun), and checks that both caches hold byte-identical entries
and that no job ran twice. Reports wall times, the speed-up, GPU utilisation (nvidia-smi, when present)
and peak host/device memory per process. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 etc.).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*.safetensors")) if p.is_file()}


class GpuSampler:
    """Samples GPU utilisation with nvidia-smi once a second while a run is in progress."""

    def __init__(self) -> None:
        self.samples: list[list[int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.samples.append([int(v) for v in out.split()])
            except Exception:
                pass
            self._stop.wait(1.0)

    def __enter__(self):
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.available:
            self._thread.join()

    def mean(self) -> list[float]:
        if not self.samples:
            return []
        n = max(len(s) for s in self.samples)
        return [round(sum(s[i] for s in self.samples if len(s) > i) / len(self.samples), 1) for i in range(n)]


def _run(cmd: list[str], env: dict) -> tuple[float, dict, list[float]]:
    with GpuSampler() as sampler:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}")
    return wall, json.loads(proc.stdout), sampler.mean()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tp-sizes", default="1,2")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (gloo), e.g. to test the script")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    from exl3tool.checkpoint.synthetic import write_llama_checkpoint

    work = Path(args.workdir or tempfile.mkdtemp(prefix="exl3tool-scale-"))
    t0 = time.perf_counter()
    ckpt = write_llama_checkpoint(work / "model", hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                                  intermediate=args.intermediate, layers=args.layers, dtype=torch.bfloat16, seed=7,
                                  shards=2)
    t_write = time.perf_counter() - t0
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               PYTHONUNBUFFERED="1")
    common = ["cache", "warm", str(ckpt), "--tp-size", args.tp_sizes, "--encoder-root", "/encoders/exllamav3",
              "--encoder-revision", "scaling-bench", "--json", "--quiet"]
    device_one = "cpu" if args.cpu else "cuda:0"
    t_single, single, util_single = _run([sys.executable, "-m", "exl3tool", *common, "--cache-dir",
                                          str(work / "cache-1"), "--device", device_one], env)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
    t_multi, multi, util_multi = _run([*torchrun, "-m", "exl3tool", *common, "--cache-dir", str(work / "cache-n"),
                                       "--device", "cpu" if args.cpu else "auto"], env)

    a, b = _tree_digest(work / "cache-1"), _tree_digest(work / "cache-n")
    identical = a == b and len(a) > 0
    differ = {}
    if not identical:  # say which entries, tensors or metadata differ
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from determinism_check import _diff

        for rel in sorted(set(a) | set(b)):
            if a.get(rel) != b.get(rel):
                differ[rel] = (_diff(work / "cache-1" / rel, work / "cache-n" / rel) if rel in a and rel in b
                               else "missing in one cache")
    jobs = [(e["prefix"], e["tp_size"], e["tp_rank"]) for e in multi["entries"] if e["status"] != "skipped"]
    encoded = [e for e in multi["entries"] if e["status"] == "encoded"]
    no_dupes = len(jobs) == len(set(jobs)) and len(encoded) == single["counts"]["encoded"]
    per_worker = {}
    for e in encoded:
        per_worker[e["worker"]] = per_worker.get(e["worker"], 0) + e["input_size"] * e["output_size"] // 256

    result = {
        "model": {"hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
                  "intermediate": args.intermediate, "layers": args.layers, "dtype": "bfloat16"},
        "tp_sizes": args.tp_sizes, "entries": len(a), "checkpoint_write_s": round(t_write, 1),
        "single_s": round(t_single, 1), "multi_s": round(t_multi, 1), "nproc": args.nproc,
        "speedup": round(t_single / t_multi, 2), "byte_identical": identical, "differing_entries": differ,
        "no_job_twice": no_dupes,
        "tiles_per_worker": per_worker, "gpu_util_single": util_single, "gpu_util_multi": util_multi,
        "worker_stats_single": single.get("worker_stats"), "worker_stats_multi": multi.get("worker_stats"),
    }
    print(json.dumps(result, indent=2))
    print(f"\n{'run':>10} {'wall s':>8} {'speed-up':>9} {'GPU util %':>14}")
    print(f"{'1 proc':>10} {t_single:>8.1f} {1.0:>9.2f} {str(util_single):>14}")
    print(f"{f'{args.nproc} procs':>10} {t_multi:>8.1f} {t_single / t_multi:>9.2f} {str(util_multi):>14}")
    print(f"entries {len(a)}, byte-identical {identical}, no job twice {no_dupes}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_warm_torchrun.json").write_text(json.dumps(result, indent=2))
    if not (identical and no_dupes):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
