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
  in 128-blocks (``_shard_tensors_for_tensor_parallel``): ``hydration_problem`` says where that cannot work.

Also: ``write_shard`` streams a safetensors file whose kept tensors are copied byte for byte from the source shard.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch

from exl3tool.checkpoint.plan import ALIGN, PlannedLayer, qkv_partition
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


def stored_module(weight_name: str) -> str:
    """The checkpoint module of a ``.weight`` tensor: the prefix its EXL3 tensors and record are keyed by."""
    return weight_name.removesuffix(".weight")


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
# which layers can be stored, and at which TP sizes


@dataclass(frozen=True)
class SourceModule:
    """One checkpoint matrix of a planned layer: its ``.weight`` tensor, shape and the fused parts it holds."""

    weight: str
    module: str
    in_features: int
    out_features: int
    parts: tuple[int, ...]  # indices into the layer's part_sizes
    offsets: tuple[int, ...]  # first row of each part in this source


def source_modules(layer: PlannedLayer, rows: dict[str, int]) -> list[SourceModule]:
    """The layer's sources with the parts each holds (``rows``: output rows of each source tensor)."""
    held: dict[int, list[tuple[int, int]]] = {}
    for j in range(len(layer.part_sizes)):
        s, first = layer.part_location(j)
        held.setdefault(s, []).append((j, first))
    out = []
    for s, name in enumerate(layer.sources):
        parts = held.get(s, [])
        out.append(SourceModule(name, stored_module(name), layer.in_features, rows[name],
                                tuple(j for j, _ in parts), tuple(o for _, o in parts)))
    return out


def shard_groups(layer: PlannedLayer) -> list[tuple[int, ...]]:
    """The shard ids ``Exl3LinearMethod._shard_ids_for_layer`` gives the fused module, as groups of part indices:
    one part per shard, except ``in_proj_qkvz`` whose first source holds q, k and v (shard ``(0, 1, 2)``)."""
    n = len(layer.part_sizes)
    if n == 1:
        return [(0,)]
    if layer.prefix.endswith("in_proj_qkvz") and n == 4:
        return [(0, 1, 2), (3,)]
    return [(j,) for j in range(n)]


def _part_rank_slices(layer: PlannedLayer, tp: int, part: int) -> list[tuple[int, int]]:
    """``(start, size)`` of a column-sliced part on every rank, within the part's full rows (the fork's starts)."""
    if layer.parallel == "qkv":
        out = []
        for r in range(tp):
            heads_r, kv_r, _, kr = qkv_partition(layer, tp, r)
            hd, vhd = layer.head_dim or 0, layer.v_head_dim or 0
            size = (heads_r * hd, kv_r * hd, kv_r * vhd)[part]
            out.append(((r if part == 0 else kr) * size, size))
        return out
    n = layer.part_sizes[part]
    return [(r * (n // tp), n // tp) for r in range(tp)]


def storage_problem(layer: PlannedLayer, sources: list[SourceModule]) -> Optional[str]:
    """Why this layer cannot be stored as EXL3 at any TP size, or None: its checkpoint sources must be the shards
    the fork loads (``_shard_ids_for_layer``), each full matrix 128-aligned (``_validate_loaded_tensors``)."""
    groups = shard_groups(layer)
    if layer.fused_source or len(groups) != len(sources) or any(
            tuple(s.parts) != g for s, g in zip(sources, groups, strict=True)):
        held = ", ".join(f"{s.module} holds {len(s.parts)} part(s)" for s in sources)
        return (f"the checkpoint's sources do not match the shards the fork loads for {layer.prefix} ({held}); "
                "a stored EXL3 module needs one checkpoint matrix per shard")
    for s in sources:
        bad = [f"{what} {n}" for what, n in (("K", s.in_features), ("N", s.out_features)) if n % ALIGN]
        if bad:
            return (f"{s.module}: {' and '.join(bad)} not a multiple of {ALIGN}; the fork refuses a stored EXL3 "
                    f"matrix that is not 128-aligned (\"EXL3 kernel dimensions must be {ALIGN}-aligned, got "
                    f"K={s.in_features}, N={s.out_features}\")")
    return None


def _slice_error(axis: str, start: int, size: int) -> str:
    """The fork's own message (``Exl3LinearMethod._slice_exl3_tensor``) for a slice that is not 128-aligned."""
    return f"EXL3 TP {axis} slice must be {ALIGN}-aligned, got start={start}, size={size}"


def slicing_problem(layer: PlannedLayer, sources: list[SourceModule], tp: int) -> Optional[str]:
    """Why a server at TP ``tp`` fails to load this layer stored as EXL3 (ours, then the server's error in quotes),
    or None when it loads. The fork (``_shard_tensors_for_tensor_parallel``) narrows row-parallel layers' ``suh`` and
    trellis rows at ``rank * K_r`` and column-parallel parts' ``svh`` and trellis columns at ``shard_rank * size``
    (k and v: ``rank // replicas``), every start and size 128-aligned, ranks in order; replicated layers are never
    sliced. A fused part every rank holds whole is sliced anyway: rank 1's narrow runs past its end."""
    if tp == 1 or layer.parallel == "replicated":
        return None
    if layer.parallel == "row":
        k_r = layer.in_features // tp
        if layer.in_features % tp or k_r % ALIGN:
            return (f"at TP {tp} each rank's input slice is K/{tp} = {layer.in_features / tp:g} columns, not a "
                    f"multiple of {ALIGN} (the server fails to load it: \"{_slice_error('input', 0, k_r)}\")")
        return None
    if layer.replicated_parts:
        part = layer.replicated_parts[0]
        n = layer.part_sizes[part]
        return (f"at TP {tp} the fork would slice a fused part every rank holds whole (part {part}; the server "
                f"fails to load it: \"start ({n}) + length ({n}) exceeds dimension size ({n}).\" on rank 1)")
    for rank in range(tp):
        for s in sources:
            for part, offset in zip(s.parts, s.offsets, strict=True):
                start, size = _part_rank_slices(layer, tp, part)[rank]
                if (offset + start) % ALIGN or size % ALIGN:
                    return (f"{s.module}: at TP {tp} rank {rank}'s output slice starts at row {offset + start} with "
                            f"{size} rows, not {ALIGN}-aligned (the server fails to load it: "
                            f"\"{_slice_error('output', offset + start, size)}\")")
    return None


def tp_problems(layer: PlannedLayer, sources: list[SourceModule], tp_sizes: Iterable[int]) -> dict[int, str]:
    """``slicing_problem`` at each of ``tp_sizes`` where there is one: TP size -> why."""
    out = {}
    for tp in sorted(set(tp_sizes)):
        why = slicing_problem(layer, sources, tp)
        if why:
            out[tp] = why
    return out


def hydration_problem(layer: PlannedLayer, sources: list[SourceModule], tp_sizes: Iterable[int]) -> Optional[str]:
    """Why this layer cannot be stored as EXL3 for a server at one of ``tp_sizes``, or None when it can: its
    ``storage_problem``, else its ``slicing_problem`` at the first TP size where it has one."""
    why = storage_problem(layer, sources)
    if why:
        return why
    problems = tp_problems(layer, sources, tp_sizes)
    return next(iter(problems.values())) if problems else None


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
