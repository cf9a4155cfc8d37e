"""Which linear layers the server encodes online, with their vLLM prefixes and rank-local sizes (spec 6.1-6.5).

``plan_layers`` reads only the config and tensor headers. ``LayerPlan.for_tp(W)`` expands the plan into
one ``RankJob`` per layer and rank (the key's ``tp_rank``, ``input_size = K_r``, ``output_size = N_r``);
``skipped(W)`` lists the ranks the server keeps off the cache because of the 128-alignment rule (6.3).
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass

from exl3tool.checkpoint.families import SUPPORTED_ARCHITECTURES, Family, ModuleTemplate, family_for
from exl3tool.checkpoint.source import QUANT_CONFIG, Checkpoint
from exl3tool.errors import ConfigError, InputError

__all__ = ["PlannedLayer", "RankJob", "LayerPlan", "plan_layers", "rank_sizes", "qkv_partition", "ALIGN",
           "is_shared_expert_projection", "server_ignores"]

ALIGN = 128  # the Hadamard block: K_r and N_r must both be multiples of it (spec 6.3)
PARALLEL_STYLES = ("qkv", "merged_column", "column", "row", "replicated")


@dataclass(frozen=True)
class PlannedLayer:
    """One server linear module: its prefix, parallel style and full (unsharded) shape.

    ``sources`` are checkpoint tensor names in fused order (q, k, v / gate, up). ``part_sizes`` are the
    output rows of each fused part; when a checkpoint already stores the fused tensor, ``sources`` has one
    name and ``part_sizes`` still has one entry per part (the parts are stacked in that tensor).
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

    @property
    def fused_source(self) -> bool:
        """True when one checkpoint tensor holds several fused parts (a pre-fused qkv_proj / gate_up_proj)."""
        return len(self.sources) == 1 and len(self.part_sizes) > 1


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


def _check_tp(tp_size: int) -> None:
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ConfigError(f"tensor-parallel size must be a positive integer, got {tp_size!r}")


def qkv_partition(layer: PlannedLayer, tp_size: int, tp_rank: int) -> tuple[int, int, int, int]:
    """``(heads_r, kv_r, replicas, kr)`` for a qkv layer as vLLM's QKVParallelLinear computes them (6.4)."""
    heads, kv = layer.num_heads, layer.num_kv_heads
    assert heads is not None and kv is not None, "qkv layer without head counts"
    if heads % tp_size:
        raise ConfigError(
            f"{layer.prefix}: {heads} attention heads are not divisible by tensor-parallel size {tp_size}; "
            "vLLM cannot shard this model at that size"
        )
    if tp_size >= kv:
        if tp_size % kv:
            raise ConfigError(
                f"{layer.prefix}: tensor-parallel size {tp_size} is not a multiple of {kv} KV heads; "
                "vLLM cannot replicate KV heads evenly"
            )
        kv_r, replicas = 1, tp_size // kv
    else:
        if kv % tp_size:
            raise ConfigError(
                f"{layer.prefix}: {kv} KV heads are not divisible by tensor-parallel size {tp_size}; "
                "vLLM cannot shard this model at that size"
            )
        kv_r, replicas = kv // tp_size, 1
    return heads // tp_size, kv_r, replicas, tp_rank // replicas


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
        return layer.in_features, sum(_divide(layer, f"output part {j} size", n, tp_size)
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
    return "; ".join(bad) + "; the server keeps this layer unencoded (MXFP8/BF16), no cache entry"


@dataclass(frozen=True)
class LayerPlan:
    """The planned layers of one checkpoint, in model order."""

    layers: tuple[PlannedLayer, ...]
    architecture: str | None
    serialized: tuple[str, ...] = ()  # prefixes the checkpoint already stores as EXL3: served as-is, never cached

    def for_tp(self, tp_size: int, *, include_skipped: bool = False) -> list[RankJob]:
        """One job per layer and rank ``0..W-1``; ranks the server never caches (6.3) only if asked."""
        _check_tp(tp_size)
        jobs: list[RankJob] = []
        for layer in self.layers:
            k_r, n_r = rank_sizes(layer, tp_size)
            if include_skipped or _skip_reason(k_r, n_r) is None:
                jobs += [RankJob(layer, tp_size, r, k_r, n_r) for r in range(tp_size)]
        return jobs

    def skipped(self, tp_size: int) -> list[tuple[str, int, str]]:
        """``(prefix, rank, reason)`` for every rank whose K_r or N_r is not 128-aligned at this TP size."""
        _check_tp(tp_size)
        out: list[tuple[str, int, str]] = []
        for layer in self.layers:
            reason = _skip_reason(*rank_sizes(layer, tp_size))
            if reason is not None:
                out += [(layer.prefix, r, reason) for r in range(tp_size)]
        return out


# ---------------------------------------------------------------------------------------------------------
# planning


def _field(checkpoint: Checkpoint, name: str, arch: str) -> int:
    value = checkpoint.config.get(name)
    if value is None:
        raise InputError(f"{checkpoint.root / 'config.json'}: missing field {name!r}, needed to plan {arch} layers")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InputError(f"{checkpoint.root / 'config.json'}: field {name!r} must be a positive integer, got {value!r}")
    return value


def _matches(name: str, globs: list[str] | None) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in globs or ())


def _weight_shape(checkpoint: Checkpoint, name: str) -> tuple[int, int]:
    info = checkpoint.info(name)
    if len(info.shape) != 2 or not info.is_float:
        raise InputError(f"{info.file}: {name} is {info.dtype_code} {list(info.shape)}, "
                         "expected a 2-D F16/BF16/F32 weight")
    return info.shape[0], info.shape[1]


def _exl3_modules(checkpoint: Checkpoint) -> set[str]:
    """Module names ``quantization_config.json``'s ``tensor_storage`` records as ``quant_format: exl3``."""
    path = checkpoint.root / QUANT_CONFIG
    if not path.is_file():
        return set()
    try:
        storage = json.loads(path.read_text(encoding="utf-8")).get("tensor_storage") or {}
        if not isinstance(storage, dict):
            raise ValueError("tensor_storage is not an object")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise InputError(f"{path}: cannot parse ({e})") from None
    return {name for name, rec in storage.items() if isinstance(rec, dict) and rec.get("quant_format") == "exl3"}


def _is_exl3(checkpoint: Checkpoint, stem: str, exl3: set[str]) -> bool:
    """Stored as EXL3: named in tensor_storage (also under model./language_model. variants) or has a trellis."""
    bare = stem.removeprefix("model.")
    variants = {stem, bare, f"model.{bare}", f"language_model.model.{bare}", f"model.language_model.{bare}"}
    return bool(variants & exl3) or checkpoint.has_tensor(f"{stem}.trellis")


class _Serialized(Exception):
    """Internal: the module is already stored as EXL3 (spec 6.1), so the server never encodes it online."""


def _plan_module(checkpoint: Checkpoint, layer: str, tpl: ModuleTemplate,
                 heads: tuple[int, int, int], hidden: int, exl3: set[str]) -> PlannedLayer | None:
    """Plan one module of decoder layer ``layer`` (e.g. ``model.layers.3``); None if it is absent (optional)."""
    prefix = f"{layer}.{tpl.name}"
    names = tuple(f"{layer}.{s}.weight" for s in tpl.sources)
    fused = f"{prefix}.weight"
    stored = [_is_exl3(checkpoint, n.removesuffix(".weight"), exl3) for n in names]
    if _is_exl3(checkpoint, prefix, exl3) or all(stored):
        raise _Serialized(prefix)
    if any(stored):
        raise ConfigError(f"{prefix}: checkpoint mixes EXL3 and BF16 source shards "
                          f"({', '.join(n for n, s in zip(names, stored, strict=True) if s)} stored as EXL3); "
                          "the server refuses this checkpoint")
    present = [n for n in names if checkpoint.has_tensor(n)]
    if len(present) == len(names):
        sources = names
    elif not present and len(names) > 1 and checkpoint.has_tensor(fused):
        sources = (fused,)
    elif not present and not tpl.required:
        return None
    else:
        missing = next(n for n in names if not checkpoint.has_tensor(n))
        also = f" (nor a fused {fused})" if len(names) > 1 else ""
        raise InputError(f"{checkpoint.root}: checkpoint has no tensor {missing!r}{also}, needed for {prefix}")

    shapes = [_weight_shape(checkpoint, n) for n in sources]
    in_features = shapes[0][1]
    for n, (_, k) in zip(sources, shapes, strict=True):
        if k != in_features:
            raise InputError(f"{checkpoint.root}: {n} has {k} input features, {sources[0]} has {in_features}; "
                             f"they cannot be fused into {prefix}")
    out_features = sum(s[0] for s in shapes)
    if tpl.parallel in ("qkv", "merged_column") and in_features != hidden:
        raise InputError(f"{checkpoint.root}: {sources[0]} has {in_features} input features but config.json "
                         f"hidden_size is {hidden}; the config does not belong to these weights")

    if tpl.parallel == "qkv":
        num_heads, num_kv, head_dim = heads
        q_rows, k_rows = num_heads * head_dim, num_kv * head_dim
        v_rows = out_features - q_rows - k_rows
        if len(sources) == 3 and (shapes[0][0] != q_rows or shapes[1][0] != k_rows):
            raise InputError(
                f"{checkpoint.root}: {sources[0]} / {sources[1]} have {shapes[0][0]} / {shapes[1][0]} rows, "
                f"but the config gives {num_heads} heads x {head_dim} = {q_rows} / "
                f"{num_kv} KV heads x {head_dim} = {k_rows}"
            )
        if v_rows <= 0 or v_rows % num_kv:
            raise InputError(
                f"{checkpoint.root}: {prefix} has {out_features} output rows, which do not split into q {q_rows}, "
                f"k {k_rows} and v for {num_kv} KV heads; check num_attention_heads, num_key_value_heads and head_dim"
            )
        return PlannedLayer(prefix, "qkv", sources, (q_rows, k_rows, v_rows), in_features, out_features,
                            num_heads, num_kv, head_dim, v_rows // num_kv)
    if len(sources) == 1 and len(names) > 1:  # pre-fused merged column: equal parts (gate, up)
        if out_features % len(names):
            raise InputError(f"{checkpoint.root}: fused {fused} has {out_features} rows, "
                             f"not divisible into {len(names)} equal parts")
        part_sizes = (out_features // len(names),) * len(names)
    else:
        part_sizes = tuple(s[0] for s in shapes)
    return PlannedLayer(prefix, tpl.parallel, sources, part_sizes, in_features, out_features)


def _plan_family(checkpoint: Checkpoint, family: Family, arch: str, shared_experts: bool,
                 serialized: list[str]) -> list[PlannedLayer]:
    hidden = _field(checkpoint, "hidden_size", arch)
    num_heads = _field(checkpoint, "num_attention_heads", arch)
    n_layers = _field(checkpoint, "num_hidden_layers", arch)
    has_kv = checkpoint.config.get("num_key_value_heads") is not None  # HF default: no GQA
    num_kv = _field(checkpoint, "num_key_value_heads", arch) if has_kv else num_heads
    if checkpoint.config.get("head_dim") is not None:
        head_dim = _field(checkpoint, "head_dim", arch)
    elif hidden % num_heads:
        raise InputError(f"{checkpoint.root / 'config.json'}: no 'head_dim', and hidden_size {hidden} is not "
                         f"divisible by num_attention_heads {num_heads}; add head_dim to the config")
    else:
        head_dim = hidden // num_heads
    if num_heads % num_kv:
        raise InputError(f"{checkpoint.root / 'config.json'}: num_attention_heads {num_heads} is not a multiple of "
                         f"num_key_value_heads {num_kv}")

    exl3 = _exl3_modules(checkpoint)
    planned: list[PlannedLayer] = []
    for i in range(n_layers):
        for tpl in family.modules:
            if tpl.shared_expert and not shared_experts:
                continue
            try:
                layer = _plan_module(checkpoint, f"{family.layers_prefix}.{i}", tpl, (num_heads, num_kv, head_dim),
                                     hidden, exl3)
            except _Serialized as e:
                serialized.append(str(e))
                continue
            if layer is not None:
                planned.append(layer)
    return planned


def _never(stem: str) -> bool:
    """Embeddings and output heads are never online-encoded (spec 6.1), whatever the globs say."""
    parts = stem.split(".")
    return "lm_head" in parts or any("embed" in p for p in parts)


def _plan_globs(checkpoint: Checkpoint, layers: list[str], serialized: list[str]) -> list[PlannedLayer]:
    exl3 = _exl3_modules(checkpoint)
    planned: list[PlannedLayer] = []
    for name in checkpoint.tensor_names():
        if not name.endswith(".weight"):
            continue
        stem = name.removesuffix(".weight")
        if not _matches(stem, layers) or _never(stem):
            continue
        if _is_exl3(checkpoint, stem, exl3):
            serialized.append(stem)
            continue
        info = checkpoint.info(name)
        if len(info.shape) != 2 or not info.is_float:
            continue  # norms, biases-as-weights, integer buffers
        n, k = info.shape
        planned.append(PlannedLayer(stem, "replicated", (name,), (n,), k, n))
    return planned


# vLLM's packed_modules_mapping for the families we know: how the server names a fused module's parts.
PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def is_shared_expert_projection(prefix: str) -> bool:
    """True for ``...shared_expert(s).{gate,up,gate_up,down}_proj``: covered by the ``shared_experts`` spec only."""
    parts = prefix.split(".")
    return (len(parts) >= 2 and parts[-1] in ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
            and parts[-2] in ("shared_expert", "shared_experts"))


def _ignore_match(name: str, ignore: list[str]) -> bool:
    return any(name == t or (t.startswith("re:") and re.match(t[3:], name)) for t in ignore)


def server_ignores(prefix: str, ignore: list[str]) -> bool:
    """The server's ``ignore`` rule (spec 6.1): exact names or ``re:`` regexes (``re.match``); a fused module
    is judged through its unfused names unless listed exactly, and those must agree."""
    leaf = prefix.rsplit(".", 1)[-1]
    if leaf not in PACKED_MODULES or prefix in ignore:
        return _ignore_match(prefix, ignore)
    verdicts = {part: _ignore_match(prefix.replace(leaf, part), ignore) for part in PACKED_MODULES[leaf]}
    if len(set(verdicts.values())) > 1:
        ignored = [p for p, v in verdicts.items() if v]
        raise ConfigError(f"{prefix}: ignore covers only {', '.join(ignored)} of its fused parts; the server "
                          "rejects this (different quantization schemes); ignore all parts or none")
    return next(iter(verdicts.values()))


def plan_layers(checkpoint: Checkpoint, *, layers: list[str] | None = None, exclude: list[str] | None = None,
                shared_experts: bool = False, linear: bool = True, ignore: list[str] | None = None) -> LayerPlan:
    """Plan the server's online-encoded linears for ``checkpoint`` (headers only, no weights read).

    ``layers`` / ``exclude`` are fnmatch globs over vLLM prefixes (e.g. ``'model.layers.0.*'``). For an
    architecture we do not know, ``layers`` is required and matches checkpoint tensor names without
    ``.weight``; every matching 2-D floating weight becomes a ``replicated`` layer.
    The server's own overlay settings can be mirrored: ``linear`` (a ``linear`` spec is set),
    ``shared_experts`` (a ``shared_experts`` spec is set) and ``ignore`` (its ``ignore`` list, spec 6.1).
    Example: ``plan_layers(ckpt).for_tp(2)`` lists the entries a TP=2 server would look up.
    """
    arch = checkpoint.architecture
    family = family_for(arch)
    serialized: list[str] = []
    if family is None:
        if not layers:
            raise ConfigError(
                f"{checkpoint.model}: architecture {arch or '(none in config.json)'} has no known layer plan "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); select its linears with --layers 'GLOB' "
                "over checkpoint tensor names, e.g. --layers 'encoder.layer.0.*'"
            )
        planned = _plan_globs(checkpoint, layers, serialized)
    else:
        planned = _plan_family(checkpoint, family, arch or "", shared_experts, serialized)
        if layers:
            planned = [p for p in planned if _matches(p.prefix, layers)]
    if layers and not planned:
        globs = " ".join(repr(g) for g in layers)
        hint = ("globs match vLLM prefixes such as 'model.layers.0.self_attn.qkv_proj'" if family
                else "globs match checkpoint tensor names without '.weight'")
        raise ConfigError(f"{checkpoint.model}: no eligible layer matches --layers {globs}; {hint}")
    if exclude:
        planned = [p for p in planned if not _matches(p.prefix, exclude)]
    # Shared-expert projections follow the shared_experts spec only; ignore never applies to them.
    planned = [p for p in planned if is_shared_expert_projection(p.prefix)
               or (linear and not (ignore and server_ignores(p.prefix, ignore)))]
    keep = [p for p in serialized if not layers or _matches(p, layers)]
    return LayerPlan(tuple(planned), arch, tuple(keep))
