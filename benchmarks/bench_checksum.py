"""What checking hits against exl3tool's checksum costs an all-hits warm of a large model (issue 14).

    python benchmarks/bench_checksum.py --json benchmarks/results/bench_checksum_cpu.json
    python benchmarks/bench_checksum.py --layers 8 --tp-sizes 1,2        # smaller

The model is Llama-3.1-8B-shaped (hidden 4096, 32 heads, 8 KV heads, intermediate 14336, 32 layers; small vocab),
written as a sparse checkpoint: an all-hits warm reads only its headers, never its weights. Every job's entry is
written through ``CacheStore.publish`` with random tensors of the right shapes (about 5.2 GB at TP 1 and 6 bits).
Then, page cache warm and cold (``posix_fadvise(DONTNEED)`` on every entry first):

* ``plan_quick``: ``prepare(check_hits=False)``: headers and scales only (what the warm's plan did before);
* ``plan_checked``: ``prepare()``: the same, plus every hit's trellis hashed from the file against its
  ``exl3tool_sha256`` (what the warm's plan does now);
* ``warm``: the whole all-hits ``warm()`` (plan with checksums, nothing to encode).

The checksum's cost is ``plan_checked - plan_quick``; GB/s is entry bytes over that difference and over
``plan_checked``. The figures depend on cores (the plan hashes on up to 8 threads) and on the disk when cold.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from exl3tool.checkpoint.synthetic import llama_tensor_shapes
from exl3tool.format.encoded import EncodedLinear
from exl3tool.plan import ServerRequest, prepare
from exl3tool.operations.warm import warm

LLAMA_8B = dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=512)


def sparse_llama(path: Path, layers: int) -> Path:
    """A bf16 Llama checkpoint whose weights are holes in a sparse file: right headers, no data written."""
    path.mkdir(parents=True, exist_ok=True)
    shape = dict(LLAMA_8B)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape["hidden"],
        "intermediate_size": shape["intermediate"], "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"], "head_dim": shape["hidden"] // shape["heads"],
        "num_hidden_layers": layers, "vocab_size": shape["vocab"], "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims in llama_tensor_shapes(layers=layers, head_dim=shape["hidden"] // shape["heads"], **shape):
        nbytes = int(np.prod(dims)) * 2
        header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)
    return path


def random_encoded(k: int, n: int, bits: int, rng: np.random.Generator) -> EncodedLinear:
    trellis = torch.from_numpy(rng.integers(-32768, 32767, (k // 16, n // 16, 16 * bits), dtype=np.int16))
    suh = torch.from_numpy(rng.uniform(0.5, 1.5, k).astype(np.float16))
    svh = torch.from_numpy(rng.uniform(0.5, 1.5, n).astype(np.float16))
    return EncodedLinear(trellis, suh, svh, 0.001, 1.0, bits)


def evict(paths: list[Path]) -> None:
    """Drop the entries from the page cache (clean pages; no root needed), so the next read comes from disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tp-sizes", default="1")
    ap.add_argument("--bits", type=int, default=6)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="exl3tool-bench-checksum-"))
    model = sparse_llama(work / "model", args.layers)
    request = ServerRequest(model=str(model), tp_sizes=tuple(int(t) for t in args.tp_sizes.split(",")), bits=args.bits,
                          cache_dir=str(work / "cache"), device="cpu", encoder_root="/encoders/exllamav3",
                          encoder_revision="bench")

    _, plan, store = prepare(request, check_hits=False)
    rng = np.random.default_rng(0)
    _, t_fill = timed(lambda: [store.publish(j.key, random_encoded(j.input_size, j.output_size, args.bits, rng))
                               for j in plan.todo])
    paths = [j.path for j in plan.jobs if j.state != "skipped"]
    total = sum(p.stat().st_size for p in paths)
    print(f"{len(paths)} entries, {total / 1e9:.2f} GB written through the store in {t_fill:.1f} s")

    runs = {}
    for cache_state in ("warm", "cold"):
        for name, fn in (("plan_quick", lambda: prepare(request, check_hits=False)),
                         ("plan_checked", lambda: prepare(request)),
                         ("warm", lambda: warm(request))):
            if cache_state == "cold":
                evict(paths)
            out, seconds = timed(fn)
            if name == "warm":
                assert out.counts["hit"] == len(paths) and out.counts["encoded"] == 0, out.counts
            else:
                assert out[1].count("hit") == len(paths)
            runs[f"{name}_{cache_state}_s"] = round(seconds, 3)
            print(f"{cache_state:5s} page cache  {name:13s} {seconds:7.2f} s")
    result = {
        "model": f"Llama-3.1-8B shapes, {args.layers} layers (sparse checkpoint)", "tp_sizes": list(request.tp_sizes),
        "bits": args.bits, "entries": len(paths), "entry_bytes": total, "fill_s": round(t_fill, 1),
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        **runs,
    }
    for state in ("warm", "cold"):
        extra = runs[f"plan_checked_{state}_s"] - runs[f"plan_quick_{state}_s"]
        result[f"checksum_cost_{state}_s"] = round(extra, 3)
        result[f"checksum_gb_per_s_{state}"] = round(total / 1e9 / max(extra, 1e-9), 2)
        result[f"checked_plan_gb_per_s_{state}"] = round(total / 1e9 / runs[f"plan_checked_{state}_s"], 2)
    print(json.dumps(result, indent=2))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
