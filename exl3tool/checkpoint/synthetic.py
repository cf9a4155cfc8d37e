"""Write random checkpoints (plain directory or Hub-cache layout) for tests and benchmarks.

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
from typing import Callable

import torch

__all__ = ["write_checkpoint", "write_llama_checkpoint", "llama_tensor_shapes", "exl3_tensors", "exl3_record"]

_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int16: "I16", torch.int32: "I32"}
_CHUNK = 1 << 22  # elements generated at once (16 MiB of float32)

# (name, shape) in the checkpoint's dtype, or (name, shape, dtype) for tensors of another dtype (EXL3 payloads).
TensorSpec = tuple


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


def exl3_tensors(module: str, in_features: int, out_features: int, bits: int = 4) -> list[TensorSpec]:
    """The tensors an EXL3 checkpoint stores for one quantized linear (trellis, suh, svh, mcg marker)."""
    return [(f"{module}.trellis", (in_features // 16, out_features // 16, 16 * bits), torch.int16),
            (f"{module}.suh", (in_features,), torch.float16),
            (f"{module}.svh", (out_features,), torch.float16),
            (f"{module}.mcg", (1,), torch.int32)]


def exl3_record(module: str, in_features: int, out_features: int, bits: int = 4) -> dict:
    """The ``tensor_storage`` record of one EXL3-stored linear (quantization_config.json)."""
    return {"quant_format": "exl3", "bits": bits, "stored_tensors": {
        name: {"shape": list(shape), "torch_dtype": str(dt).removeprefix("torch.")}
        for name, shape, dt in exl3_tensors(module, in_features, out_features, bits)}}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _spec(t: TensorSpec, dtype: torch.dtype) -> tuple[str, tuple[int, ...], torch.dtype]:
    return (t[0], tuple(t[1]), t[2] if len(t) > 2 and t[2] is not None else dtype)


def _chunks(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int):
    """The tensor's bytes in row chunks; norms are ones, matrices N(0, 0.02), integer payloads uniform."""
    if dtype in (torch.int16, torch.int32):
        gen = torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) & 0x7FFF_FFFF)
        yield torch.randint(-32768, 32767, (_numel(shape),), generator=gen, dtype=torch.int32).to(dtype) \
            .view(torch.uint8).numpy()
        return
    if len(shape) == 1:
        yield torch.ones(shape, dtype=dtype).view(torch.uint8).numpy()
        return
    flat = (shape[0], _numel(shape) // shape[0])
    gen = torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF_FFFF)
    rows_per = max(1, _CHUNK // flat[1])
    for r0 in range(0, flat[0], rows_per):
        rows = min(rows_per, flat[0] - r0)
        block = torch.randn((rows, flat[1]), generator=gen, dtype=torch.float32).mul_(0.02).to(dtype)
        yield block.view(torch.uint8).numpy()


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], torch.dtype]], seed: int,
                       digest: bool, header_only: "bool | Callable[[str], bool]" = False) -> str:
    """Stream a safetensors file (header first, then tensors in order); return its sha256 if ``digest``.

    ``header_only`` writes the header and extends the file to its full size without data (a sparse file: zeros,
    no disk used), enough for planning a checkpoint of a real model's size from its headers. A callable
    ``header_only(name)`` leaves only the tensors it is True for as holes (zeros) and writes the others' data.
    """
    holes = header_only if callable(header_only) else None
    if holes is not None and digest:
        raise ValueError("a Hub-cache layout needs every tensor's bytes; header_only cannot be a selection there")
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in tensors:
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
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
        if header_only and holes is None:
            f.truncate(8 + len(raw) + offset)
            return ""
        for name, shape, dtype in tensors:
            if holes is not None and holes(name):
                f.seek(_numel(shape) * torch.empty((), dtype=dtype).element_size(), os.SEEK_CUR)
                continue
            for arr in _chunks(name, shape, dtype, seed):
                f.write(arr.data)
                if sha is not None:  # only for a Hub-cache layout (blob names); ~20% of the write time
                    sha.update(arr.data)
        if holes is not None:
            f.truncate(8 + len(raw) + offset)  # the trailing holes
    return sha.hexdigest() if sha is not None else ""


def _split(tensors: list, shards: int) -> list[list]:
    """Contiguous groups of roughly equal size (never an empty shard)."""
    shards = max(1, min(shards, len(tensors)))
    total = sum(_numel(t[1]) for t in tensors)
    groups: list[list] = [[]]
    done = 0
    for i, t in enumerate(tensors):
        left = len(tensors) - i
        need_new = groups[-1] and len(groups) < shards and (
            done >= total * len(groups) / shards or left <= shards - len(groups))
        if need_new:
            groups.append([])
        groups[-1].append(t)
        done += _numel(t[1])
    return groups


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def write_checkpoint(path: str | Path, config: dict, tensors: list[TensorSpec], *,
                     dtype: torch.dtype = torch.bfloat16, seed: int = 0, shards: int = 1,
                     quantization_config: dict | None = None, header_only: "bool | Callable[[str], bool]" = False,
                     hub_cache: Path | None = None, repo_id: str = "test-org/tiny-model",
                     revision_tags: tuple[str, ...] = ("main",)) -> Path:
    """Write any checkpoint: ``config`` as config.json, ``tensors`` (name, shape[, dtype]) in ``shards`` files.

    ``quantization_config`` is written as quantization_config.json (an EXL3 checkpoint's ``tensor_storage``).
    Each tensor's values depend only on ``seed`` and its name. ``shards > 1`` adds model.safetensors.index.json;
    ``hub_cache`` also lays the files out as a Hub cache and returns the snapshot folder. ``header_only`` writes
    headers and sparse holes (zeros) instead of data: for every tensor, or those a callable ``header_only(name)``
    picks (a benchmark writes real data for the layers it encodes and plans the rest of a full-size model).
    Example: ``write_checkpoint(tmp, {"architectures": ["LlamaForCausalLM"], ...}, [("w", (128, 128))])``.
    """
    if dtype not in _CODES:
        raise ValueError(f"dtype {dtype} not supported; use float32, float16 or bfloat16")
    specs = [_spec(t, dtype) for t in tensors]
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    digest = hub_cache is not None
    files: dict[str, str] = {}  # file name -> sha256 (empty unless laying out a Hub cache)

    def small(name: str, data: dict) -> None:
        (root / name).write_text(json.dumps(data, indent=2) + "\n")
        files[name] = hashlib.sha256((root / name).read_bytes()).hexdigest()

    small("config.json", config)
    if quantization_config is not None:
        small("quantization_config.json", quantization_config)
    groups = _split(specs, shards)
    if len(groups) == 1:
        files["model.safetensors"] = _write_safetensors(root / "model.safetensors", groups[0], seed, digest,
                                                        header_only)
    else:
        weight_map: dict[str, str] = {}
        total = 0
        for k, group in enumerate(groups):
            name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
            files[name] = _write_safetensors(root / name, group, seed, digest, header_only)
            weight_map.update({t[0]: name for t in group})
            total += sum(_numel(t[1]) * torch.empty((), dtype=t[2]).element_size() for t in group)
        small("model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})

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
        blob = repo / "blobs" / (sha or hashlib.sha256(name.encode()).hexdigest())
        if not blob.exists():
            _link_or_copy(root / name, blob)
        link = snapshot / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path("..") / ".." / "blobs" / blob.name)
    for tag in revision_tags:
        ref = repo / "refs" / tag
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)  # no trailing newline: huggingface_hub reads the file verbatim
    return snapshot


def write_llama_checkpoint(path: str | Path, *, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
                           intermediate: int = 512, layers: int = 2, vocab: int = 512,
                           dtype: torch.dtype = torch.bfloat16, seed: int = 0, shards: int = 2,
                           hub_cache: Path | None = None, repo_id: str = "test-org/tiny-llama",
                           revision_tags: tuple[str, ...] = ("main",), head_dim: int | None = None,
                           exl3_lm_head: bool = True) -> Path:
    """Write a random ``LlamaForCausalLM`` checkpoint to ``path``; return the directory to open.

    By default it is an EXL3 checkpoint as the fork serves them: ``lm_head`` is stored as EXL3 (trellis, suh, svh,
    mcg; config.json ``quantization_config`` and quantization_config.json's ``tensor_storage`` say so) and every
    decoder linear ships BF16, so the server encodes all of them online. ``exl3_lm_head=False`` writes a plain BF16
    checkpoint (one the server never encodes anything of). ``shards > 1`` writes ``model-0000k-of-0000n.safetensors``
    plus ``model.safetensors.index.json``; ``shards == 1`` a single ``model.safetensors``. With ``hub_cache`` (an
    ``HF_HUB_CACHE`` folder) the files are also laid out as a Hub cache (blobs hard-linked to the files in
    ``path``, snapshot symlinks, ``refs/<tag>`` for every tag) and the snapshot folder is returned.
    Example: ``write_llama_checkpoint(tmp, hub_cache=tmp / "hub")`` then ``open_checkpoint("test-org/tiny-llama")``.
    """
    hd = head_dim or hidden // heads
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
    tensors: list[TensorSpec] = list(llama_tensor_shapes(hidden=hidden, heads=heads, kv_heads=kv_heads,
                                                         intermediate=intermediate, layers=layers, vocab=vocab,
                                                         head_dim=hd))
    quant = None
    if exl3_lm_head:
        tensors = [t for t in tensors if t[0] != "lm_head.weight"] + exl3_tensors("lm_head", hidden, vocab, 6)
        summary = {"quant_method": "exl3", "version": "0.0.18", "bits": 6.0, "head_bits": 6, "codebook": "mcg"}
        config["quantization_config"] = summary
        quant = {**summary, "tensor_storage": {"lm_head": exl3_record("lm_head", hidden, vocab, 6)}}
    return write_checkpoint(path, config, tensors, dtype=dtype, seed=seed, shards=shards,
                            quantization_config=quant, hub_cache=hub_cache, repo_id=repo_id,
                            revision_tags=revision_tags)
