"""What `exl3tool cache check` costs on a warm cache of a GLM-5.3-Flash-sized plan at TP 2 (452 look-ups, issue 19).

    python benchmarks/bench_check.py --json benchmarks/results/bench_check_cpu.json

The checkpoint is the GLM-5.3-Flash geometry with the routed-experts-only scope (``tests/checkpoint``'s
``write_glm53`` and ``glm53_flash_text``), written header-only: a check reads only headers. Its plan under the overlay
with shared experts is 452 look-ups at TP 2 (README sizing). Every look-up's entry is synthesised as a warm writes it
(the real header with ``cache_key``, ``proxy_error``, ``exl3tool_sha256``; real ``suh``/``svh``; the trellis a hole
of a sparse file, about 2 GB apparent), and the warm's provenance record is written beside them. Then:

* ``check_all_hit``: ``check()`` in this process (plan, 452 look-ups with the server's checks, records), median of 5;
* ``check_cli_all_hit``: ``exl3tool cache check ... --json`` as a fresh process, wall and CPU seconds (includes
  starting Python and torch: ``cli_startup``, ``exl3tool --version``, is that part alone; ``check_cli_reported_s`` is
  the check's own ``seconds`` in its JSON);
* ``check_all_miss``: a shard's mtime moved: every look-up misses, the cache is indexed (452 headers) and each cause
  explained from the record (median of 5);
* ``peak_rss_mib``: this process's peak RSS after the in-process checks, and the CLI child's.

The page cache is warm (the entries were just written). Figures depend on the machine; the bound is 2 s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "checkpoint"))

from test_family_plans import glm53_flash_text  # noqa: E402
from tiny_models import write_glm53  # noqa: E402

from exl3tool.cache.records import RecordEntry, new_record, write_record  # noqa: E402
from exl3tool.plan import ServerRequest, prepare  # noqa: E402
from exl3tool.operations.check import check  # noqa: E402
from exl3tool.operations.warm.provenance import plan_settings  # noqa: E402

OVERLAY = '{"linear": {"weight": "mxfp8"}, "shared_experts": "mxfp8"}'
ENC = dict(encoder_root="/opt/exllamav3", encoder_revision="v0.0.18")
_ZERO = bytes(1 << 20)


def _sha_line(name: str, dtype: str, shape: list[int]) -> bytes:
    return f"{name}:{dtype}:{shape}\n".encode()


def write_sparse_entry(path: Path, key, bits: int) -> None:
    """An entry as exl3tool writes it, with a zero trellis left as a hole (``exl3tool_sha256`` computed for it)."""
    k, n = key.input_size, key.output_size
    suh = (torch.rand(k) + 0.5).half().numpy().tobytes()
    svh = (torch.rand(n) + 0.5).half().numpy().tobytes()
    tshape = [k // 16, n // 16, 16 * bits]
    tbytes = tshape[0] * tshape[1] * tshape[2] * 2
    h = hashlib.sha256()
    h.update(_sha_line("suh", "float16", [k]) + suh + _sha_line("svh", "float16", [n]) + svh)
    h.update(_sha_line("trellis", "int16", tshape))
    left = tbytes
    while left:
        h.update(_ZERO[:min(left, len(_ZERO))])
        left -= min(left, len(_ZERO))
    header = {"__metadata__": {"cache_key": key.canonical_json(), "proxy_error": "0.01", "exl3tool_version": "bench",
                               "exl3tool_sha256": h.hexdigest()},
              "suh": {"dtype": "F16", "shape": [k], "data_offsets": [0, 2 * k]},
              "svh": {"dtype": "F16", "shape": [n], "data_offsets": [2 * k, 2 * k + 2 * n]},
              "trellis": {"dtype": "I16", "shape": tshape, "data_offsets": [2 * k + 2 * n, 2 * k + 2 * n + tbytes]}}
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw + suh + svh)
        fh.truncate(8 + len(raw) + 2 * k + 2 * n + tbytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-check-") as tmp:
        base = Path(tmp)
        model = write_glm53(base / "glm53-flash", scope=True, text=glm53_flash_text(), header_only=True, shards=4)
        request = ServerRequest(model=str(model), tp_sizes=(2,), cache_dir=str(base / "cache"),
                              quantization_config=OVERLAY, **ENC)
        t = time.perf_counter()
        checkpoint, plan, _ = prepare(request, check_hits=False)
        jobs = [j for j in plan.jobs if j.state != "skipped"]
        for j in jobs:
            write_sparse_entry(j.path, j.key, plan.bits)
        ids = plan.identities
        record = new_record(command="cache warm", model_name=str(model), model_identity=ids.model.identity,
                            model_payload=ids.model.payload, encoder_identity=ids.encoder.identity,
                            encoder_payload=ids.encoder.payload, settings=plan_settings(plan, None, checkpoint.dtype),
                            entries=[RecordEntry(
                                j.digest, j.prefix, j.tp_size, j.tp_rank, "written") for j in jobs])
        write_record(request.cache_dir, record)
        setup = time.perf_counter() - t
        apparent = sum(j.path.stat().st_size for j in jobs)

        def timed(fn):
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                out = fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times), min(times), out

        hit_s, hit_min, report = timed(lambda: check(request))
        assert report.ok and len(report.lookups) == 452, (report.plan.count("hit"), len(report.lookups))
        cli = [sys.executable, "-m", "exl3tool", "cache", "check", str(model), "--tp-size", "2", "--cache-dir",
               request.cache_dir, "--quantization-config", OVERLAY, "--encoder-root", ENC["encoder_root"],
               "--encoder-revision", ENC["encoder_revision"], "--json"]
        env = dict(os.environ, PYTHONPATH=str(REPO))

        def child(argv):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            return out, time.perf_counter() - t0, cpu

        _, start_s, start_cpu = child([sys.executable, "-m", "exl3tool", "--version"])  # Python, torch, the CLI
        r, cli_s, cli_cpu = child(cli)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        shard = sorted(model.glob("*.safetensors"))[0]
        st = shard.stat()
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 3_000_000_000))
        miss_s, miss_min, missed = timed(lambda: check(request))
        assert missed.plan.count("miss") == 452 and missed.causes and "mtime" in missed.causes[0].findings[0].text
        child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        results = {
            "model": "GLM-5.3-Flash geometry (scope, header-only), TP 2, overlay with shared experts",
            "lookups": len(report.lookups), "entries_apparent_bytes": apparent, "setup_s": round(setup, 2),
            "check_all_hit_s": round(hit_s, 3), "check_all_hit_min_s": round(hit_min, 3),
            "check_cli_all_hit_s": round(cli_s, 3), "check_cli_all_hit_cpu_s": round(cli_cpu, 3),
            "check_cli_reported_s": doc["seconds"], "cli_startup_s": round(start_s, 3),
            "cli_startup_cpu_s": round(start_cpu, 3),
            "check_all_miss_s": round(miss_s, 3), "check_all_miss_min_s": round(miss_min, 3),
            "miss_causes": len(missed.causes),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "cli_peak_rss_mib": round(child_rss, 1),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "bound_s": 2.0,
        }
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
