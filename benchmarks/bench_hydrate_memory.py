"""Host memory of `exl3tool hydrate` against the number of modules: synthetic Llama checkpoints of 1x, 4x and 16x
the layers (7 modules a layer), each hydrated in a fresh process; peak resident memory of the run.

Each child plans the hydrate, resets the resident high-water mark (VmHWM through ``/proc/self/clear_refs``, as
``host_peak.py`` does), runs ``hydrate`` with a stand-in encoder (random trellis of the real shape and dtype, a few
milliseconds a module: the encode's own memory is one module's, measured by ``bench_encode_memory.py``) and reports
VmHWM: the peak of the run, the resident size before it included. ``--code DIR`` runs the same children against
another checkout of the package (e.g. the code before results streamed to disk: ``git archive 80549c3 | tar -x -C
/tmp/base``), beside this one. Prints a table; ``--json`` writes it.

    python benchmarks/bench_hydrate_memory.py --code before=/tmp/base --json benchmarks/results/bench_hydrate_memory_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPE = dict(hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=4096, vocab=256)  # 11.5 MiB of EXL3 a layer


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(src: str, out: str) -> None:
    """In a fresh process: plan, reset VmHWM, hydrate with the stand-in encoder; print the figures as JSON."""
    import torch

    from exl3tool.format.encoded import EncodedLinear
    from exl3tool.operations.hydrate import hydrate, plan_hydrate
    from exl3tool.plan import ServerRequest

    def encode(weight, bits, seed, device):
        k, n = weight.shape
        g = torch.Generator().manual_seed(seed)
        trellis = torch.randint(-32768, 32767, (k // 16, n // 16, 16 * bits), generator=g, dtype=torch.int16)
        return EncodedLinear(trellis, torch.ones(k, dtype=torch.half), torch.ones(n, dtype=torch.half), 0.1, 1.0, bits)

    plan = plan_hydrate(ServerRequest(model=src, device="cpu"), out)
    encode(torch.zeros(128, 128), plan.bits, 0, "cpu")  # torch's first-use allocations before the baseline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS:")
    start = time.perf_counter()
    report = hydrate(plan, device="cpu", encode=encode)
    print(json.dumps({"modules": len(plan.modules), "exl3_bytes": sum(m.exl3_bytes for m in plan.modules),
                      "rss_before": before, "peak": _status("VmHWM:"), "seconds": time.perf_counter() - start,
                      "bytes_after": report.bytes_after}))


def measure(code: Path, src: Path, out: Path) -> dict:
    if out.exists():
        shutil.rmtree(out)
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, __file__, "--child", str(src), str(out)], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the child failed ({code}):\n{done.stderr[-3000:]}")
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    digest = subprocess.run(["sh", "-c", f"cd {out} && sha256sum $(ls) | sha256sum"], capture_output=True, text=True)
    doc["out_sha256"] = digest.stdout.split()[0]
    shutil.rmtree(out)
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", default="1,4,16", help="layers of each checkpoint, times --layers (default 1,4,16)")
    ap.add_argument("--layers", type=int, default=1, help="layers of the 1x checkpoint (7 modules each)")
    ap.add_argument("--code", action="append", default=[], metavar="[LABEL=]DIR",
                    help="another checkout of the package to measure beside this one")
    ap.add_argument("--work", default=None, help="where the checkpoints are written (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="write the table here")
    ap.add_argument("--child", nargs=2, metavar=("SRC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    sys.path.insert(0, str(REPO))
    from exl3tool.checkpoint.synthetic import write_llama_checkpoint

    codes = [("this", REPO)] + [(c.partition("=")[0] if "=" in c else c, Path(c.partition("=")[2] or c).resolve())
                                for c in args.code]
    rows = []
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        for scale in (int(s) for s in args.scales.split(",")):
            layers = scale * args.layers
            src = write_llama_checkpoint(Path(work) / f"src{scale}", **SHAPE, layers=layers, shards=max(1, layers // 2),
                                         seed=scale)
            size = sum(p.stat().st_size for p in src.iterdir())
            for name, code in codes:
                doc = measure(code, src, Path(work) / "out")
                rows.append({"scale": scale, "layers": layers, "source_bytes": size, "code": name, **doc})
                r = rows[-1]
                print(f"{scale:>3}x {r['modules']:>4} modules  SOURCE {size / 2**20:8.1f} MiB  EXL3 "
                      f"{r['exl3_bytes'] / 2**20:7.1f} MiB  peak {r['peak'] / 2**20:7.1f} MiB (+"
                      f"{(r['peak'] - r['rss_before']) / 2**20:6.1f} above the start)  {r['seconds']:6.2f} s  {name}",
                      flush=True)
            shutil.rmtree(src)
    same = {r["scale"]: {x["out_sha256"] for x in rows if x["scale"] == r["scale"]} for r in rows}
    print("OUT's bytes the same for every code:", all(len(v) == 1 for v in same.values()))
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": SHAPE, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
