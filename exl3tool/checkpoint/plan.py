"""Which linear layers the server encodes online, with their vLLM prefixes and rank-local sizes.

``plan_layers`` reads the config, the checkpoint's EXL3 metadata and tensor headers (no weights). It routes every
module of the architecture's table as the server does (``serving.route_family``: stored as EXL3, spec, ignore),
reads the planned modules' shapes, and returns a ``LayerPlan``. ``LayerPlan.for_tp(W)`` expands it into one
``RankJob`` per layer and rank (the key's ``tp_rank``, ``input_size = K_r``, ``output_size = N_r``); ``skipped(W)``
lists the ranks the server keeps off the cache because of the 128-alignment rule; ``excluded`` lists the modules
the server builds with the quant config but does not encode, with the reason.

With ``layers`` globs the planner also runs where the server would not look anything up (an architecture without a
table, a checkpoint the server refuses): ``server_lookup`` is then False and ``notes`` says why.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from exl3tool.checkpoint.partition import ALIGN, qkv_partition
from exl3tool.checkpoint.families import SUPPORTED_ARCHITECTURES, Family, ModuleTemplate, family_for, text_config
from exl3tool.checkpoint.overlay import Overlay, is_shared_expert_projection, resolve_overlay
from exl3tool.checkpoint.routing import (
    CheckpointKind, Route, StorageMap, read_json, route_family, serving_view,
)
from exl3tool.checkpoint.source import QUANT_CONFIG, Checkpoint
from exl3tool.errors import ConfigError, InputError
from exl3tool.releases import ServerRelease

__all__ = ["PlannedLayer", "RankJob", "LayerPlan", "Excluded", "plan_layers", "rank_sizes", "qkv_partition", "ALIGN",
           "is_shared_expert_projection", "tensors_to_fetch"]

PARALLEL_STYLES = ("qkv", "merged_column", "column", "row", "replicated")


@dataclass(frozen=True)
class PlannedLayer:
    """One server linear module: its prefix, parallel style and full (unsharded) shape.

    ``sources`` are checkpoint tensor names; ``part_sizes`` the output rows of each fused part (q, k, v / gate, up /
    ...). ``part_sources`` says where part ``j`` lives: ``(source index, first row in that source)``; by default
    part ``j`` is source ``j`` (or, for one pre-fused source, the parts stacked in it). ``replicated_parts`` are
    parts every rank holds whole (a merged layer's replicated shard).
    """

    prefix: str
    parallel: str
    sources: tuple[str, ...]
    part_sizes: tuple[int, ...]
    in_features: int
    out_features: int
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    v_head_dim: int | None = None
    part_sources: tuple[tuple[int, int], ...] | None = None
    replicated_parts: tuple[int, ...] = ()
    spec: str = "linear"  # "linear" | "shared_experts" (the overlay spec that covers it) | "generic" (--layers)

    @property
    def fused_source(self) -> bool:
        """True when one checkpoint tensor holds several fused parts (a pre-fused qkv_proj / gate_up_proj)."""
        return len(self.sources) == 1 and len(self.part_sizes) > 1

    def part_location(self, part: int) -> tuple[int, int]:
        """``(source index, first row)`` of fused part ``part``."""
        if self.part_sources is not None:
            return self.part_sources[part]
        if self.fused_source:
            return 0, sum(self.part_sizes[:part])
        return part, 0


@dataclass(frozen=True)
class RankJob:
    """One cache entry to produce: a layer on one TP rank, with the key's rank-local sizes."""

    layer: PlannedLayer
    tp_size: int
    tp_rank: int
    input_size: int  # K_r
    output_size: int  # N_r

    @property
    def prefix(self) -> str:
        return self.layer.prefix

    @property
    def aligned(self) -> bool:
        """Whether the server would look this entry up at all (K_r and N_r multiples of 128)."""
        return self.input_size % ALIGN == 0 and self.output_size % ALIGN == 0


@dataclass(frozen=True)
class Excluded:
    """A module the model builds with the quant config that the server does not encode online, and why."""

    prefix: str
    reason: str  # "stored_exl3" | "no_spec" | "ignored" | "excluded" | "not_modelled"
    detail: str = ""


def _unplanned_vision_tower(checkpoint: Checkpoint, family: Family, cfg: dict, storage: StorageMap,
                            overlay: Overlay) -> str:
    """Why the server will encode a vision tower exl3tool does not plan, or "" when it will not.

    A family with ``unplanned_vision`` (Qwen3.5/3.8 ``*ForConditionalGeneration``: ``qwen3_vl.py``'s blocks and
    merger) builds its vision tower with the quant config, so an overlay with a ``linear`` spec that does not
    ignore it has the server encode those linears online. exl3tool has no table for the tower: each is a miss.
    """
    probe = family.unplanned_vision
    if not probe or overlay.linear is None:
        return ""
    if overlay.ignores(probe, family.packed(cfg)) or storage.is_exl3(probe):
        return ""
    if not any(name.startswith(("model.visual.", "visual.")) for name in checkpoint.index_names()):
        return ""
    return ("the vision tower (visual.*) is built with the quant config and this overlay does not ignore it, so "
            "the server encodes its linears online at start-up; exl3tool has no plan for them, so those look-ups "
            "miss. Add \"re:.*visual\\\\..*\" to the overlay's ignore list, as the deployed Qwen3.8 recipe does, "
            "or accept the server's online encode of the vision layers")


def _check_tp(tp_size: int) -> None:
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ConfigError(f"tensor-parallel size must be a positive integer, got {tp_size!r}")


def _divide(layer: PlannedLayer, what: str, n: int, tp_size: int) -> int:
    if n % tp_size:
        raise ConfigError(
            f"{layer.prefix}: {what} {n} is not divisible by tensor-parallel size {tp_size}; "
            "vLLM cannot shard this layer at that size"
        )
    return n // tp_size


def rank_sizes(layer: PlannedLayer, tp_size: int) -> tuple[int, int]:
    """``(K_r, N_r)`` on every rank (the same on all ranks), or ConfigError where vLLM itself would fail."""
    _check_tp(tp_size)
    if layer.parallel == "qkv":
        heads_r, kv_r, _, _ = qkv_partition(layer, tp_size, 0)
        assert layer.head_dim is not None and layer.v_head_dim is not None
        return layer.in_features, (heads_r + kv_r) * layer.head_dim + kv_r * layer.v_head_dim
    if layer.parallel == "merged_column":
        return layer.in_features, sum(
            n if j in layer.replicated_parts else _divide(layer, f"output part {j} size", n, tp_size)
            for j, n in enumerate(layer.part_sizes))
    if layer.parallel == "column":
        return layer.in_features, _divide(layer, "out_features", layer.out_features, tp_size)
    if layer.parallel == "row":
        return _divide(layer, "in_features", layer.in_features, tp_size), layer.out_features
    if layer.parallel == "replicated":
        return layer.in_features, layer.out_features
    raise ValueError(f"{layer.prefix}: unknown parallel style {layer.parallel!r}; expected one of {PARALLEL_STYLES}")


def _skip_reason(k_r: int, n_r: int) -> str | None:
    bad = [f"{what} {n} is not a multiple of {ALIGN}" for what, n in (("K_r", k_r), ("N_r", n_r)) if n % ALIGN]
    if not bad:
        return None
    return ("; ".join(bad) + "; the server leaves this layer unencoded (MXFP8 online method), no cache entry (a "
            "K_r that is not a multiple of 32 fails the server's start: cache check says so)")


@dataclass(frozen=True)
class LayerPlan:
    """The planned layers of one checkpoint, in model order, and how the server sees the checkpoint."""

    layers: tuple[PlannedLayer, ...]
    architecture: str | None
    serialized: tuple[str, ...] = ()  # prefixes the checkpoint already stores as EXL3: served as-is, never cached
    excluded: tuple[Excluded, ...] = ()
    overlay: Optional[Overlay] = None
    kind: Optional[CheckpointKind] = field(default=None, compare=False)
    server_lookup: bool = True  # False: generic --layers mode, entries the server does not look up
    family: Optional[Family] = field(default=None, compare=False, repr=False)
    notes: tuple[str, ...] = ()
    text: Optional[dict] = field(default=None, compare=False, repr=False)
    # the modules the checkpoint stores as EXL3 that the server builds (``checkpoint.slicing.StoredModule``): every
    # rank slices them at start-up, whatever the plan holds (``start_problem``)
    stored: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    def check_tp(self, tp_size: int) -> None:
        """ConfigError where the server refuses this TP size (rank-sliced kinds) or vLLM cannot shard the model."""
        _check_tp(tp_size)
        if self.server_lookup and self.kind is not None:
            why = self.kind.tp_refusal(tp_size)
            if why:
                raise ConfigError(why)
        if self.family is not None and self.family.tp_check is not None and self.text is not None:
            why = self.family.tp_check(self.text, tp_size)
            if why:
                raise ConfigError(f"{why}; vLLM cannot shard this model at tensor-parallel size {tp_size}")

    def shard_problem(self, tp_size: int) -> Optional[str]:
        """Why vLLM cannot split this model at ``tp_size`` (``check_tp``'s refusal, or a planned layer whose heads,
        KV heads or parts do not divide by it), or None when it can."""
        try:
            self.check_tp(tp_size)
            for layer in self.layers:
                rank_sizes(layer, tp_size)
            for m in self.stored:
                if m.layer is not None and not m.unknown:
                    rank_sizes(m.layer, tp_size)
        except ConfigError as exc:
            return str(exc)
        return None

    def shardable_tp_sizes(self, up_to: int = 8) -> tuple[int, ...]:
        """The TP sizes from 1 to ``up_to`` vLLM can split this model into (``shard_problem`` says why not the
        others)."""
        return tuple(tp for tp in range(1, up_to + 1) if self.shard_problem(tp) is None)

    def start_problem(self, tp_size: int) -> Optional[str]:
        """Why a server at ``tp_size`` fails to load a module the checkpoint stores as EXL3 ("PREFIX: why (the
        server's error)", the first one in model order; ``checkpoint.slicing.stored_problem``: the fork's slicing
        rules), or None. Modules whose layout is not modelled are ``stored_unknown``'s, not judged here."""
        found = self.stored_failure(tp_size)
        return f"{found[0].prefix}: {found[1]}" if found is not None else None

    def stored_failure(self, tp_size: int) -> Optional[tuple[Any, str]]:
        """``(StoredModule, why)`` of the first stored module a server at ``tp_size`` fails to load (in the order
        it slices them: ``slicing.load_order``), or None."""
        found = self.stored_failures(tp_size)
        return found[0] if found else None

    def stored_failures(self, tp_size: int) -> list[tuple[Any, str]]:
        """``(StoredModule, why)`` of every stored module a server at ``tp_size`` fails to load, in load order."""
        from exl3tool.checkpoint.slicing import stored_problem

        out = []
        for m in self.stored:
            try:
                why = stored_problem(m, tp_size)
            except ConfigError:  # vLLM cannot split the model there at all: ``shard_problem`` says so
                continue
            if why:
                out.append((m, why))
        return out

    def stored_unknown(self) -> list[Any]:
        """The stored modules whose layout the fork's loader is not modelled for (``StoredModule.unknown``)."""
        return [m for m in self.stored if m.unknown]

    def startable_tp_sizes(self, up_to: int = 8) -> tuple[int, ...]:
        """The TP sizes from 1 to ``up_to`` a server of this checkpoint starts at: vLLM can split the model there
        (``shard_problem``) and every rank slices each module the checkpoint stores as EXL3 (``start_problem``)."""
        return tuple(tp for tp in range(1, up_to + 1)
                     if self.shard_problem(tp) is None and self.start_problem(tp) is None)

    def for_tp(self, tp_size: int, *, include_skipped: bool = False) -> list[RankJob]:
        """One job per layer and rank ``0..W-1``; ranks the server never caches (6.3) only if asked."""
        self.check_tp(tp_size)
        jobs: list[RankJob] = []
        for layer in self.layers:
            k_r, n_r = rank_sizes(layer, tp_size)
            if include_skipped or _skip_reason(k_r, n_r) is None:
                jobs += [RankJob(layer, tp_size, r, k_r, n_r) for r in range(tp_size)]
        return jobs

    def skipped(self, tp_size: int) -> list[tuple[str, int, str]]:
        """``(prefix, rank, reason)`` for every rank whose K_r or N_r is not 128-aligned at this TP size."""
        self.check_tp(tp_size)
        out: list[tuple[str, int, str]] = []
        for layer in self.layers:
            reason = _skip_reason(*rank_sizes(layer, tp_size))
            if reason is not None:
                out += [(layer.prefix, r, reason) for r in range(tp_size)]
        return out


# ---------------------------------------------------------------------------------------------------------
# shapes


def _matches(name: str, globs: Iterable[str] | None) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in globs or ())


def _weight_shape(checkpoint: Checkpoint, name: str) -> tuple[int, int]:
    info = checkpoint.info(name)
    if len(info.shape) != 2 or not info.is_float:
        raise InputError(f"{info.file}: {name} is {info.dtype_code} {list(info.shape)}, "
                         "expected a 2-D F16/BF16/F32 weight")
    return info.shape[0], info.shape[1]


def _int_field(checkpoint: Checkpoint, cfg: dict, name: str, arch: str) -> int:
    value = cfg.get(name)
    if value is None:
        raise InputError(f"{checkpoint.root / 'config.json'}: missing field {name!r}, needed to plan {arch} layers")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InputError(f"{checkpoint.root / 'config.json'}: field {name!r} must be a positive integer, got {value!r}")
    return value


def _checkpoint_layers(family: Family, names: Iterable[str]) -> str:
    """Where this checkpoint keeps the decoder layers (the family's candidates, first with tensors)."""
    names = list(names)
    for prefix in family.checkpoint_layers:
        if any(n.startswith(f"{prefix}.") for n in names):
            return prefix
    return family.checkpoint_layers[0]


def _source_candidates(family: Family, base: str, source: str, suffix: str = "weight") -> list[str]:
    return [f"{base}.{source}.{suffix}"] + [f"{base}.{alt}.{suffix}" for src, alt in family.aliases if src == source]


def _heads(checkpoint: Checkpoint, family: Family, cfg: dict, arch: str) -> tuple[int, int, int]:
    hidden = _int_field(checkpoint, cfg, "hidden_size", arch)
    num_heads = _int_field(checkpoint, cfg, "num_attention_heads", arch)
    num_kv = _int_field(checkpoint, cfg, "num_key_value_heads", arch) if cfg.get("num_key_value_heads") else num_heads
    if cfg.get("head_dim") is None and hidden % num_heads:
        raise InputError(f"{checkpoint.root / 'config.json'}: no 'head_dim', and hidden_size {hidden} is not "
                         f"divisible by num_attention_heads {num_heads}; add head_dim to the config")
    if num_heads % num_kv:
        raise InputError(f"{checkpoint.root / 'config.json'}: num_attention_heads {num_heads} is not a multiple of "
                         f"num_key_value_heads {num_kv}")
    return family.heads(cfg)


def _shape_refusal(checkpoint: Checkpoint, name: str, found: tuple[int, int], expected: tuple, prefix: str,
                   why: str) -> str:
    """One line: the tensor, its file, the shape found and the shape config.json gives (``None``: any size)."""
    want = ", ".join("*" if d is None else str(d) for d in expected)
    return (f"{checkpoint.info(name).file}: {name} is [{found[0]}, {found[1]}] but config.json gives [{want}] for "
            f"{prefix} ({why}); the weight is not the layer config.json describes (transposed, or another model's "
            "config): fix the checkpoint or its config.json")


def _check_config_shapes(checkpoint: Checkpoint, family: Family, cfg: dict, arch: str, tpl: ModuleTemplate,
                         prefix: str, sources: tuple[str, ...], shapes: list[tuple[int, int]]) -> None:
    """Every source's ``[out, in]`` against config.json before anything is planned from it: a module that reads the
    hidden state has ``hidden_size`` columns (a low-rank latent: the template's ``inputs``), a row-parallel one
    writes ``hidden_size`` rows, and q / k of an attention layer have the config's heads x head_dim rows. A weight
    stored transposed is refused here, never encoded in the wrong orientation."""
    hidden = _int_field(checkpoint, cfg, "hidden_size", arch)
    if tpl.inputs is not None:
        cols, col_why = tpl.inputs(cfg), "its input is a low-rank latent of config.json"
    elif tpl.parallel == "row":
        cols, col_why = None, ""
    else:
        cols, col_why = hidden, f"columns: hidden_size {hidden}"
    rows_of: list[tuple[Optional[int], str]] = [(hidden, f"rows: hidden_size {hidden}") if tpl.parallel == "row"
                                                else (None, "")] * len(sources)
    if tpl.parallel == "qkv" and len(sources) == 3:
        heads, kv, head_dim = _heads(checkpoint, family, cfg, arch)
        rows_of[0] = (heads * head_dim, f"rows: {heads} heads x head_dim {head_dim}")
        rows_of[1] = (kv * head_dim, f"rows: {kv} KV heads x head_dim {head_dim}")
    for name, found, (rows, row_why) in zip(sources, shapes, rows_of, strict=True):
        if (rows is not None and found[0] != rows) or (cols is not None and found[1] != cols):
            why = "; ".join(w for w in (row_why, col_why) if w)
            raise InputError(_shape_refusal(checkpoint, name, found, (rows, cols), prefix, why))


def _plan_route(checkpoint: Checkpoint, family: Family, cfg: dict, arch: str, route: Route,
                ckpt_layers: str) -> PlannedLayer | None:
    """Shapes of one planned module from the tensor headers; None when an optional module is absent."""
    tpl: ModuleTemplate = route.template
    base = f"{ckpt_layers}.{route.layer}"
    found = [next((n for n in _source_candidates(family, base, s) if checkpoint.has_tensor(n)), None)
             for s in tpl.sources]
    fused = f"{base}.{tpl.name}.weight"
    if all(found):
        sources = tuple(n for n in found if n)
    elif not any(found) and len(tpl.sources) > 1 and checkpoint.has_tensor(fused):
        sources = (fused,)
    elif not any(found) and not tpl.required:
        return None
    else:
        missing = f"{base}.{tpl.sources[found.index(None)]}.weight"
        also = f" (nor a fused {fused})" if len(tpl.sources) > 1 else ""
        raise InputError(f"{checkpoint.root}: checkpoint has no tensor {missing!r}{also}, needed for {route.prefix} "
                         "(not stored as EXL3, so the server loads it as BF16)")
    shapes = [_weight_shape(checkpoint, n) for n in sources]
    _check_config_shapes(checkpoint, family, cfg, arch, tpl, route.prefix, sources, shapes)
    return _route_layer(checkpoint, family, cfg, arch, route, sources, shapes, fused)


def _route_layer(checkpoint: Checkpoint, family: Family, cfg: dict, arch: str, route: Route,
                 sources: tuple[str, ...], shapes: list[tuple[int, int]], fused: str) -> PlannedLayer:
    """The ``PlannedLayer`` of a routed module whose checkpoint matrices ``sources`` are ``shapes`` ([out, in]):
    its parallel style, fused parts and where each lives (a BF16 weight's, or a stored EXL3 matrix's)."""
    tpl: ModuleTemplate = route.template
    in_features = shapes[0][1]
    for n, (_, k) in zip(sources, shapes, strict=True):
        if k != in_features:
            raise InputError(f"{checkpoint.root}: {n} has {k} input features, {sources[0]} has {in_features}; "
                             f"they cannot be fused into {route.prefix}")
    out_features = sum(s[0] for s in shapes)
    common = dict(spec=route.spec or "linear", replicated_parts=tpl.replicated_parts)

    if tpl.parallel == "qkv":
        num_heads, num_kv, head_dim = _heads(checkpoint, family, cfg, arch)
        q_rows, k_rows = num_heads * head_dim, num_kv * head_dim
        v_rows = out_features - q_rows - k_rows
        if v_rows <= 0 or v_rows % num_kv:
            raise InputError(
                f"{checkpoint.root}: {route.prefix} has {out_features} output rows, which do not split into q "
                f"{q_rows}, k {k_rows} and v for {num_kv} KV heads; check num_attention_heads, num_key_value_heads "
                "and head_dim"
            )
        return PlannedLayer(route.prefix, "qkv", sources, (q_rows, k_rows, v_rows), in_features, out_features,
                            num_heads, num_kv, head_dim, v_rows // num_kv, **common)

    if tpl.parts is None:
        if len(sources) == 1 and len(tpl.sources) > 1:  # pre-fused merged column: equal parts (gate, up)
            if out_features % len(tpl.sources):
                raise InputError(f"{checkpoint.root}: fused {fused} has {out_features} rows, "
                                 f"not divisible into {len(tpl.sources)} equal parts")
            part_sizes = (out_features // len(tpl.sources),) * len(tpl.sources)
        else:
            part_sizes = tuple(s[0] for s in shapes)
        return PlannedLayer(route.prefix, tpl.parallel, sources, part_sizes, in_features, out_features, **common)

    part_sizes = tuple(tpl.parts(cfg))
    if len(sources) == 1 and len(part_sizes) > 1:  # one tensor holds every part, stacked in order
        counts = (len(part_sizes),)
    else:
        counts = tpl.source_parts or (1,) * len(sources)
    if sum(counts) != len(part_sizes) or len(counts) != len(sources):
        raise ValueError(f"{route.prefix}: template parts {part_sizes} do not fit sources {sources}")
    part_sources: list[tuple[int, int]] = []
    j = 0
    for s, (name, count) in enumerate(zip(sources, counts, strict=True)):
        want = sum(part_sizes[j:j + count])
        if shapes[s][0] != want:
            raise InputError(_shape_refusal(checkpoint, name, shapes[s], (want, None), route.prefix,
                                            f"rows {' + '.join(map(str, part_sizes[j:j + count]))}"))
        offset = 0
        for n in part_sizes[j:j + count]:
            part_sources.append((s, offset))
            offset += n
        j += count
    return PlannedLayer(route.prefix, tpl.parallel, sources, part_sizes, in_features, out_features,
                        part_sources=tuple(part_sources), **common)


# ---------------------------------------------------------------------------------------------------------
# the modules stored as EXL3: what the server slices at start-up (checkpoint.slicing)


def _recorded_trellis(storage: StorageMap) -> dict[str, tuple[int, ...]]:
    """Every ``.trellis`` tensor the ``tensor_storage`` records list, with the shape they record (a Hub checkpoint
    fetched in part has no header for it here)."""
    out: dict[str, tuple[int, ...]] = {}
    for rec in storage.records.values():
        tensors = rec.get("stored_tensors") if isinstance(rec, dict) else None
        for name, t in (tensors or {}).items() if isinstance(tensors, dict) else ():
            shape = t.get("shape") if isinstance(t, dict) else None
            if str(name).endswith(".trellis") and isinstance(shape, list) and all(
                    isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
                out[str(name)] = tuple(shape)
    return out


def _trellis_shape(checkpoint: Checkpoint, name: str, recorded: dict[str, tuple[int, ...]]
                   ) -> Optional[tuple[int, int]]:
    """``[N, K]`` (rows, columns: a weight's orientation) of the stored matrix whose trellis is ``name``, from its
    header, else the shape its record gives; None when neither has a rank-3 trellis."""
    shape = checkpoint.info(name).shape if checkpoint.has_tensor(name) else recorded.get(name)
    if shape is None or len(shape) != 3:
        return None
    return shape[1] * 16, shape[0] * 16


def _record_trellis(storage: StorageMap, prefix: str) -> Optional[str]:
    """The ``.trellis`` tensor the record the server finds for ``prefix`` lists (``_storage_entry``'s spellings)."""
    rec = storage.entry(prefix)
    tensors = rec.get("stored_tensors") if isinstance(rec, dict) else None
    names = [str(n) for n in tensors if str(n).endswith(".trellis")] if isinstance(tensors, dict) else []
    return names[0] if names else None


def _stored_linear(checkpoint: Checkpoint, family: Family, cfg: dict, arch: str, route: Route, ckpt_layers: str,
                   storage: StorageMap, packed: dict, recorded: dict[str, tuple[int, ...]]) -> Any:
    """The ``StoredModule`` of a routed module the checkpoint stores as EXL3: its stored matrices (the checkpoint's
    names, else the ones its records list) and the layer they make, or ``unknown`` saying what is not modelled."""
    from exl3tool.checkpoint.slicing import StoredModule, shards_match, source_modules

    tpl: ModuleTemplate = route.template
    base = f"{ckpt_layers}.{route.layer}"
    names = [next((n for n in _source_candidates(family, base, s, "trellis") if n in recorded
                   or checkpoint.has_tensor(n)), None) for s in tpl.sources]
    fused = f"{base}.{tpl.name}.trellis"
    if not all(names):
        if storage.is_exl3(route.prefix):  # the fused module stored whole
            names = [_record_trellis(storage, route.prefix) or fused]
        else:
            vbase, _, leaf = route.prefix.rpartition(".")
            names = [_record_trellis(storage, f"{vbase}.{x}" if vbase else x) for x in packed.get(leaf) or ()]
    shapes = [_trellis_shape(checkpoint, n, recorded) if n else None for n in names]
    if not names or None in shapes:
        return StoredModule(route.prefix, "linear", unknown="its record says stored as EXL3, but the checkpoint's "
                                                             "stored matrices for it are not found")
    sources = tuple(n for n in names if n)
    try:
        layer = _route_layer(checkpoint, family, cfg, arch, route, sources, [s for s in shapes if s], fused)
    except (InputError, ConfigError) as exc:
        return StoredModule(route.prefix, "linear", unknown=str(exc))
    mods = source_modules(layer, {n: s[0] for n, s in zip(sources, shapes, strict=True) if s})
    if not shards_match(layer, mods):
        return StoredModule(route.prefix, "linear", unknown="its stored matrices are not one per shard the fork "
                                                             "loads (a fused matrix)")
    return StoredModule(route.prefix, "linear", layer=layer, sources=tuple(mods))


_EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


def _stored_experts(checkpoint: Checkpoint, family: Family, cfg: dict, ckpt_layers: str, storage: StorageMap,
                    recorded: dict[str, tuple[int, ...]], streamed: bool) -> list[Any]:
    """One ``StoredModule`` per decoder layer whose routed experts are stored as EXL3 (``_moe_prefix_is_exl3``:
    expert 0's gate, up and down), with the intermediate size every rank slices; layers past
    ``num_hidden_layers`` (a draft's MTP layer) are not built."""
    import re

    from exl3tool.checkpoint.slicing import StoredModule

    n_layers = cfg.get("num_hidden_layers") if isinstance(cfg.get("num_hidden_layers"), int) else 0
    found: dict[int, tuple[str, str]] = {}
    for prefix in (ckpt_layers, family.layers_prefix):
        pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.((?:[\w]+\.)*?)experts\.0\.gate_proj$")
        for key in storage.records:
            m = pattern.match(key)
            if m and int(m.group(1)) < n_layers and int(m.group(1)) not in found:
                found[int(m.group(1))] = (key.removesuffix(".0.gate_proj"), m.group(2))
    out = []
    for i, (experts, middle) in sorted(found.items()):
        if not all(storage.is_exl3(f"{experts}.0.{p}") for p in _EXPERT_PROJ):
            continue
        prefix = f"{family.layers_prefix}.{i}.{middle}experts"
        name = _record_trellis(storage, f"{experts}.0.gate_proj") or f"{experts}.0.gate_proj.trellis"
        shape = _trellis_shape(checkpoint, name, recorded)
        size = cfg.get("moe_intermediate_size")
        rows = shape[0] if shape is not None else size if isinstance(size, int) and size > 0 else None
        if rows is None:
            out.append(StoredModule(prefix, "experts", unknown="the experts' intermediate size is not known"))
        else:
            out.append(StoredModule(prefix, "experts", rows=rows, streamed=streamed))
    return out


def _stored_head(checkpoint: Checkpoint, cfg: dict, storage: StorageMap, recorded: dict[str, tuple[int, ...]]
                 ) -> list[Any]:
    """The ``lm_head`` when the checkpoint stores it as EXL3 (``has_quantized_lm_head``), with vLLM's padded
    vocabulary (``VocabParallelEmbedding``: a multiple of 64, ``padded / W`` rows a rank)."""
    from exl3tool.checkpoint.slicing import VOCAB_PADDING, StoredModule

    if not storage.is_exl3("lm_head"):
        return []
    name = _record_trellis(storage, "lm_head") or "lm_head.trellis"
    shape = _trellis_shape(checkpoint, name, recorded)
    if shape is None:
        return [StoredModule("lm_head", "lm_head", unknown="its stored matrix is not found")]
    vocab = cfg.get("vocab_size") if isinstance(cfg.get("vocab_size"), int) else shape[0]
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    return [StoredModule("lm_head", "lm_head", rows=shape[0], padded=padded, in_features=shape[1])]


def _stored_modules(checkpoint: Checkpoint, family: Family, cfg: dict, arch: str, routes: list[Route],
                    ckpt_layers: str, view) -> tuple[Any, ...]:
    """Every module the checkpoint stores as EXL3 that a server of it builds and slices: the routed linears, the
    routed experts (not a rank-sliced checkpoint's: per-rank payloads) and the ``lm_head``."""
    storage, kind = view.storage, view.kind
    recorded = _recorded_trellis(storage)
    packed = family.packed(cfg)
    out = [_stored_linear(checkpoint, family, cfg, arch, r, ckpt_layers, storage, packed, recorded)
           for r in routes if r.decision == "stored_exl3"]
    if kind is None or kind.kind == "exl3":
        out += _stored_experts(checkpoint, family, cfg, ckpt_layers, storage, recorded,
                               streamed=kind is not None and kind.r7)
    out += _stored_head(checkpoint, cfg, storage, recorded)
    from exl3tool.checkpoint.slicing import load_order

    return tuple(sorted(out, key=lambda m: load_order(m.prefix)))  # the order the server slices them in


def _never(stem: str) -> bool:
    """Embeddings and output heads are never online-encoded (docs/layer-plan.md §2), whatever the globs say."""
    parts = stem.split(".")
    return "lm_head" in parts or any("embed" in p for p in parts)


def _plan_globs(checkpoint: Checkpoint, layers: list[str], storage: StorageMap,
                serialized: list[str], excluded: list[Excluded]) -> list[PlannedLayer]:
    planned: list[PlannedLayer] = []
    for name in checkpoint.tensor_names():
        if not name.endswith(".weight"):
            continue
        stem = name.removesuffix(".weight")
        if not _matches(stem, layers) or _never(stem):
            continue
        if storage.is_exl3(stem):
            serialized.append(stem)
            excluded.append(Excluded(stem, "stored_exl3", "stored as EXL3 in the checkpoint"))
            continue
        info = checkpoint.info(name)
        if len(info.shape) != 2 or not info.is_float:
            continue  # norms, biases-as-weights, integer buffers
        n, k = info.shape
        planned.append(PlannedLayer(stem, "replicated", (name,), (n,), k, n, spec="generic"))
    return planned


def _as_overlay(overlay: Overlay | str | None) -> Overlay:
    if isinstance(overlay, Overlay):
        return overlay
    return resolve_overlay(overlay)


def plan_layers(checkpoint: Checkpoint, *, release: ServerRelease, overlay: Overlay | str | None = None,
                layers: list[str] | None = None, exclude: list[str] | None = None,
                language_model_only: bool = False) -> LayerPlan:
    """Plan the server's online-encoded linears for ``checkpoint`` (headers only, no weights read).

    ``overlay`` is the server's ``--quantization-config`` (parsed ``Overlay`` or the JSON string; default: the
    documented minimal overlay). ``layers`` / ``exclude`` are fnmatch globs over vLLM prefixes (e.g.
    ``'model.layers.0.*'``). For an architecture without a table, or a checkpoint the server would refuse with the
    overlay, ``layers`` is required and the plan's ``server_lookup`` is False (unknown architectures: globs match
    checkpoint tensor names without ``.weight``; every matching 2-D floating weight becomes a ``replicated`` layer).
    ``language_model_only`` is the server's ``--language-model-only`` (or image and video limits of 0): the vision
    tower is not built, so it makes no look-ups. ``release`` is the server's (``ServerRequest.release``; which
    checkpoints it serves: r7 routed experts from gilded-gnosis-r34 on). Example: ``plan_layers(ckpt,
    release=newest(), overlay='{"linear": "mxfp8"}').for_tp(2)`` lists the entries a TP=2 server looks up.

    Args:
        checkpoint: ``open_checkpoint``'s result.
        release: the server's release (``exl3tool.releases``).
        overlay, layers, exclude, language_model_only: as described above.

    Returns:
        A ``LayerPlan``: the planned layers with their sharding, the excluded ones with reasons, ``for_tp(n)``.
    """
    overlay = _as_overlay(overlay)
    arch = checkpoint.architecture
    family = family_for(arch)
    quant_file = read_json(checkpoint.root / QUANT_CONFIG)
    view = serving_view(checkpoint.config, quant_file, family.storage_mapper if family else (), release=release)
    serialized: list[str] = []
    excluded: list[Excluded] = []
    notes: list[str] = list(view.kind.notes) if view.kind else []

    if family is None:
        if not layers:
            raise ConfigError(
                f"{checkpoint.model}: architecture {arch or '(none in config.json)'} has no known layer plan "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); select its linears with --layers 'GLOB' "
                "over checkpoint tensor names, e.g. --layers 'encoder.layer.0.*'"
            )
        planned = _plan_globs(checkpoint, layers, view.storage, serialized, excluded)
        notes.insert(0, f"generic --layers mode: architecture {arch or '(none)'} has no layer table, so these "
                        "entries are keyed by checkpoint tensor names; the server will not look them up"
                        + (f" ({view.refusal})" if view.refusal else ""))
        if not planned:
            raise ConfigError(f"{checkpoint.model}: no eligible layer matches --layers "
                              f"{' '.join(repr(g) for g in layers)}; globs match checkpoint tensor names without "
                              "'.weight'")
        return LayerPlan(tuple(planned), arch, tuple(serialized), tuple(excluded), overlay, view.kind, False,
                         None, tuple(notes), None)

    if view.refusal:
        if not layers:
            raise ConfigError(
                f"{checkpoint.model}: the server would not encode or look up any layer of this checkpoint with "
                f"--quantization-config: {view.refusal}. For an experiment, select layers with --layers 'GLOB' "
                "(their entries are not ones the server looks up)"
            )
        notes.insert(0, f"generic --layers mode: the server will not look these entries up ({view.refusal})")

    cfg = text_config(checkpoint.config)
    routes = route_family(checkpoint.config, family, view.storage, overlay)
    ckpt_layers = _checkpoint_layers(family, checkpoint.index_names())
    planned: list[PlannedLayer] = []
    for route in routes:
        if layers and not _matches(route.prefix, layers):
            continue
        if route.decision != "planned":
            excluded.append(Excluded(route.prefix, route.decision, route.detail))
            if route.decision == "stored_exl3":
                serialized.append(route.prefix)
            continue
        if exclude and _matches(route.prefix, exclude):
            excluded.append(Excluded(route.prefix, "excluded", "left out by --exclude"))
            continue
        layer = _plan_route(checkpoint, family, cfg, arch or "", route, ckpt_layers)
        if layer is not None:
            planned.append(layer)
    if layers and not planned:
        globs = " ".join(repr(g) for g in layers)
        if excluded:  # the globs matched modules, but none the server encodes: say why for the first few
            why = "; ".join(f"{e.prefix}: {e.detail or e.reason}" for e in excluded[:3])
            more = f" (and {len(excluded) - 3} more)" if len(excluded) > 3 else ""
            raise ConfigError(f"{checkpoint.model}: --layers {globs} matches only modules the server does not "
                              f"encode online: {why}{more}")
        raise ConfigError(f"{checkpoint.model}: no eligible layer matches --layers {globs}; globs match vLLM "
                          f"prefixes such as '{family.layers_prefix}.0.self_attn.o_proj'")
    vision = "" if language_model_only else _unplanned_vision_tower(checkpoint, family, cfg, view.storage, overlay)
    if vision and not layers:
        excluded.append(Excluded("visual.*", "not_modelled", vision))
        notes.append(vision)
    stored = _stored_modules(checkpoint, family, cfg, arch or "", routes, ckpt_layers, view) if not view.refusal else ()
    return LayerPlan(tuple(planned), arch, tuple(serialized), tuple(excluded), overlay, view.kind,
                     view.refusal is None, family, tuple(notes), cfg, stored)


def tensors_to_fetch(root: Path, config: dict, names: Iterable[str], overlay: Overlay | str | None = None,
                     layers: list[str] | None = None, exclude: list[str] | None = None, *,
                     release: ServerRelease) -> set[str]:
    """The tensor names ``plan_layers`` will read, from the config, the EXL3 metadata and the index only.

    A Hub download fetches just the shards holding these: for an EXL3 checkpoint of a large MoE only the BF16
    dense tensors the server encodes, a small share of the bytes. Empty when the plan would be refused anyway.
    """
    overlay = _as_overlay(overlay)
    names = list(names)
    archs = config.get("architectures")
    family = family_for(archs[0] if isinstance(archs, list) and archs else None)
    if family is None:
        return {n for n in names if n.endswith(".weight") and _matches(n.removesuffix(".weight"), layers)
                and not _never(n.removesuffix(".weight"))} if layers else set()
    view = serving_view(config, read_json(root / QUANT_CONFIG), family.storage_mapper, release=release)
    if view.refusal and not layers:
        return set()
    base_layers = _checkpoint_layers(family, names)
    wanted: set[str] = set()
    for route in route_family(config, family, view.storage, overlay):
        if route.decision != "planned" or (layers and not _matches(route.prefix, layers)):
            continue
        if exclude and _matches(route.prefix, exclude):
            continue
        base = f"{base_layers}.{route.layer}"
        for s in route.template.sources:
            wanted.update(_source_candidates(family, base, s))
        wanted.add(f"{base}.{route.template.name}.weight")
    return wanted & set(names)
