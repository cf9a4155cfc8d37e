"""The encoder's speed rules against each other and the reference, on the deployed layers, in one run.

The rules of ``exl3tool.encode.memory`` (which K keep cost rows and how many, which run in place, how a launch
spreads its tiles) change speed and memory only, never a byte. Each rule set here runs ``profile_encode.py`` in its
own process (the rules come from the ``EXL3TOOL_*`` variables, docs/tuning.md) on every distinct layer shape of
``bench_dropin.MODELS`` under the default budget (the reference's memory), and is compared layer by layer with the
reference's seconds that ``bench_dropin.py --reference`` measured in the same run on the same GPU (``--reference-json``;
without it, with the first rule set's seconds):

    python benchmarks/bench_rules.py --reference-json dropin.json \\
        --rules "now:;k6-half:HALF_ROW_BITS=4,6;k4-pointers:COST_ROW_BITS=6" --json rules.json

A rule set is NAME:VAR=VALUE,VAR=VALUE (VAR without the EXL3TOOL_ prefix; a value with commas, a set of K, runs
to the next '='-bearing item). Prints, per layer, each rule set's median seconds and speed-up over the reference,
and per rule set the least speed-up at K = 4 and K = 6 and the total time against the reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))


def parse_rules(text: str) -> list[tuple[str, dict[str, str]]]:
    """'a:X=1,Y=4,6;b:' -> [('a', {'EXL3TOOL_X': '1', 'EXL3TOOL_Y': '4,6'}), ('b', {})]."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, body = item.partition(":")
        env: dict[str, str] = {}
        key = None
        for piece in filter(None, body.split(",")):
            if "=" in piece:
                key, value = piece.split("=", 1)
                env[f"EXL3TOOL_{key.strip()}"] = value.strip()
            elif key is not None:
                env[f"EXL3TOOL_{key.strip()}"] += "," + piece.strip()
            else:
                raise SystemExit(f"rule {name!r}: {piece!r} is not VAR=VALUE")
        out.append((name, env))
    return out


def main() -> None:
    from bench_dropin import MODELS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rules", required=True, help="NAME:VAR=VALUE,...;NAME:... (see above)")
    ap.add_argument("--reference-json", default=None,
                    help="bench_dropin.py --reference output of the same run (default: the first rule set is the baseline)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    layers = [(model, prefix, k, n, MODELS[model][1]) for model in args.models.split(",")
              for prefix, k, n in MODELS[model][2]]
    shapes = list(dict.fromkeys(f"{k}x{n}:{bits}" for _, _, k, n, bits in layers))
    ref = {}
    if args.reference_json:
        for row in json.loads(Path(args.reference_json).read_text())["layers"]:
            if row.get("reference_s"):
                ref[(row["k"], row["n"], row["bits"])] = min(row["reference_s"], ref.get((row["k"], row["n"],
                                                                                          row["bits"]), 1e9))
    results: dict[str, dict[tuple[int, int, int], float]] = {}
    for name, env in parse_rules(args.rules):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "profile.json"
            proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_encode.py"), "--shapes",
                                   ",".join(shapes), "--json", str(out)], env={**os.environ, **env},
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{name}: profile_encode failed\n{proc.stderr[-2000:]}", flush=True)
                continue
            results[name] = {(r["k"], r["n"], r["bits"]): r["seconds"]["total"] for r in json.loads(out.read_text())}
        print(f"rule {name} ({' '.join(f'{k}={v}' for k, v in env.items()) or 'the defaults'}): done", flush=True)
    names = list(results)
    if not ref and names:  # no reference in this run: the first rule set is the baseline
        ref = dict(results[names[0]])
        print(f"no reference seconds: speed-ups are over rule {names[0]!r}")
    print(f"{'layer':52} {'K':>2} {'ref ms':>8} " + " ".join(f"{n[:14]:>14}" for n in names))
    rows = []
    for model, prefix, k, n, bits in layers:
        key = (k, n, bits)
        r = ref.get(key)
        cells = []
        for name in names:
            s = results[name].get(key)
            cells.append(f"{s * 1e3:7.1f} {r / s:5.2f}x" if s and r else (f"{s * 1e3:7.1f}" if s else "-"))
        rows.append({"model": model, "prefix": prefix, "k": k, "n": n, "bits": bits, "reference_s": r,
                     "seconds": {name: results[name].get(key) for name in names}})
        print(f"{model[:12] + ' ' + prefix.split('layers.')[-1]:52} {bits:>2} "
              f"{(r or 0) * 1e3:8.1f} " + " ".join(f"{c:>14}" for c in cells))
    summary = {}
    for name in names:
        sp = {b: [row["reference_s"] / row["seconds"][name] for row in rows if row["bits"] == b and
                  row["reference_s"] and row["seconds"][name]] for b in (4, 6)}
        tot = [(row["reference_s"], row["seconds"][name]) for row in rows if row["reference_s"] and row["seconds"][name]]
        summary[name] = {"min_speedup_k4": min(sp[4], default=None), "min_speedup_k6": min(sp[6], default=None),
                         "total_speedup": sum(a for a, _ in tot) / sum(b for _, b in tot) if tot else None}
        print(f"{name}: least speed-up K=4 {summary[name]['min_speedup_k4'] or 0:.2f}x, K=6 "
              f"{summary[name]['min_speedup_k6'] or 0:.2f}x; all layers {summary[name]['total_speedup'] or 0:.2f}x")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"rules": dict(parse_rules(args.rules)), "layers": rows,
                                                    "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
