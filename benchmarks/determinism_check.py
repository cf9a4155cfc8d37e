"""Same inputs, same bytes? Warm one synthetic model into several caches (CPU or GPU, one process or
torchrun) and report, entry by entry, which tensors or metadata differ, and which files differ at all.

    python benchmarks/determinism_check.py --devices cuda:0,cuda:0,cuda:1 --torchrun 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from exl3tool.checkpoint.synthetic import write_llama_checkpoint


def _entries(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*.safetensors")) if not p.name.startswith(".")}


def _diff(a: Path, b: Path) -> dict:
    out = {}
    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        ma, mb = fa.metadata(), fb.metadata()
        for k in sorted(set(ma) | set(mb)):
            if ma.get(k) != mb.get(k):
                out[f"meta:{k}"] = [ma.get(k), mb.get(k)]
        for name in sorted(set(fa.keys()) | set(fb.keys())):
            ta, tb = fa.get_tensor(name), fb.get_tensor(name)
            if ta.shape != tb.shape or not torch.equal(ta.view(-1).view(torch.uint8) if ta.dtype != torch.int16 else ta, tb.view(-1).view(torch.uint8) if tb.dtype != torch.int16 else tb):
                if name == "trellis":
                    out[name] = f"{int((ta != tb).any(-1).sum())} of {ta.shape[0] * ta.shape[1]} tiles differ"
                else:
                    out[name] = f"{int((ta.view(torch.int16) != tb.view(torch.int16)).sum())} of {ta.numel()} values differ"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default="cpu,cpu")
    ap.add_argument("--torchrun", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="exl3tool-det-"))
    ckpt = write_llama_checkpoint(work / "model", hidden=args.hidden, heads=8, kv_heads=2,
                                  intermediate=args.intermediate, layers=1, seed=9)
    base = [sys.executable, "-m", "exl3tool", "cache", "warm", str(ckpt), "--tp-size", "1,2", "--encoder-root",
            "/e", "--encoder-revision", "det", "--quiet"]
    runs = []
    for i, dev in enumerate(args.devices.split(",")):
        cache = work / f"cache-{i}-{dev.replace(':', '')}"
        subprocess.run([*base, "--cache-dir", str(cache), "--device", dev], check=True)
        runs.append(cache)
    if args.torchrun:
        cache = work / "cache-torchrun"
        env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        str(args.torchrun), "-m", "exl3tool", *base[3:], "--cache-dir", str(cache)], check=True, env=env)
        runs.append(cache)
    ref = _entries(runs[0])
    report = {}
    for other in runs[1:]:
        cur = _entries(other)
        diffs = {k: _diff(ref[k], cur[k]) for k in ref if k in cur}
        report[other.name] = {"missing": sorted(set(ref) ^ set(cur)),
                              "differ": {k: v for k, v in diffs.items() if v}, "entries": len(cur),
                              # same tensors and metadata can still be different files (header layout)
                              "bytes_differ": sorted(k for k in ref if k in cur
                                                     and ref[k].read_bytes() != cur[k].read_bytes())}
    print(json.dumps({"reference": runs[0].name, "entries": len(ref), "compare": report}, indent=1))


if __name__ == "__main__":
    main()
