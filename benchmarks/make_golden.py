"""Regenerate the FULL golden set (docs/format.md, "Golden vectors") from the exllamav3 1.6.5 reference on a GPU.

Needs CUDA and the exllamav3 1.6.5 package importable (``pip install exllamav3==1.6.5``, or the wheel unpacked on
PYTHONPATH as benchmarks/gpu_dropin.sh does; its first import JIT-compiles the extension, several minutes). Writes
tiles_golden, reconstruct_k6, encode_e2e and gemm_k6 .safetensors into OUT with the tensor names, seeds, recipes and
metadata that docs/format.md lists; then cut the repository's subset with

    python benchmarks/make_golden.py OUT --previous OLD_FULL && python benchmarks/make_golden_subset.py OUT

The reference calls are exllamav3's own Python API (``quantize_tiles``, ``quantize_exl3``, ``pack_trellis`` in
``modules/quant/exl3_lib/quantize.py``; ``reconstruct``, ``had_r_128`` in its extension; ``LinearEXL3``). This script
has NOT been run yet (written without a GPU and the reference at hand; the committed goldens predate it): on a first
run, compare its output with the existing full set tensor by tensor before replacing it. The 65,536-entry codebook
tables are carried over from ``--previous`` (the reference's Python API has no table entry point; the tests check
them against the worked examples of docs/format.md §3 as well), everything else is recomputed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import zlib
from pathlib import Path

import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from make_golden_subset import write_safetensors  # noqa: E402

GAUSS_SEED, PACKED_SEED = 20240611, 4242
TILE_CONFIGS = {"k6_mcg": (6, "mcg", 512), **{f"k{k}_mcg": (k, "mcg", 128) for k in (2, 3, 4, 5, 7, 8)},
                "k6_3inst": (6, "3inst", 256), "k6_mul1": (6, "mul1", 256)}
CASES = {"case0": ("model.layers.0.self_attn.o_proj", 256, 512, 1001),
         "case1": ("model.layers.0.mlp.down_proj", 512, 256, 1002),
         "case2": ("model.layers.0.self_attn.qkv_proj", 384, 1536, 1003)}
GEMM_CASE = ("model.layers.3.mlp.down_proj", 1024, 1024, 3003)
RECIPE = ("W = randn(out, in)*0.02; W *= exp(0.5*randn(out, 1)); W *= exp(0.5*randn(1, in)); "
          "W[:, randperm(in)[:4]] *= 10; stored W.T (in, out) f32; one CPU generator seeded with weight_seed")


def _reference():
    """exllamav3's quantize module, extension and LinearEXL3, or one line saying what is missing."""
    try:
        from exllamav3.ext import exllamav3_ext as ext
        from exllamav3.modules.quant import exl3 as exl3_module
        from exllamav3.modules.quant.exl3_lib import quantize as q
    except ImportError as exc:
        raise SystemExit(f"exllamav3 1.6.5 is not importable ({exc}); pip install exllamav3==1.6.5") from None
    return q, ext, exl3_module


@contextlib.contextmanager
def _captured(q):
    """Wrap the reference's ``regularize`` and ``fallback_quant`` for one ``quantize_exl3`` call; yield what they
    returned: ``su``/``sv`` (the scales before fp16), ``weight_r`` (the regularised weight) and ``encoded`` (the
    trellis states before packing).

    Why a wrapper: 1.6.5's ``save_reg`` is a file name for a picture of the weights (drawn with a matplotlib call
    that current matplotlib lacks), not a way to hand the intermediates back. ``quantize_exl3`` looks both names up
    in its module at call time, so replacing the module attributes reaches it; with a meta Hessian the encode takes
    the ``fallback_quant`` path (``q_fallback``), so ``su``/``sv`` are final after ``regularize``.
    """
    reg: dict = {}
    regularize, fallback_quant = q.regularize, q.fallback_quant

    def regularize_captured(*a, **kw):
        result = regularize(*a, **kw)
        _, weight_r, _, su, sv = result
        reg.update(weight_r=weight_r.detach().float().cpu().clone(), su=su.detach().float().cpu().flatten().clone(),
                   sv=sv.detach().float().cpu().flatten().clone())
        return result

    def fallback_captured(*a, **kw):
        result = fallback_quant(*a, **kw)
        reg["encoded"] = result[1].detach().cpu().clone()
        return result

    q.regularize, q.fallback_quant = regularize_captured, fallback_captured
    try:
        yield reg
    finally:
        q.regularize, q.fallback_quant = regularize, fallback_quant


def _previous(previous: Path, fname: str, name: str, draw):
    """An input tensor of the committed set (so a regeneration is compared on the same inputs), else a fresh draw.

    The first goldens drew a few inputs in ways this script does not repeat (the real tiles' positions, the
    Hadamard and GEMM activations); the reference's outputs are what is regenerated and compared.
    """
    path = previous / f"{fname}.safetensors"
    if path.is_file():
        with safe_open(str(path), "pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    return draw()


def seed_of(prefix: str) -> int:
    return zlib.crc32(prefix.encode("utf-8")) & 0x7FFFFFFF


def recipe_weight(k: int, n: int, weight_seed: int) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(weight_seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    w *= torch.exp(0.5 * torch.randn(n, 1, generator=gen))
    w *= torch.exp(0.5 * torch.randn(1, k, generator=gen))
    idx = torch.randperm(k, generator=gen)[:4]
    w[:, idx] *= 10
    return w.t().contiguous(), idx.tolist()


def _quant_args(bits: int, codebook: str, seed: int | None = None) -> dict:
    args = {"K": bits, "devices": ["cuda:0"], "apply_out_scales": True}
    if codebook != "3inst":
        args[codebook] = True
    if seed is not None:
        args["seed"] = seed
    return args


def encode(q, prefix: str, k: int, n: int, weight_seed: int, tag: str, tensors: dict, meta: dict) -> dict:
    """One online quantize_exl3 call (meta Hessian), its intermediates under ``tag.``."""
    weight, outliers = recipe_weight(k, n, weight_seed)
    seed = seed_of(prefix)
    torch.manual_seed(seed)  # the reference's sign draws, recorded for the tests (docs/format.md §7.2)
    su_sign = torch.sign(torch.sign(torch.randn(k, device="cuda")) + 1e-5).cpu()
    sv_sign = torch.sign(torch.sign(torch.randn(n, device="cuda")) + 1e-5).cpu()
    h_data = {"H": torch.empty((k, k), device="meta"), "count": 0, "finalized": False, "device": "cuda:0"}
    args = _quant_args(6, "mcg", seed)
    with _captured(q) as reg:
        weight_q, proxy, out = q.quantize_exl3(weight.cuda(), h_data, args, True, verbose=False)
    g = float(args["g_scale"])
    t = {"weight": weight, "su_sign": su_sign, "sv_sign": sv_sign, "trellis": out["trellis"].cpu(),
         "suh": out["suh"].cpu(), "svh": out["svh"].cpu(), "mcg": out["mcg"].cpu(),
         "g_scale": torch.tensor([g], dtype=torch.float64), "proxy_error": torch.tensor([float(proxy)], dtype=torch.float64),
         "weight_q": weight_q.float().cpu()}
    for name in ("su", "sv", "weight_r", "encoded"):  # scales before fp16, W_r, states (captured above)
        if name in reg:
            t[{"su": "su_f32", "sv": "sv_f32"}.get(name, name)] = reg[name].float().cpu() if name != "encoded" else reg[name].cpu()
    missing = {"su_f32", "sv_f32", "weight_r", "encoded"} - set(t)
    if missing:
        raise SystemExit(f"{prefix}: the capture of regularize/fallback_quant missed {sorted(missing)}; read its quantize_exl3")
    tensors.update({f"{tag}.{name}": v.contiguous() for name, v in t.items()})
    meta.update({f"{tag}.prefix": prefix, f"{tag}.seed": str(seed), f"{tag}.weight_seed": str(weight_seed),
                 f"{tag}.shape_in_out": json.dumps([k, n]), f"{tag}.outlier_in_channels": json.dumps(outliers),
                 f"{tag}.g_scale": repr(g), f"{tag}.proxy_error": repr(float(proxy)), f"{tag}.q_fallback": "true",
                 f"{tag}.apply_out_scales": "true"})
    return t


def tiles_file(q, e2e: dict, previous: Path) -> tuple[dict, dict]:
    perm = q.tensor_core_perm("cuda:0").cpu().to(torch.int32)
    gauss = torch.randn(512, 256, generator=torch.Generator().manual_seed(GAUSS_SEED))
    w_r = e2e["case2.weight_r"]
    positions = _previous(previous, "tiles_golden", "real_tile_positions", lambda: torch.stack(
        torch.meshgrid(torch.arange(0, 24, 3), torch.arange(0, 96, 12), indexing="ij"), -1).reshape(-1, 2))
    real = torch.stack([w_r[16 * i:16 * i + 16, 16 * j:16 * j + 16].reshape(-1)[perm.long()] for i, j in positions.tolist()])
    tensors = {"tensor_core_perm": perm, "real_tile_positions": positions.to(torch.int32)}
    meta = {"gauss_seed": str(GAUSS_SEED), "real_source": "encode_e2e case2 weight_r, tensor-core order"}
    for tag, (bits, cb, n_gauss) in TILE_CONFIGS.items():
        x = torch.cat([gauss[:n_gauss], real]).contiguous()
        out, idx = q.quantize_tiles(x.cuda(), _quant_args(bits, cb))
        out2, idx2 = q.quantize_tiles(x.cuda(), _quant_args(bits, cb))
        tensors.update({f"{tag}.input": x, f"{tag}.output": out.cpu(), f"{tag}.indices": idx.cpu()})
        meta.update({f"{tag}.n_gauss": str(n_gauss), f"{tag}.n_real": str(real.shape[0]),
                     f"{tag}.checks": json.dumps({"repeat_bitwise_identical": bool(torch.equal(idx, idx2) and torch.equal(out, out2))})})
    return tensors, meta


def reconstruct_file(q, ext, previous: Path) -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(PACKED_SEED)
    tensors, meta = {}, {}
    for name, shape, bits in (("p0_k6", (8, 16, 96), 6), ("p1_k6", (32, 8, 96), 6), ("p2_k4", (8, 16, 64), 4)):
        packed = torch.randint(-32768, 32768, shape, generator=gen, dtype=torch.int32).to(torch.int16)
        unpacked = torch.empty(shape[:2] + (256,), dtype=torch.int16, device="cuda")
        ext.unpack_trellis(unpacked, packed.cuda(), bits)
        tensors[f"{name}.packed"], tensors[f"{name}.unpacked"] = packed, unpacked.cpu()
        repacked = q.pack_trellis(unpacked, {"K": bits}).cpu()
        meta[f"{name}.K"], meta[f"{name}.pack(unpack(p))==p"] = str(bits), str(bool(torch.equal(repacked, packed)))
        for cb, (mcg, mul1) in {"3inst": (False, False), "mcg": (True, False), "mul1": (False, True)}.items():
            out = torch.empty((16 * shape[0], 16 * shape[1]), dtype=torch.half, device="cuda")
            ext.reconstruct(out, packed.cuda(), bits, mcg, mul1)
            tensors[f"{name}.recon_{cb}"] = out.cpu()
    with safe_open(str(previous / "reconstruct_k6.safetensors"), "pt") as f:  # see the module docstring
        for cb in ("3inst", "mcg", "mul1"):
            tensors[f"codebook_{cb}"] = f.get_tensor(f"codebook_{cb}")
    eye = torch.eye(128, device="cuda").repeat(1, 2)[:, :256].contiguous()
    h = torch.empty_like(eye)
    ext.had_r_128(eye, h, None, None, 1.0)  # rows of H / sqrt(128), from the reference's own transform
    tensors["had128"] = torch.round(h[:, :128].cpu() * 128 ** 0.5)
    x = _previous(previous, "reconstruct_k6", "had.x", lambda: torch.randn(8, 256, generator=gen))
    y = x.clone().cuda()
    ext.had_r_128(x.cuda(), y, None, None, 1.0)
    tensors["had.x"], tensors["had.y"] = x, y.cpu()
    # the fp16 path with an input sign vector (pre_scale), as the GEMM applies suh
    pre = _previous(previous, "reconstruct_k6", "had.pre_scale",
                    lambda: torch.sign(torch.randn(256, generator=gen) + 1e-5).half())
    x16 = x.half()
    y16 = torch.empty_like(x16).cuda()
    ext.had_r_128(x16.cuda(), y16, pre.cuda(), None, 1.0)
    tensors["had.x16"], tensors["had.pre_scale"], tensors["had.y16_pre"] = x16, pre, y16.cpu()
    return tensors, meta


def gemm_file(q, exl3_module, previous: Path) -> tuple[dict, dict]:
    tensors, meta = {}, {"weight_recipe": RECIPE}
    prefix, k, n, weight_seed = GEMM_CASE
    enc = encode(q, prefix, k, n, weight_seed, "enc", tensors, meta)
    for name in ("weight_r", "encoded", "weight_q"):
        tensors.pop(f"enc.{name}", None)
    layer = exl3_module.LinearEXL3(None, k, n, trellis=enc["trellis"].cuda(), suh=enc["suh"].cuda(),
                                   svh=enc["svh"].cuda(), mcg=enc["mcg"].cuda())
    tensors["weight_dequant"] = layer.get_weight_tensor().half().cpu()
    tensors["inner_weight"] = layer.get_inner_weight_tensor().half().cpu()
    gen = torch.Generator().manual_seed(weight_seed)
    for m in (1, 16, 128, 256):
        x = _previous(previous, "gemm_k6", f"x_m{m}", lambda: torch.randn(m, k, generator=gen).half())
        tensors[f"x_m{m}"], tensors[f"y_m{m}"] = x, layer.forward(x.cuda(), {}).cpu()
    return tensors, meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="folder for the four .safetensors files")
    ap.add_argument("--previous", type=Path, required=True,
                    help="the existing full golden folder: its codebook tables are carried over")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("make_golden.py: needs a CUDA device (the goldens are the reference's CUDA outputs)", file=sys.stderr)
        return 2
    q, ext, exl3_module = _reference()
    args.out.mkdir(parents=True, exist_ok=True)
    e2e, e2e_meta = {}, {"weight_recipe": RECIPE, "description": "online quantize_exl3, K=6, mcg, meta Hessian"}
    for tag, (prefix, k, n, weight_seed) in CASES.items():
        encode(q, prefix, k, n, weight_seed, tag, e2e, e2e_meta)
    files = {"encode_e2e": (e2e, e2e_meta), "tiles_golden": tiles_file(q, e2e, args.previous), "reconstruct_k6": reconstruct_file(q, ext, args.previous),
             "gemm_k6": gemm_file(q, exl3_module, args.previous)}
    for name, (tensors, meta) in files.items():
        write_safetensors(args.out / f"{name}.safetensors", tensors, meta)
        print(f"{args.out / name}.safetensors: {len(tensors)} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
