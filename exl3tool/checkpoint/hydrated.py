"""A checkpoint whose online-encoded layers are stored as EXL3: the format rules `exl3tool hydrate` writes by.

Ground truth (docs/hydrate.md cites each rule): the fork's ``vllm/model_executor/layers/quantization/exl3.py``
(``Exl3LinearMethod``, ``Exl3Config._validate_storage_metadata`` / ``_storage_entry`` / ``_linear_prefix_is_exl3``)
and exllamav3's ``conversion/quant_config.py`` (the ``tensor_storage`` record).

* Per *source* module (``q_proj``, not the fused ``qkv_proj``): ``<m>.trellis`` int16 ``(K/16, N/16, 16*bits)``,
  ``<m>.suh`` fp16 ``(K,)``, ``<m>.svh`` fp16 ``(N,)``, ``<m>.mcg`` int32 0-dim holding 0xCBAC1FED; ``<m>.bias`` (if
  any) stays as it was; ``<m>.weight`` is removed.
* One ``tensor_storage`` record per stored module: ``quant_format: "exl3"``, ``bits_per_weight``,
  ``mcg_multiplier`` and ``stored_tensors`` (name -> shape, n_bytes, dtype), as exllamav3 writes them.
* The fork loads a fused module's sources as separate shards (each owns its Hadamard signs), slices them per TP rank
  in 128-blocks (``_shard_tensors_for_tensor_parallel``): ``hydration_problem`` says where that cannot work (the
  rules live in ``checkpoint.slicing``, torch-free, where `cache check` judges every stored module by them).

Also: ``write_shard`` streams a safetensors file whose kept tensors are copied byte for byte from the source shard.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from exl3tool.checkpoint.slicing import (  # the slicing rules, torch-free; re-exported here for hydrate
    SourceModule, hydration_problem, shard_groups, slicing_problem, source_modules, storage_problem, stored_module,
    tp_problems,
)
from exl3tool.checkpoint.source import span_problem, tensor_nbytes
from exl3tool.errors import InputError
from exl3tool.format.codebook import CODEBOOK_MARKERS

__all__ = ["MCG_MULTIPLIER", "EXL3_SUFFIXES", "stored_module", "exl3_tensors_of", "storage_record", "shard_groups",
           "hydration_problem", "source_modules", "SourceModule", "read_header", "write_shard", "FileTensor",
           "DTYPE_CODES", "tensor_nbytes", "storage_problem", "slicing_problem", "tp_problems"]

MCG_MULTIPLIER = 0xCBAC1FED  # exl3.py _MCG_SENTINEL; exllamav3 records it as mcg_multiplier
EXL3_SUFFIXES = ("trellis", "suh", "svh", "mcg")
DTYPE_CODES = {torch.int16: "I16", torch.int32: "I32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.float32: "F32"}


def exl3_tensors_of(module: str, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> dict[str, torch.Tensor]:
    """The four tensors one stored EXL3 linear holds (exllamav3's ``LinearEXL3.get_tensors`` with the MCG codebook)."""
    return {f"{module}.trellis": trellis.detach().to("cpu", torch.int16).contiguous(),
            f"{module}.suh": suh.detach().to("cpu", torch.float16).contiguous(),
            f"{module}.svh": svh.detach().to("cpu", torch.float16).contiguous(),
            f"{module}.mcg": torch.tensor(CODEBOOK_MARKERS["mcg"], dtype=torch.int32)}


def storage_record(module: str, tensors: dict[str, tuple[tuple[int, ...], str]], bits: int) -> dict:
    """The ``tensor_storage`` record of one stored module; ``tensors`` maps every tensor under ``module`` (the EXL3
    ones and a kept bias) to ``(shape, safetensors dtype code)``. ``bits_per_weight`` is the K its trellis holds
    (last dimension / 16: what the fork reads, ``_validate_loaded_tensors``; modules of one checkpoint may differ),
    ``bits`` where there is no trellis."""
    torch_names = {v: str(k) for k, v in DTYPE_CODES.items()}
    stored = {name: {"shape": list(shape), "n_bytes": tensor_nbytes(shape, code),
                     "dtype": torch_names.get(code, code)}
              for name, (shape, code) in sorted(tensors.items())}
    trellis = tensors.get(f"{module}.trellis")
    k = trellis[0][-1] // 16 if trellis is not None and len(trellis[0]) == 3 else bits
    return {"stored_tensors": stored, "quant_format": "exl3", "bits_per_weight": int(k),
            "mcg_multiplier": MCG_MULTIPLIER}


# --------------------------------------------------------------------------------------------------------------
# safetensors, byte for byte


def read_header(path: Path) -> tuple[dict, int]:
    """``(header dict, data start)`` of a safetensors file; InputError naming the file when it has none."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:  # safetensors' own limit on a header
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(f.read(n).decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, struct.error) as exc:
        raise InputError(f"{path}: cannot read its safetensors header ({exc})") from None
    return header, 8 + n


@dataclass(frozen=True)
class FileTensor:
    """A tensor ``write_shard`` copies byte for byte from another safetensors file (a kept per-module result)."""

    path: Path
    name: str


def _span(path: Path, header: dict, start: int, size: int, name: str) -> tuple[int, int]:
    """``(offset in the file, bytes)`` of tensor ``name``, checked against its dtype, shape and the file's size:
    InputError naming the file and the tensor when they disagree (a corrupt or truncated file)."""
    rec = header.get(name)
    try:
        lo, hi = (int(x) for x in rec["data_offsets"])
        code, shape = rec["dtype"], rec["shape"]
    except (TypeError, KeyError, ValueError):
        raise InputError(f"{path}: tensor {name!r} has no valid dtype, shape and data_offsets in the header; the "
                         "file is corrupt: download it again") from None
    if not 0 <= lo <= hi or start + hi > size:
        raise InputError(f"{path}: tensor {name!r} has data_offsets [{lo}, {hi}] beyond the file's "
                         f"{size - start} data bytes; the file is corrupt or truncated: download it again")
    problem = span_problem(name, code, shape, (lo, hi))
    if problem:
        raise InputError(f"{path}: {problem}; the file is corrupt: download it again")
    return start + lo, hi - lo


def write_shard(dest: Path, source: Optional[Path], order: list[tuple[str, object]], metadata: Optional[dict]) -> int:
    """Write a safetensors file at ``dest`` (fsynced) and return its size.

    ``order`` lists the tensors in file order: ``(name, None)`` copies that tensor's bytes unchanged from ``source``;
    ``(name, FileTensor(path, other))`` copies tensor ``other``'s bytes from the safetensors file ``path``;
    ``(name, tensor)`` writes a new one. ``metadata`` is the header's ``__metadata__`` (kept from the source shard).
    Every copied tensor's offsets are checked against its dtype, shape and file before ``dest`` is created
    (InputError naming the file and tensor); bytes move through one 16 MiB buffer, so memory does not grow with the
    file. An OSError names ``dest`` when writing it failed (a full disk).
    """
    headers: dict[Path, tuple[dict, int, int]] = {}

    def header_of(path: Path) -> tuple[dict, int, int]:
        if path not in headers:
            h, start = read_header(path)
            headers[path] = (h, start, path.stat().st_size)
        return headers[path]

    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    plan: list[tuple[object, int, int]] = []  # (tensor or file, file offset, bytes)
    for name, item in order:
        if item is None or isinstance(item, FileTensor):
            path, other = (source, name) if item is None else (item.path, item.name)
            assert path is not None
            h, start, size = header_of(Path(path))
            at, nbytes = _span(Path(path), h, start, size, other)
            header[name] = {"dtype": h[other]["dtype"], "shape": h[other]["shape"],
                            "data_offsets": [offset, offset + nbytes]}
            plan.append((Path(path), at, nbytes))
        else:
            assert isinstance(item, torch.Tensor)
            nbytes = item.numel() * item.element_size()
            header[name] = {"dtype": DTYPE_CODES[item.dtype], "shape": list(item.shape),
                            "data_offsets": [offset, offset + nbytes]}
            plan.append((item, 0, nbytes))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    try:
        with open(dest, "wb") as out:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            src, src_path = None, None
            try:
                for item, at, nbytes in plan:
                    if isinstance(item, torch.Tensor):
                        out.write(item.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                        continue
                    if item != src_path:
                        if src is not None:
                            src.close()
                        src, src_path = open(item, "rb"), item
                    src.seek(at)
                    left = nbytes
                    while left:
                        chunk = src.read(min(left, 1 << 24))
                        if not chunk:
                            raise InputError(f"{item}: ends inside a tensor; the file is truncated")
                        out.write(chunk)
                        left -= len(chunk)
            finally:
                if src is not None:
                    src.close()
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:  # a buffered write's error names no file
            raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(dest)) from exc
        raise
    return dest.stat().st_size
