"""Stored (hydrate) vs online-encoded (the server) quality of fused layers, per family, against the BF16 weights.

`exl3tool hydrate` encodes a fused layer per source matrix (q_proj, k_proj, v_proj each with its own Hadamard signs
and scale, the seed of its own name: the fork loads stored sources as separate shards), while a server encoding it
online at TP 1 encodes the fused rank-local matrix [q | k | v] as one (one scale, the seed of the fused prefix). An
unfused layer is the same matrix with the same seed either way: the same bytes (tests/operations/test_hydrate.py),
so only fused layers are measured. For each family's tiny checkpoint (`exl3tool synth`, random BF16 weights) and
each kind of fused layer (its first occurrence), at each K: the relative error ||W_q - W||_F / ||W||_F of the decoded
weight against the weight the encoder gets (cast to the serving dtype), and the encoder's proxy error, mean over the
layer's encodes. Real CPU encodes (the numba Viterbi): minutes.

    PYTHONPATH=$PWD python benchmarks/hydrate_quality.py --bits 5,6 --json hydrate_quality.json

``--scaled`` multiplies each source by its own factor first (1, 0.25, 4, ...): sources of unequal magnitude, as
trained q/k/v and gate/up are, where one scale for the fused matrix fits them less well.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen3.5", "deepseek-v3", "glm5.3")
SCALES = (1.0, 0.25, 4.0, 0.5)  # --scaled: source i of a fused layer is multiplied by SCALES[i]


def _rel(deq: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    """(squared error, squared norm) in float64."""
    d, w = deq.double(), w.double()
    return float(((d - w) ** 2).sum()), float((w ** 2).sum())


def measure(family: str, bits: tuple[int, ...], work: Path, scaled: bool = False, seed: int = 0) -> list[dict]:
    """One row per (fused layer kind, K): stored and online relative and proxy errors."""
    from exl3tool.cache import layer_seed
    from exl3tool.checkpoint import encoder_input
    from exl3tool.checkpoint.tiny import TINY_FAMILIES, write_tiny
    from exl3tool.encode import encode_linear
    from exl3tool.format.decode import dequantize
    from exl3tool.operations.hydrate import plan_hydrate
    from exl3tool.plan import ServerRequest

    src = write_tiny(work / family, family, seed=seed)
    plan = plan_hydrate(ServerRequest(model=str(src), tp_sizes=(1,), device="cpu",
                                      quantization_config=TINY_FAMILIES[family].overlay), work / f"{family}-out")
    dtype = getattr(torch, plan.dtype)
    seen: set[str] = set()
    rows = []
    for layer in plan.layers:
        kind = layer.prefix.rsplit(".", 1)[-1]
        if len(layer.modules) < 2 or kind in seen:
            continue
        seen.add(kind)
        weights = []
        for i, m in enumerate(layer.modules):
            w = encoder_input(plan.checkpoint.read(m.source.weight).to(dtype))
            weights.append((w * SCALES[i % len(SCALES)]).to(dtype).float() if scaled else w)
        fused = torch.cat(weights, dim=1)  # the server's rank-local matrix at TP 1: the sources' rows in order
        for k in bits:
            t0 = time.perf_counter()
            err = norm = 0.0
            proxies = []
            for m, w in zip(layer.modules, weights):
                enc = encode_linear(w, bits=k, seed=m.seed, device="cpu", name=m.module)
                e, n = _rel(dequantize(enc), w)
                err, norm = err + e, norm + n
                proxies.append(float(enc.proxy_error))
            enc = encode_linear(fused, bits=k, seed=layer_seed(layer.prefix), device="cpu", name=layer.prefix)
            e, n = _rel(dequantize(enc), fused)
            rows.append({"family": family, "layer": layer.prefix, "shape": [fused.shape[0], fused.shape[1]],
                         "sources": len(layer.modules), "bits": k, "stored_rel_err": (err / norm) ** 0.5,
                         "online_rel_err": (e / n) ** 0.5, "stored_proxy": sum(proxies) / len(proxies),
                         "online_proxy": float(enc.proxy_error), "seconds": round(time.perf_counter() - t0, 1)})
            r = rows[-1]
            print(f"{family:12} {layer.prefix:48} K{k}  stored {r['stored_rel_err']:.5f}  online "
                  f"{r['online_rel_err']:.5f}  (proxy {r['stored_proxy']:.2e} / {r['online_proxy']:.2e}, "
                  f"{r['seconds']} s)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--bits", default="5,6")
    ap.add_argument("--scaled", action="store_true", help="sources of unequal magnitude (see the module docstring)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    bits = tuple(int(b) for b in args.bits.split(","))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            rows += measure(family, bits, Path(tmp), scaled=args.scaled)
    for k in bits:
        mine = [r for r in rows if r["bits"] == k]
        if mine:
            s = sum(r["stored_rel_err"] for r in mine) / len(mine)
            o = sum(r["online_rel_err"] for r in mine) / len(mine)
            print(f"K{k}: mean relative error over {len(mine)} fused layers: stored {s:.5f}, online {o:.5f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"scaled": args.scaled, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
