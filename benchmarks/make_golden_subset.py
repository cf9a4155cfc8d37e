"""Cut the small golden subset the repository carries (tests/data/golden) from a full golden folder.

The full goldens (31 MB, exllamav3 1.6.5's CUDA kernels; regenerate them with benchmarks/make_golden.py on a GPU)
live outside the repository; the tests prefer them. A fresh clone runs the same tests on this subset: the same four
file names, tensor names and metadata conventions, fewer rows, cases and tiles. What is kept is fixed here (KEEP), so
re-cutting after a regeneration gives the same selection, and the files are written with a sorted header, so the
same full set gives the same bytes. The README.md written beside them records the source files' sha256.

    python benchmarks/make_golden_subset.py /path/to/full/golden [--out tests/data/golden]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
from pathlib import Path

import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
FILES = ("tiles_golden", "reconstruct_k6", "encode_e2e", "gemm_k6")

# What the subset keeps (the selection is data: change it here and re-cut).
KEEP = {
    # tiles_golden: per configuration, the first `gauss` rows of the Gaussian draw and the first `real` of the 64
    # real-weight rows (which follow the n_gauss Gaussian rows in the full file)
    "tiles": {"k6_mcg": (8, 8), "default": (4, 4)},
    # reconstruct_k6: the packed tensors cropped to their first (tile rows, tile cols); tiles are independent, so
    # unpacked / recon_<cb> crop with them. Codebooks and Hadamard tensors whole.
    "reconstruct": {"p0_k6": (2, 4), "p1_k6": (4, 2), "p2_k4": (2, 4)},
    # encode_e2e: whole cases (the smallest); weight_q is left out (no test reads it, 0.5 MB)
    "encode_cases": ("case0",),
    "encode_drop": ("weight_q",),
    # gemm_k6: the first `out` output columns of every input row. Exact: the right Hadamard mixes columns only
    # within 128-column blocks, so y[:, :out], weight_dequant[:, :out] and inner_weight[:, :out] depend only on
    # trellis[:, :out/16] and svh[:out]. enc.weight and the sign/scale vectors of the encode are left out.
    "gemm_out": 128,
    "gemm_tensors": ("enc.trellis", "enc.suh", "enc.svh", "inner_weight", "weight_dequant", "x_m1", "y_m1"),
}

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.float64: "F64", torch.int16: "I16", torch.int32: "I32"}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """safetensors bytes with a sorted header (safetensors' own writer orders metadata by hash, run to run)."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        data = t.view(torch.uint8).numpy().tobytes() if t.dim() else t.reshape(1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def cut_tiles(t: dict, meta: dict) -> tuple[dict, dict, str]:
    out = {"tensor_core_perm": t["tensor_core_perm"]}
    new_meta = dict(meta)
    configs = sorted({k.split(".")[0] for k in t if "." in k})
    lines, max_real = [], 0
    for cfg in configs:
        gauss, real = KEEP["tiles"].get(cfg, KEEP["tiles"]["default"])
        n_gauss = int(meta[f"{cfg}.n_gauss"])
        rows = list(range(gauss)) + list(range(n_gauss, n_gauss + real))
        for part in ("input", "output", "indices"):
            out[f"{cfg}.{part}"] = t[f"{cfg}.{part}"][rows]
        new_meta[f"{cfg}.n_gauss"], new_meta[f"{cfg}.n_real"] = str(gauss), str(real)
        max_real = max(max_real, real)
        lines.append(f"`{cfg}`: rows 0-{gauss - 1} and {n_gauss}-{n_gauss + real - 1}")
    out["real_tile_positions"] = t["real_tile_positions"][:max_real]
    return out, new_meta, "; ".join(lines) + f"; `real_tile_positions` rows 0-{max_real - 1}"


def cut_reconstruct(t: dict, meta: dict) -> tuple[dict, dict, str]:
    out = {k: v for k, v in t.items() if k.startswith(("codebook_", "had"))}
    lines = []
    for name, (kt, nt) in KEEP["reconstruct"].items():
        out[f"{name}.packed"] = t[f"{name}.packed"][:kt, :nt]
        out[f"{name}.unpacked"] = t[f"{name}.unpacked"][:kt, :nt]
        for key in t:
            if key.startswith(f"{name}.recon_"):
                out[key] = t[key][: 16 * kt, : 16 * nt]
        lines.append(f"`{name}` tiles [:{kt}, :{nt}]")
    return out, dict(meta), "codebooks and Hadamard tensors whole; " + ", ".join(lines)


def cut_encode(t: dict, meta: dict) -> tuple[dict, dict, str]:
    cases = KEEP["encode_cases"]
    out = {k: v for k, v in t.items()
           if k.split(".")[0] in cases and k.split(".", 1)[1] not in KEEP["encode_drop"]}
    all_cases = {k.split(".")[0] for k in t}
    new_meta = {k: v for k, v in meta.items() if k.split(".")[0] not in all_cases or k.split(".")[0] in cases}
    drop = ", ".join(f"`{d}`" for d in KEEP["encode_drop"])
    return out, new_meta, f"{', '.join(cases)} whole except {drop}"


def cut_gemm(t: dict, meta: dict) -> tuple[dict, dict, str]:
    n = KEEP["gemm_out"]
    out = {}
    for key in KEEP["gemm_tensors"]:
        v = t[key]
        if key == "enc.trellis":
            v = v[:, : n // 16]
        elif key in ("inner_weight", "weight_dequant") or key.startswith("y_m"):
            v = v[:, :n]
        elif key == "enc.svh":
            v = v[:n]
        out[key] = v
    new_meta = dict(meta)
    new_meta["enc.crop_in_out"] = json.dumps([int(t["enc.suh"].numel()), n])
    return out, new_meta, (f"output columns 0-{n - 1} of every input row: {', '.join(f'`{k}`' for k in KEEP['gemm_tensors'])}"
                           " (cropped where they have an output axis); metadata `enc.crop_in_out`")


CUTTERS = {"tiles_golden": cut_tiles, "reconstruct_k6": cut_reconstruct, "encode_e2e": cut_encode, "gemm_k6": cut_gemm}

_README = """# Golden subset

A small cut of the EXL3 golden vectors, so a fresh clone runs the golden tests (`tests/goldens.py` finds the full
set first: `$EXL3TOOL_GOLDEN`, `./golden`, `../shared/golden`; this folder is the fallback). Written by
`python benchmarks/make_golden_subset.py FULL_GOLDEN_DIR`; do not edit by hand.

Provenance of the full set: the CUDA kernels of the exllamav3 1.6.5 PyPI package on an NVIDIA H200 (torch
2.11.0+cu130, CUDA 13.0, triton 3.6.0, sm_90), driven by exllamav3's own Python encoder (`quantize_exl3`,
`quantize_tiles`) and inference layer (`LinearEXL3`); `benchmarks/make_golden.py` regenerates it on a GPU, and
`docs/format.md` (section "Golden vectors") describes its files, tensors and conventions. The subset keeps the
same file names, tensor names, dtypes and metadata (plus the metadata key `subset`, and per-configuration
`n_gauss` / `n_real` counting the rows kept); every kept value is the reference's, bit for bit.

| file | bytes | kept | source sha256 |
| --- | --- | --- | --- |
{rows}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("full", type=Path, help="the full golden folder (tiles_golden.safetensors etc.)")
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "golden")
    args = ap.parse_args(argv)
    missing = [f for f in FILES if not (args.full / f"{f}.safetensors").is_file()]
    if missing:
        print(f"{args.full}: no {missing[0]}.safetensors; name the full golden folder", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in FILES:
        src = args.full / f"{name}.safetensors"
        tensors, meta = _read(src)
        if "subset" in meta:
            print(f"{src}: this is already a subset; name the full golden folder", file=sys.stderr)
            return 2
        digest = sha256(src)
        kept, new_meta, what = CUTTERS[name](tensors, meta)
        new_meta["subset"] = json.dumps({"source": f"{name}.safetensors", "source_sha256": digest, "kept": what})
        dst = args.out / f"{name}.safetensors"
        write_safetensors(dst, kept, new_meta)
        rows.append(f"| `{name}.safetensors` | {dst.stat().st_size:,} | {what} | `{digest}` |")
        print(f"{dst}: {dst.stat().st_size:,} bytes ({what})")
    (args.out / "README.md").write_text(_README.format(rows="\n".join(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
