"""Where does an encode stop being reproducible? Stage-by-stage digests of encode_linear, repeated.

For each weight shape, the weight is drawn on the CPU from a fixed seed (so every process sees the same
bytes), then the online encode runs stage by stage: signs, regularize (W', su, sv), the scale-search sample
tiles, the global scale g, the quantized states, the packed trellis. Each stage's sha256 is recorded.
The whole sequence runs twice in this process (second pass in reverse shape order, so any state carried
from one encode to the next shows up), plus a repeated Viterbi call on one large random batch. Run it in
two processes (or on two GPUs) and compare the JSON:

    python benchmarks/determinism_probe.py --device cuda:0 --out a.json
    python benchmarks/determinism_probe.py --device cuda:1 --out b.json
    python benchmarks/determinism_probe.py --compare a.json b.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

SHAPES = [(4096, 14336), (14336, 4096), (4096, 4096), (4096, 1024), (4096, 7168), (7168, 4096), (2048, 4096)]


def _sha(t: torch.Tensor) -> str:
    t = t.detach().to("cpu").contiguous()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes()).hexdigest()[:16]


def _stages(k: int, n: int, device: torch.device, bits: int) -> dict[str, str]:
    from exl3tool.encode.online import _f32, _div_scalar, quantize_regularized, regularize, sample_scale_tiles, search_global_scale
    from exl3tool.format.signs import reference_signs
    from exl3tool.format.trellis import pack_trellis

    gen = torch.Generator().manual_seed(k * 100003 + n)
    w = (torch.randn(k, n, generator=gen) * 0.02).to(torch.bfloat16).to(torch.float32)
    su_s, sv_s = reference_signs(k + n, k, n)
    out = {"weight": _sha(w), "signs": _sha(su_s) + _sha(sv_s)}
    reg = regularize(w.to(device), su_s.reshape(-1), sv_s.reshape(-1))
    out.update(reg_w=_sha(reg.weight), reg_su=_sha(reg.su), reg_sv=_sha(reg.sv))
    out["sample"] = _sha(sample_scale_tiles(reg.weight, bits))
    g = search_global_scale(reg.weight, bits)
    out["g"] = repr(g)
    w_r = reg.weight * _f32(g)
    out["w_r"] = _sha(w_r)
    out["su"] = _sha(_div_scalar(reg.su, g))
    states, _, proxy = quantize_regularized(w_r, bits)
    out["states"] = _sha(states)
    out["proxy_error"] = repr(proxy)
    out["trellis"] = _sha(pack_trellis(states, bits))
    return out


def probe(device: torch.device, bits: int, shapes: list[tuple[int, int]], viterbi_tiles_n: int) -> dict:
    from exl3tool.encode.viterbi import quantize_tiles

    result: dict = {"device": str(device), "passes": []}
    for order in (shapes, list(reversed(shapes))):
        result["passes"].append({f"{k}x{n}": _stages(k, n, device, bits) for k, n in order})
    gen = torch.Generator().manual_seed(5)
    tiles = (torch.randn(viterbi_tiles_n, 256, generator=gen) * (0.5 + torch.rand(viterbi_tiles_n, 1, generator=gen))).to(device)
    runs = [quantize_tiles(tiles, bits)[1] for _ in range(3)]
    result["viterbi"] = {"tiles": viterbi_tiles_n, "digests": [_sha(s) for s in runs],
                         "tiles_differing_vs_first": [int((r != runs[0]).any(-1).sum()) for r in runs]}
    return result


def compare(paths: list[str]) -> int:
    docs = [json.load(open(p)) for p in paths]
    ref = docs[0]["passes"][0]
    bad = 0
    for d, p in zip(docs, paths):
        for i, ps in enumerate(d["passes"]):
            for shape, stages in ps.items():
                diff = [s for s in stages if stages[s] != ref[shape][s]]
                if diff:
                    bad += 1
                    print(f"{p} pass {i} {shape}: differs from {paths[0]} pass 0 at {diff} (first: {diff[0]})")
        v = d["viterbi"]
        if len(set(v["digests"])) != 1 or v["digests"][0] != docs[0]["viterbi"]["digests"][0]:
            bad += 1
            print(f"{p} viterbi repeat: {v}")
    print("all stages identical" if not bad else f"{bad} differences")
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--bits", type=int, default=6)
    ap.add_argument("--viterbi-tiles", type=int, default=262144)
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs="+")
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(args.compare))
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    res = probe(device, args.bits, shapes, args.viterbi_tiles)
    text = json.dumps(res, indent=1)
    if args.out:
        open(args.out, "w").write(text)
    print(text)


if __name__ == "__main__":
    main()
