"""MiniLM worked example: warm every dense encoder layer of all-MiniLM-L6-v2, verify it, and compare the
model's sentence embeddings with the original's (36 sentences; mean and minimum cosine similarity).

    python benchmarks/quality_minilm.py --device cpu            # ~92k tiles: minutes on 2 cores
    python benchmarks/quality_minilm.py --device cuda           # seconds; also runs the trellis GEMM path

Uses the library calls behind `exl3tool cache warm` and `exl3tool verify`; prints one table and, with
--json FILE (or $OUT), writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from exl3tool.operations.verify import verify_plan
from exl3tool.operations.warm import warm
from exl3tool.plan import ServerRequest, prepare, resolve_device
from quality import SENTENCES, embedding_agreement, minilm_model_dir  # benchmarks/quality.py, beside this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--layers", default="encoder.layer.*")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--dtype", default="float32", help="serving dtype the weights are cast to before encoding")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    model = minilm_model_dir()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="minilm-cache-")
    common = dict(model=model, layers=(args.layers,), cache_dir=cache, encoder_root="/encoders/exllamav3",
                  encoder_revision="minilm-example", dtype=args.dtype)
    t0 = time.perf_counter()
    summary = warm(ServerRequest(device=args.device, **common))
    t_warm = time.perf_counter() - t0
    checkpoint, plan, store = prepare(ServerRequest(mode="readonly", **common))
    dev = resolve_device(args.device)
    report = verify_plan(plan, checkpoint, store, rows=(1, 16, 256), device=dev, dtype=getattr(torch, args.dtype))
    replacements = {j.prefix: store.lookup(j.key).tensors for j in plan.jobs}
    deq = embedding_agreement(model, replacements, sentences=SENTENCES)
    result = {
        "layers": len(plan.jobs), "tiles": sum(j.tiles for j in plan.jobs), "warm_s": round(t_warm, 1),
        "device": str(dev), "counts": summary.counts, "verify_ok": report.ok, "verify_gemm": report.gemm,
        "max_kernel_err": max(c.kernel_err for c in report.layers),
        "max_quant_err": max(c.quant_err for c in report.layers),
        "mean_weight_rel_err": sum(c.weight_rel_err for c in report.layers) / len(report.layers),
        "sentences": deq.sentences, "dequantize": {"mean_cos": deq.mean_cosine, "min_cos": deq.min_cosine},
    }
    if dev.type == "cuda":
        gemm = embedding_agreement(model, replacements, sentences=SENTENCES, use_gemm=True, device="cuda")
        result["trellis_matmul"] = {"mean_cos": gemm.mean_cosine, "min_cos": gemm.min_cosine}
    print(json.dumps(result, indent=2))
    print(f"\n{result['layers']} layers ({result['tiles']} tiles) warmed in {t_warm:.1f} s on {dev}; verify "
          f"{'PASS' if report.ok else 'FAIL'} ({report.gemm}); max kernel err {result['max_kernel_err']:.2e}, "
          f"max quant err {result['max_quant_err']:.4f}")
    for path in ("dequantize", "trellis_matmul"):
        if path in result:
            print(f"embeddings via {path:15s}: mean cosine {result[path]['mean_cos']:.6f}, "
                  f"min {result[path]['min_cos']:.6f} over {deq.sentences} sentences")
    out = args.json_path or (os.path.join(os.environ["OUT"], "quality_minilm.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
