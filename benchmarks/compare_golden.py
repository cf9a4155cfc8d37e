"""Compare two golden folders tensor by tensor (a fresh make_golden.py run against the committed full set).

    python benchmarks/compare_golden.py NEW OLD [--json REPORT]

Prints, per file, how many tensors are bit-identical, which differ (max |a - b| and the count of differing
elements), which are only in one side, and the metadata keys whose values differ. Exit 0 when every tensor present
in both is bit-identical and no tensor is missing from either side, else 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

FILES = ("tiles_golden", "reconstruct_k6", "encode_e2e", "gemm_k6")


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def compare_file(new: Path, old: Path) -> dict:
    """One file's comparison: identical names, differing names with their worst difference, one-sided names."""
    a, meta_a = _load(new)
    b, meta_b = _load(old)
    identical, differs = [], {}
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        if x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y):
            identical.append(name)
            continue
        if x.shape != y.shape:
            differs[name] = {"shape_new": list(x.shape), "shape_old": list(y.shape)}
            continue
        d = (x.double() - y.double()).abs()
        differs[name] = {"max_abs": float(d.max()), "n_differ": int((d > 0).sum()), "numel": x.numel(),
                         "dtype_new": str(x.dtype), "dtype_old": str(y.dtype)}
    meta_differs = {k: {"new": meta_a.get(k), "old": meta_b.get(k)}
                    for k in sorted(set(meta_a) | set(meta_b)) if meta_a.get(k) != meta_b.get(k)}
    return {"identical": len(identical), "differs": differs, "only_new": sorted(set(a) - set(b)),
            "only_old": sorted(set(b) - set(a)), "metadata_differs": meta_differs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("new", type=Path)
    ap.add_argument("old", type=Path)
    ap.add_argument("--json", type=Path, help="write the whole report here")
    args = ap.parse_args(argv)
    report, ok = {}, True
    for name in FILES:
        new, old = args.new / f"{name}.safetensors", args.old / f"{name}.safetensors"
        if not new.is_file() or not old.is_file():
            report[name] = {"missing": [str(p) for p in (new, old) if not p.is_file()]}
            ok = False
            print(f"{name}: missing {report[name]['missing']}")
            continue
        r = report[name] = compare_file(new, old)
        ok &= not (r["differs"] or r["only_new"] or r["only_old"])
        print(f"{name}: {r['identical']} identical, {len(r['differs'])} differ, {len(r['only_new'])} only new, "
              f"{len(r['only_old'])} only old, {len(r['metadata_differs'])} metadata keys differ")
        for t, d in list(r["differs"].items())[:20]:
            print(f"    {t}: {d}")
        for k, d in list(r["metadata_differs"].items())[:10]:
            print(f"    meta {k}: new={str(d['new'])[:80]!r} old={str(d['old'])[:80]!r}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print("IDENTICAL" if ok else "DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
