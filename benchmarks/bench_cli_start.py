"""Wall time of `exl3tool --help` / `--version` (a fresh interpreter each run), against a command's own help.

The root lists its commands without importing them (issue 37's bound: under 0.5 s); `cache --help` imports the
command modules and, through the cache library, torch: the cost every real command pays once.

    python benchmarks/bench_cli_start.py [--runs 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = {"--help": ["--help"], "--version": ["--version"], "cache --help": ["cache", "--help"]}


def time_once(argv: list[str]) -> float:
    """Seconds from start to exit of ``python -m exl3tool ARGV`` (output discarded)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "exl3tool", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=env, cwd=REPO, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per case, after one warm-up")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    results = {}
    for name, argv in CASES.items():
        time_once(argv)  # warm the page cache and the bytecode cache
        runs = sorted(time_once(argv) for _ in range(args.runs))
        results[name] = {"median_s": round(statistics.median(runs), 3), "min_s": round(runs[0], 3),
                         "max_s": round(runs[-1], 3), "runs": args.runs}
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for name, r in results.items():
            print(f"exl3tool {name:<13} median {r['median_s']:.3f} s  (min {r['min_s']:.3f}, max {r['max_s']:.3f}, "
                  f"{r['runs']} runs)")


if __name__ == "__main__":
    main()
