"""Bundle benchmark: size and time of `cache export` and `cache import` for about 1 GB of real-size entries.

    python benchmarks/bench_bundle.py --json benchmarks/results/bench_bundle_cpu.json

The entries are synthesised, not encoded (a CPU encode of 1 GB of trellis takes hours): random int16 trellis and
finite fp16 suh/svh of Llama-3.1-8B's rank-local shapes (qkv 4096x6144, o 4096x4096, gate_up 4096x28672,
down 14336x4096 at K=6), published through CacheStore like a warm's. Export and import only read, hash, check
and copy bytes, which do not depend on the values, so the figures hold for encoded entries of the same sizes.

Timed, each as the CLI runs it (a fresh process, so torch's import is included): export to a file; import of
that file into an empty cache; the same import again (every entry present); export piped into import
(`exl3tool cache export - | exl3tool cache import -`). Files are in the page cache (the machine's other users
rule out dropping it): the figures are CPU-bound costs, not disk reads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from exl3tool.cache import CacheKey, CacheStore
from exl3tool.format.encoded import EncodedLinear

SHAPES = {  # Llama-3.1-8B, TP 1: (prefix, K, N)
    "self_attn.qkv_proj": (4096, 6144),
    "self_attn.o_proj": (4096, 4096),
    "mlp.gate_up_proj": (4096, 28672),
    "mlp.down_proj": (14336, 4096),
}
MODEL_ID = "b" * 64
ENCODER_ID = "e" * 64


def synthesise(root: Path, target_bytes: int, bits: int = 6) -> tuple[int, int]:
    """Publish whole layers of entries until ``target_bytes``; returns (entries, bytes)."""
    store = CacheStore(root)
    g = torch.Generator().manual_seed(0)
    n = total = layer = 0
    while total < target_bytes:
        for name, (k, nn) in SHAPES.items():
            key = CacheKey.for_layer(MODEL_ID, ENCODER_ID, f"model.layers.{layer}.{name}", bits, 1, 0, k, nn)
            trellis = torch.randint(-32768, 32767, (k // 16, nn // 16, 16 * bits), generator=g, dtype=torch.int16)
            enc = EncodedLinear(trellis, (torch.rand(k, generator=g) * 2 - 1).half(),
                                (torch.rand(nn, generator=g) * 2 - 1).half(), 0.01, 1.0, bits)
            total += store.publish(key, enc).stat().st_size
            n += 1
        layer += 1
    return n, total


def timed(cmd: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True)
    took = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{cmd} failed ({r.returncode}): {r.stderr}")
    return took, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0, help="entries to synthesise, in GB (whole layers)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="exl3tool-bundle-"))
    exe = f"{sys.executable} -m exl3tool"
    try:
        t0 = time.perf_counter()
        entries, entry_bytes = synthesise(work / "ci", int(args.gb * 1e9))
        t_synth = time.perf_counter() - t0
        bundle = work / "exl3-bundle.tar"
        t_export, _ = timed(f"{exe} cache export {bundle} --cache-dir {work / 'ci'} --quiet")
        t_import, out = timed(f"{exe} cache import {bundle} --cache-dir {work / 'node'} --json")
        imported = json.loads(out)
        t_again, out = timed(f"{exe} cache import {bundle} --cache-dir {work / 'node'} --json")
        again = json.loads(out)
        t_pipe, out = timed(f"{exe} cache export - --cache-dir {work / 'ci'} --quiet | "
                            f"{exe} cache import - --cache-dir {work / 'piped'} --json")
        piped = json.loads(out)
        t_noop, _ = timed(f"{exe} --version")
        assert imported["imported"] == piped["imported"] == again["present"] == entries
        size = bundle.stat().st_size
        result = {
            "what": "cache export / import of synthesised Llama-3.1-8B-shaped K=6 entries (TP 1)",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
            "entries": entries, "entry_bytes": entry_bytes, "bundle_bytes": size,
            "bundle_overhead_bytes": size - entry_bytes,
            "synthesise_s": round(t_synth, 2),
            "export_s": round(t_export, 2), "import_s": round(t_import, 2), "reimport_all_present_s": round(t_again, 2),
            "export_pipe_import_s": round(t_pipe, 2), "process_start_s": round(t_noop, 2),
            "export_mb_per_s": round(entry_bytes / 1e6 / t_export, 1),
            "import_mb_per_s": round(entry_bytes / 1e6 / t_import, 1),
            "commands": [
                "exl3tool cache export BUNDLE --cache-dir CI",
                "exl3tool cache import BUNDLE --cache-dir NODE --json",
                "exl3tool cache import BUNDLE --cache-dir NODE --json  (again: all present)",
                "exl3tool cache export - --cache-dir CI | exl3tool cache import - --cache-dir PIPED --json",
            ],
        }
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
