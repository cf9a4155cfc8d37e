"""How the fork loads and slices a module stored as EXL3 at a TP size: the one rule `hydrate` stores by and `cache
check` (and a warm's plan notes) judge a checkpoint's stored modules by. Torch-free: shapes only.

Ground truth: the fork's ``vllm/model_executor/layers/quantization/exl3.py`` (local-inference-lab/vllm; the version
docs/hydrate.md names). Every stored matrix is full-size in the checkpoint and each rank narrows its own slice:

* ``Exl3LinearMethod`` (every linear of the model and a stored ``lm_head``): ``_validate_loaded_tensors`` wants each
  source matrix's K and N 128-aligned; ``_shard_tensors_for_tensor_parallel`` narrows a row-parallel layer's ``suh``
  and trellis rows at ``rank * K_r`` and a column-parallel shard's ``svh`` and trellis columns at ``shard_rank * size``
  (k and v: ``rank // replicas``; ``in_proj_qkvz``'s shard ``(0, 1, 2)`` per part, ``_expand_tuple_output_shards``),
  every start and size a multiple of 128 (``_slice_exl3_tensor``); a replicated layer is never sliced. One shard per
  checkpoint matrix (``_shard_ids_for_layer``, ``_source_prefixes_for_layer``).
* ``Exl3MoEMethod`` (routed experts of a standard EXL3 checkpoint): ``_shard_tensors_for_tensor_parallel`` narrows
  every expert's gate/up columns and down rows at ``rank * I_r`` (``intermediate_size_per_partition``) through
  ``_slice_exl3_tensor``; an r7 checkpoint's experts are narrowed while they stream in, then
  ``_validate_moe_shapes`` wants them 128-aligned. Rank-sliced checkpoints hold per-rank payloads: never sliced.
* ``ParallelLMHead``: vLLM pads the vocabulary to a multiple of 64 and gives each rank ``padded / W`` rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from exl3tool.checkpoint.partition import ALIGN, qkv_partition

PlannedLayer = Any  # a checkpoint.plan.PlannedLayer (not imported: plan builds the stored modules judged here)

__all__ = ["SourceModule", "StoredModule", "stored_module", "source_modules", "shard_groups", "storage_problem",
           "slicing_problem", "tp_problems", "hydration_problem", "stored_problem", "shards_match", "VOCAB_PADDING",
           "load_order"]

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: ParallelLMHead pads the vocabulary to a multiple of it


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def load_order(prefix: str) -> tuple[int, int]:
    """Where a module comes in the order the server slices stored modules (vLLM's loader processes each module
    after loading, in the model's module order): decoder layer by layer, the ``lm_head`` last, anything outside the
    layers first. Sort stably by it (a layer's linears before its routed experts): the first module a TP size
    cannot slice is the one whose error the server raises."""
    if prefix == "lm_head" or prefix.endswith(".lm_head"):
        return (2, 0)
    m = _LAYER_INDEX.search(prefix)
    return (1, int(m.group(1))) if m else (0, 0)


def stored_module(name: str) -> str:
    """The checkpoint module of a ``.weight`` (or a stored ``.trellis``) tensor: the prefix its EXL3 tensors and
    record are keyed by."""
    return name.removesuffix(".weight").removesuffix(".trellis")


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


def shards_match(layer: PlannedLayer, sources: list[SourceModule]) -> bool:
    """Whether the layer's checkpoint sources are the shards the fork loads (``_shard_ids_for_layer``): one
    checkpoint matrix per shard, holding that shard's parts."""
    groups = shard_groups(layer)
    return not layer.fused_source and len(groups) == len(sources) and all(
        tuple(s.parts) == g for s, g in zip(sources, groups, strict=True))


def _kernel_error(k: int, n: int) -> str:
    """The fork's own message (``Exl3LinearMethod._validate_loaded_tensors``) for a stored matrix not 128-aligned."""
    return f"EXL3 kernel dimensions must be {ALIGN}-aligned, got K={k}, N={n}"


def _alignment_problem(module: str, k: int, n: int) -> Optional[str]:
    bad = [f"{what} {v}" for what, v in (("K", k), ("N", n)) if v % ALIGN]
    if not bad:
        return None
    return (f"{module}: {' and '.join(bad)} not a multiple of {ALIGN}; the fork refuses a stored EXL3 matrix that is "
            f"not 128-aligned (\"{_kernel_error(k, n)}\")")


def storage_problem(layer: PlannedLayer, sources: list[SourceModule]) -> Optional[str]:
    """Why this layer cannot be stored as EXL3 at any TP size, or None: its checkpoint sources must be the shards
    the fork loads (``_shard_ids_for_layer``), each full matrix 128-aligned (``_validate_loaded_tensors``)."""
    if not shards_match(layer, sources):
        held = ", ".join(f"{s.module} holds {len(s.parts)} part(s)" for s in sources)
        return (f"the checkpoint's sources do not match the shards the fork loads for {layer.prefix} ({held}); "
                "a stored EXL3 module needs one checkpoint matrix per shard")
    for s in sources:
        why = _alignment_problem(s.module, s.in_features, s.out_features)
        if why:
            return why
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
# the modules a checkpoint stores as EXL3, as a server loads them


@dataclass(frozen=True)
class StoredModule:
    """A module the checkpoint stores as EXL3 that a server builds (``LayerPlan.stored``), with what its slicing
    needs: a linear (``layer`` and its stored ``sources``), a layer's routed experts (``rows``: the intermediate size
    I, ``streamed``: an r7 layout narrowed while it loads) or the ``lm_head`` (``rows``: the vocabulary rows stored,
    ``padded``: vLLM's padded vocabulary). ``unknown``: a layout the fork's loader is not modelled for (why)."""

    prefix: str  # the server's (vLLM) name
    kind: str  # "linear" | "experts" | "lm_head"
    layer: Optional[PlannedLayer] = None
    sources: tuple[SourceModule, ...] = ()
    rows: int = 0
    padded: int = 0
    in_features: int = 0
    streamed: bool = False
    unknown: str = ""


def stored_problem(m: StoredModule, tp: int) -> Optional[str]:
    """Why a server at TP ``tp`` fails to load the stored module ``m`` ("the module's own words (the server's error
    in quotes)"), or None when it loads it. ``m.unknown`` is not judged here (the caller says it cannot tell)."""
    if m.unknown:
        return None
    if m.kind == "linear":
        assert m.layer is not None
        sources = list(m.sources)
        return storage_problem(m.layer, sources) or slicing_problem(m.layer, sources, tp)
    if m.kind == "experts":
        if tp == 1:
            return None
        i = m.rows
        if i % tp:
            return (f"the experts' intermediate size {i} is not divisible by TP {tp}; vLLM cannot shard them at "
                    "that size")
        size = i // tp
        if size % ALIGN == 0:
            return None
        server = ("Invalid EXL3 MoE tensors for expert=0, projection=w1" if m.streamed
                  else _slice_error("output", 0, size))
        return (f"at TP {tp} each rank's slice of the experts' intermediate size is I/{tp} = {size} rows, not a "
                f"multiple of {ALIGN} (the server fails to load them: \"{server}\")")
    if m.kind == "lm_head":
        why = _alignment_problem(f"its stored matrix [{m.in_features} x {m.rows}]", m.in_features, m.rows)
        if why or tp == 1:
            return why
        if m.padded % tp:
            return (f"the padded vocabulary {m.padded} is not divisible by TP {tp}; vLLM cannot shard the head at "
                    "that size")
        size = m.padded // tp
        for rank in range(tp):
            start = rank * size
            if start % ALIGN or size % ALIGN:
                return (f"at TP {tp} rank {rank}'s slice of the padded vocabulary ({m.padded} rows) starts at row "
                        f"{start} with {size} rows, not {ALIGN}-aligned (the server fails to load it: "
                        f"\"{_slice_error('output', start, size)}\")")
            if start + size > m.rows:
                return (f"at TP {tp} rank {rank}'s slice of the padded vocabulary ({m.padded} rows) runs past the "
                        f"{m.rows} rows stored (the server fails to load it: \"start ({start // 16}) + length "
                        f"({size // 16}) exceeds dimension size ({m.rows // 16}).\")")
        return None
    raise ValueError(f"{m.prefix}: unknown stored module kind {m.kind!r}")
