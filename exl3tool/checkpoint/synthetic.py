"""Write random Llama checkpoints (plain directory or Hub-cache layout) for tests and benchmarks.

Tensors are generated and streamed to disk one at a time (in row chunks), with the safetensors header
written first, so even a hidden=4096 / intermediate=14336 model needs about one chunk of memory.
Each tensor's values depend only on ``seed`` and its name, not on how the files are sharded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import zlib
from pathlib import Path

import torch

__all__ = ["write_llama_checkpoint", "llama_tensor_shapes"]

_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_CHUNK = 1 << 22  # elements generated at once (16 MiB of float32)


def llama_tensor_shapes(*, hidden: int, heads: int, kv_heads: int, intermediate: int, layers: int, vocab: int,
                        head_dim: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a HF Llama checkpoint, in the order they are written."""
    hd = head_dim or hidden // heads
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.self_attn.q_proj.weight", (heads * hd, hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv_heads * hd, hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv_heads * hd, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, heads * hd)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
            (f"{p}.mlp.gate_proj.weight", (intermediate, hidden)),
            (f"{p}.mlp.up_proj.weight", (intermediate, hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, intermediate)),
        ]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _chunks(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int):
    """The tensor's bytes in row chunks; norms are ones, matrices N(0, 0.02)."""
    if len(shape) == 1:
        yield torch.ones(shape, dtype=dtype).view(torch.uint8).numpy()
        return
    gen = torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF_FFFF)
    rows_per = max(1, _CHUNK // shape[1])
    for r0 in range(0, shape[0], rows_per):
        rows = min(rows_per, shape[0] - r0)
        block = torch.randn((rows, shape[1]), generator=gen, dtype=torch.float32).mul_(0.02).to(dtype)
        yield block.view(torch.uint8).numpy()


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, seed: int,
                       digest: bool) -> str:
    """Stream a safetensors file (header first, then tensors in order); return its sha256 if ``digest``."""
    esize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = _numel(shape) * esize
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    sha = hashlib.sha256() if digest else None
    with open(path, "wb") as f:
        for piece in (struct.pack("<Q", len(raw)), raw):
            f.write(piece)
            if sha is not None:
                sha.update(piece)
        for name, shape in tensors:
            for arr in _chunks(name, shape, dtype, seed):
                f.write(arr.data)
                if sha is not None:  # only for a Hub-cache layout (blob names); ~20% of the write time
                    sha.update(arr.data)
    return sha.hexdigest() if sha is not None else ""


def _split(tensors: list[tuple[str, tuple[int, ...]]], shards: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Contiguous groups of roughly equal size (never an empty shard)."""
    shards = max(1, min(shards, len(tensors)))
    total = sum(_numel(s) for _, s in tensors)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    done = 0
    for i, (name, shape) in enumerate(tensors):
        left = len(tensors) - i
        need_new = groups[-1] and len(groups) < shards and (
            done >= total * len(groups) / shards or left <= shards - len(groups))
        if need_new:
            groups.append([])
        groups[-1].append((name, shape))
        done += _numel(shape)
    return groups


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def write_llama_checkpoint(path: str | Path, *, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
                           intermediate: int = 512, layers: int = 2, vocab: int = 512,
                           dtype: torch.dtype = torch.bfloat16, seed: int = 0, shards: int = 2,
                           hub_cache: Path | None = None, repo_id: str = "test-org/tiny-llama",
                           revision_tags: tuple[str, ...] = ("main",), head_dim: int | None = None) -> Path:
    """Write a random ``LlamaForCausalLM`` checkpoint to ``path``; return the directory to open.

    ``shards > 1`` writes ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``;
    ``shards == 1`` a single ``model.safetensors``. With ``hub_cache`` (an ``HF_HUB_CACHE`` folder) the
    files are also laid out as a Hub cache (blobs hard-linked to the files in ``path``, snapshot symlinks,
    ``refs/<tag>`` for every tag) and the snapshot folder is returned.
    Example: ``write_llama_checkpoint(tmp, hub_cache=tmp / "hub")`` then ``open_checkpoint("test-org/tiny-llama")``.
    """
    if dtype not in _CODES:
        raise ValueError(f"dtype {dtype} not supported; use float32, float16 or bfloat16")
    hd = head_dim or hidden // heads
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hd,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    digest = hub_cache is not None
    files: dict[str, str] = {}  # file name -> sha256 (empty unless laying out a Hub cache)
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    files["config.json"] = hashlib.sha256((root / "config.json").read_bytes()).hexdigest()

    tensors = llama_tensor_shapes(hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
                                  layers=layers, vocab=vocab, head_dim=hd)
    groups = _split(tensors, shards)
    if len(groups) == 1:
        files["model.safetensors"] = _write_safetensors(root / "model.safetensors", groups[0], dtype, seed, digest)
    else:
        esize = torch.empty((), dtype=dtype).element_size()
        weight_map: dict[str, str] = {}
        for k, group in enumerate(groups):
            name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
            files[name] = _write_safetensors(root / name, group, dtype, seed, digest)
            weight_map.update({t: name for t, _ in group})
        index = {"metadata": {"total_size": sum(_numel(s) for _, s in tensors) * esize}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        files["model.safetensors.index.json"] = hashlib.sha256(
            (root / "model.safetensors.index.json").read_bytes()).hexdigest()

    if hub_cache is None:
        return root
    # A deterministic 40-hex "commit": sha1 over the file names and contents' hashes.
    commit = hashlib.sha1(json.dumps(sorted(files.items())).encode()).hexdigest()
    repo = Path(hub_cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for name, sha in files.items():
        blob = repo / "blobs" / sha
        if not blob.exists():
            _link_or_copy(root / name, blob)
        link = snapshot / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path("..") / ".." / "blobs" / sha)
    for tag in revision_tags:
        ref = repo / "refs" / tag
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)  # no trailing newline: huggingface_hub reads the file verbatim
    return snapshot
