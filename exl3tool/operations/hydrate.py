"""`exl3tool hydrate`: a new checkpoint in which every layer the server would encode online is stored as EXL3.

``plan_hydrate`` decides what to store from ``cache warm``'s own plan at TP 1 (``plan.request.prepare``, one rule,
one place), then checks each layer against the fork's loader at every TP size OUT must start at (by default every
size up to 8 vLLM can split the model into; ``checkpoint.hydrated.storage_problem`` / ``slicing_problem``). ``hydrate`` runs it: each source module is encoded once
(``encode_linear``, the bytes ``cache warm`` writes for an unfused layer at TP 1), kept under a temporary folder
beside OUT so a killed run resumes, then the changed shards are written (kept tensors copied byte for byte), the
others hard-linked (else copied), the index and ``tensor_storage`` rewritten, and the folder renamed to OUT.
Nothing is written to SOURCE. The rules and their sources in the fork: docs/hydrate.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from exl3tool.checkpoint.hydrate_record import HYDRATED_BY, hydrate_note
from exl3tool.checkpoint.hydrated import (
    DTYPE_CODES, EXL3_SUFFIXES, SourceModule, exl3_tensors_of, read_header, slicing_problem, source_modules,
    storage_problem, storage_record, tensor_nbytes, tp_problems, write_shard,
)
from exl3tool.errors import ConfigError, InputError
from exl3tool.text import plural

__all__ = ["HydrateLayer", "HydratePlan", "HydrateReport", "plan_hydrate", "hydrate", "stored_only_reason",
           "TEMP_SUFFIX", "temp_dir", "bits_rules"]

TEMP_SUFFIX = ".hydrate-partial"  # the temporary folder beside OUT: ".<OUT name>.hydrate-partial"
_WORK = ".hydrate"  # inside the temporary folder: per-layer results and the job's settings
_INDEX = "model.safetensors.index.json"
_QUANT = "quantization_config.json"
MAX_TP = 8  # the default TP sizes: every size up to this one that vLLM can split the model into

EncodeFn = Callable[..., Any]  # (weight [K, N] float32, bits, seed, device) -> EncodedLinear
LayerFn = Callable[[int, int, str, float, bool], None]  # (done, total, module, seconds, reused)


@dataclass(frozen=True)
class HydrateModule:
    """One checkpoint matrix to store: its module name, ``[K, N]``, the seed its encode draws signs from."""

    source: SourceModule
    seed: int
    shard: str  # the shard file (name) holding its .weight
    weight_bytes: int
    exl3_bytes: int
    record_key: str = ""  # its tensor_storage key: the module, or the vLLM name where the fork cannot find that
    stored_as: str = ""  # the prefix of its EXL3 tensors: the module, or its primary spelling for an aliased path
    bits: int = 0  # its K (--bits, or the last --bits-for rule that matches it); 0: the plan's

    @property
    def module(self) -> str:
        return self.stored_as or self.source.module

    def as_json(self) -> dict[str, Any]:
        s = self.source
        return {"module": self.module, "weight": s.weight, "record_key": self.record_key, "in_features": s.in_features,
                "out_features": s.out_features, "seed": self.seed, "bits": self.bits,
                "shard": self.shard, "bytes_before": self.weight_bytes, "bytes_after": self.exl3_bytes}


@dataclass(frozen=True)
class HydrateLayer:
    """One server layer (a vLLM prefix of ``cache warm``'s TP 1 plan) and the checkpoint modules that store it."""

    prefix: str
    parallel: str
    modules: tuple[HydrateModule, ...]

    def as_json(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "parallel": self.parallel, "modules": [m.as_json() for m in self.modules]}


@dataclass(frozen=True)
class HydratePlan:
    """What ``hydrate`` will write: layers to store, layers left BF16 and why, shards, sizes, and refusals met."""

    source: Path
    out: Path
    model: str
    bits: int
    tp_sizes: tuple[int, ...]
    dtype: str
    layers: tuple[HydrateLayer, ...]
    left_bf16: tuple[tuple[str, str], ...]  # (prefix, why) of planned layers kept BF16 (--leave-unaligned)
    not_planned: tuple[tuple[str, str, str], ...]  # (prefix, reason, why) as `cache warm --dry-run` lists them
    changed_shards: tuple[str, ...]
    unchanged_files: tuple[str, ...]
    bytes_before: int  # every file of SOURCE
    bytes_after: int  # every file of OUT, estimated: tensor bytes change; headers and JSON files grow a little
    storage_file: str  # where tensor_storage lives: quantization_config.json or config.json (inline)
    already_stored: str = ""  # non-empty: nothing to do, every online layer is stored already (why)
    checkpoint: Any = field(default=None, compare=False, repr=False)
    tp_default: bool = False  # tp_sizes are the default (every size up to MAX_TP vLLM can split the model into)
    left_tp: dict[str, tuple[int, ...]] = field(default_factory=dict)  # left_bf16 prefix -> the TP sizes it fails at
    fails_at: dict[int, str] = field(default_factory=dict)  # other TP sizes <= MAX_TP where OUT fails: "layer: why"

    @property
    def modules(self) -> list[HydrateModule]:
        return [m for layer in self.layers for m in layer.modules]

    def note(self) -> dict[str, Any]:
        """The ``exl3tool_hydrate`` record written into OUT beside ``tensor_storage`` (``checkpoint.hydrate_record``):
        the TP sizes checked, those up to ``MAX_TP`` where a stored layer cannot be sliced, what is stored."""
        mods = sorted(self.modules, key=lambda m: m.module)
        return hydrate_note(bits=self.bits, tp_sizes=self.tp_sizes, modules={m.module: m.source.weight for m in mods},
                            bits_by_module={m.module: m.bits for m in mods if m.bits and m.bits != self.bits},
                            left_bf16=[p for p, _ in self.left_bf16],
                            left_tp=self.left_tp, fails_at=self.fails_at, checked_up_to=MAX_TP)

    def _left_json(self) -> list[dict[str, Any]]:
        return [{"prefix": p, "why": w, "tp_sizes": list(self.left_tp.get(p, ()))} for p, w in self.left_bf16]

    def as_json(self) -> dict[str, Any]:
        """The `hydrate --dry-run --json` document (docs/hydrate.md)."""
        mods = self.modules
        return {"source": str(self.source), "out": str(self.out), "model": self.model, "bits": self.bits,
                "tp_sizes": list(self.tp_sizes), "tp_default": self.tp_default,
                "fails_at": {str(tp): why for tp, why in sorted(self.fails_at.items())}, "dtype": self.dtype,
                "already_stored": self.already_stored or None,
                "layers": [layer.as_json() for layer in self.layers], "modules": len(mods),
                "tiles": sum((m.source.in_features // 16) * (m.source.out_features // 16) for m in mods),
                "left_bf16": self._left_json(),
                "not_planned": [{"prefix": p, "reason": r, "why": w} for p, r, w in self.not_planned],
                "changed_shards": list(self.changed_shards), "unchanged_files": len(self.unchanged_files),
                "storage_file": self.storage_file,
                "bytes": {"before": self.bytes_before, "after": self.bytes_after,
                          "weights_removed": sum(m.weight_bytes for m in mods),
                          "exl3_added": sum(m.exl3_bytes for m in mods)}}


@dataclass(frozen=True)
class HydrateReport:
    """What a run did: modules encoded now or reused from an interrupted run, files written, sizes, seconds."""

    plan: HydratePlan
    encoded: int
    reused: int
    linked: int
    copied: int
    bytes_after: int
    seconds: float
    noop: bool = False

    def as_json(self) -> dict[str, Any]:
        """The `hydrate --json` document (docs/hydrate.md)."""
        p = self.plan
        return {"source": str(p.source), "out": str(p.out), "noop": self.noop,
                "already_stored": p.already_stored or None, "bits": p.bits, "tp_sizes": list(p.tp_sizes),
                "tp_default": p.tp_default, "fails_at": {str(tp): why for tp, why in sorted(p.fails_at.items())},
                "layers": len(p.layers), "modules_stored": len(p.modules), "encoded": self.encoded,
                "reused": self.reused, "left_bf16": p._left_json(),
                "shards_written": len(p.changed_shards), "files_linked": self.linked, "files_copied": self.copied,
                "bytes": {"before": p.bytes_before, "after": self.bytes_after}, "seconds": self.seconds}


# --------------------------------------------------------------------------------------------------------------
# the plan


def stored_only_reason(layer_plan, tp_sizes=(1,)) -> str:
    """Non-empty when a server at ``tp_sizes`` looks nothing up *because* the layers it would encode online are
    stored as EXL3: no planned layer is 128-aligned there, at least one module is stored, none is encoded unmodelled
    (the one rule `cache check` and `hydrate` use to say "every online layer is stored")."""
    if not layer_plan.server_lookup:
        return ""
    try:
        looked_up = sum(len(layer_plan.for_tp(tp)) for tp in tp_sizes)
    except ConfigError:
        return ""
    reasons = [e.reason for e in layer_plan.excluded]
    if looked_up or "stored_exl3" not in reasons or "not_modelled" in reasons:
        return ""
    stored = reasons.count("stored_exl3")
    rest = len(reasons) - stored
    kept = len(layer_plan.layers)
    return (f"every online layer is stored: {plural(stored, 'module')} stored as EXL3 in the checkpoint"
            + (f", {rest} kept BF16 by the overlay (ignored or without a spec)" if rest else "")
            + (f", {plural(kept, 'layer')} the server keeps MXFP8 (not 128-aligned)" if kept else ""))


def _inside(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def _check_paths(source: Path, out: Path) -> None:
    if out == source or _inside(out, source):
        raise ConfigError(f"OUT {out} is inside SOURCE {source}; hydrate never writes into SOURCE: give a folder "
                          "outside it, e.g. a sibling")
    if _inside(source, out):
        raise ConfigError(f"OUT {out} contains SOURCE {source}; give a new folder beside it")
    if out.exists() or out.is_symlink():
        raise ConfigError(f"OUT {out} exists; hydrate writes a new checkpoint: remove it or name a new folder")
    if not out.parent.is_dir():
        raise ConfigError(f"OUT {out}: its parent folder {out.parent} does not exist; create it first")


def _files(root: Path) -> list[str]:
    """Every file of the checkpoint folder, relative, sorted (hidden temporary files included, links followed)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            out.append(str((Path(dirpath) / name).relative_to(root)))
    return out


def _storage_location(checkpoint) -> str:
    qc = checkpoint.config.get("quantization_config")
    return "config.json" if isinstance(qc, dict) and qc.get("tensor_storage") else _QUANT


def _hydrated_by_us(checkpoint, storage_file: str) -> bool:
    """Whether ``exl3tool hydrate`` wrote this checkpoint (its ``hydrated_by`` note beside ``tensor_storage``)."""
    from exl3tool.checkpoint.routing import read_json

    qc = (checkpoint.config.get("quantization_config") if storage_file == "config.json"
          else read_json(checkpoint.root / _QUANT)) or {}
    return isinstance(qc, dict) and isinstance(qc.get(HYDRATED_BY), dict)


def _source_prefix(layer, index: int, packed: dict) -> str:
    """The vLLM name of a layer's source ``index`` (``_source_prefixes_for_layer``): the layer's own prefix, or
    its base plus the packed mapping's leaf."""
    if len(layer.sources) == 1:
        return layer.prefix
    base, _, leaf = layer.prefix.rpartition(".")
    leaves = packed.get(leaf) or ()
    name = leaves[index] if index < len(leaves) else layer.sources[index].removesuffix(".weight").rsplit(".", 1)[-1]
    return f"{base}.{name}" if base else name


def _primary_spelling(module: str, aliases) -> str:
    """A module found under a family's alternative checkpoint path (GLM-5.3's ``self_attn.forget_gate.f_b_proj``)
    under its primary one (``self_attn.f_b_proj``, the released checkpoints' layout, which the model loads as is):
    where hydrate writes its EXL3 tensors."""
    for primary, alternative in aliases:
        if module.endswith("." + alternative):
            return module[: -len(alternative)] + primary
    return module


def _record_key(module: str, vllm_name: str, mapper) -> str:
    """``module`` when the fork finds a record under it for ``vllm_name`` (its spellings after the model's mapper),
    else ``vllm_name`` (a checkpoint path the model renames on load, e.g. GLM-5.3's ``forget_gate.f_b_proj``)."""
    from exl3tool.checkpoint.routing import StorageMap

    found = StorageMap.build({module: {"quant_format": "exl3"}}, mapper).is_exl3(vllm_name)
    return module if found else vllm_name


def _layer_seed(layer, source: SourceModule) -> int:
    from exl3tool.cache import layer_seed

    if len(layer.sources) == 1:
        return layer_seed(layer.prefix)  # the cache key's seed: an unfused layer's bytes equal its TP 1 entry
    base = layer.prefix.rsplit(".", 1)[0]
    return layer_seed(f"{base}.{source.module.rsplit('.', 1)[-1]}")


def bits_rules(rules: Iterable[str | tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """``--bits-for`` rules as ``(glob, K)``: ``"GLOB=K"`` strings (or pairs), K from 3 to 8 as ``--bits``;
    ConfigError naming the rule otherwise."""
    from exl3tool.cache.settings import BITS_RANGE

    lo, hi = BITS_RANGE
    out = []
    for rule in rules:
        glob, sep, k = rule.rpartition("=") if isinstance(rule, str) else (rule[0], "=", str(rule[1]))
        if not sep or not glob.strip() or not k.strip().isdigit() or not lo <= int(k) <= hi:
            raise ConfigError(f"--bits-for {rule!r}: give GLOB=K, K from {lo} to {hi} (e.g. "
                              f"'*.mlp.down_proj=5')")
        out.append((glob.strip(), int(k)))
    return tuple(out)


def _module_bits(rules: tuple[tuple[str, int], ...], names: tuple[str, ...], default: int, used: set[int]) -> int:
    """The K of a module known by ``names``: the last rule whose glob matches one of them, else ``default``."""
    import fnmatch

    bits = default
    for n, (glob, k) in enumerate(rules):
        if any(fnmatch.fnmatchcase(name, glob) for name in names):
            bits = k
            used.add(n)
    return bits


def _bits_for_json(plan: HydratePlan) -> dict[str, Any]:
    """The modules stored at another K than the plan's, for the resume's job file (nothing without --bits-for)."""
    other = {m.module: m.bits for m in plan.modules if m.bits and m.bits != plan.bits}
    return {"bits_for": other} if other else {}


def plan_hydrate(request, out: str | Path, *, leave_unaligned: bool = True, environ: Optional[dict] = None,
                 bits_for: Sequence[str | tuple[str, int]] = ()) -> HydratePlan:
    """The hydrate plan of ``request.model`` into ``out``: ``cache warm``'s layer plan at TP 1, each layer checked
    for the fork's loader at every TP size OUT must start at; headers only.

    The TP sizes are ``request.tp_sizes``, or, when empty, every size up to ``MAX_TP`` vLLM can split the model
    into (``LayerPlan.shardable_tp_sizes``): OUT starts wherever SOURCE starts. A layer a server at one of them
    could not slice stays BF16, as in SOURCE, and is listed with those sizes (``left_bf16``, ``left_tp``); the
    other sizes up to ``MAX_TP`` where a stored layer could not be sliced are recorded in OUT (``fails_at``).
    Refuses (ConfigError / InputError, one line): OUT inside SOURCE or existing, a checkpoint the server does not
    encode online (a BF16 model, a plan with no layer), kinds whose stored layers the fork reads another way
    (rank-sliced routed experts, the GLM-5.3 routed-only scope), a TP size vLLM cannot split the model into, and a
    plan where every layer is left BF16.
    Example: ``hydrate(plan_hydrate(ServerRequest(model="./m", tp_sizes=()), "./m-k6"))``.

    Args:
        request: the server's settings (``ServerRequest``): SOURCE as ``model``, bits, overlay, dtype, the TP sizes
            OUT must serve (empty: every one), ``layers`` / ``exclude``.
        out: the new checkpoint folder.
        leave_unaligned: kept for callers of earlier versions; layers that cannot be sliced are always left BF16.
        environ: the environment the plan's defaults are read from (None: ``os.environ``).
        bits_for: per-module K, ``"GLOB=K"`` or ``(GLOB, K)`` each (``--bits-for``): the last rule whose fnmatch glob
            matches a stored module (its checkpoint name, or its vLLM layer or source prefix) gives its K; every
            other module takes ``request.bits``. A rule that matches no stored module is refused.

    Returns:
        A ``HydratePlan`` (``as_json()``: the ``--dry-run --json`` document); ``already_stored`` says why there is
        nothing to do when SOURCE is hydrated already.
    """
    from exl3tool.checkpoint import open_checkpoint, plan_layers, resolve_overlay
    from exl3tool.checkpoint.overrides import parse_hf_overrides
    from exl3tool.cache.settings import server_bits
    from exl3tool.plan.request import prepare, serving_torch_dtype

    request = replace(request, bits=server_bits(request.bits, os.environ if environ is None else environ))
    rules = bits_rules(bits_for)
    if not os.path.isdir(os.path.expanduser(request.model)):
        raise InputError(f"SOURCE {request.model}: not a checkpoint folder; hydrate reads a local checkpoint "
                         "(download a Hub model first, e.g. `hf download REPO --local-dir DIR`)")
    source = Path(os.path.expanduser(request.model)).resolve()
    out_path = Path(os.path.expanduser(str(out))).absolute()
    out_path = out_path.parent.resolve() / out_path.name
    overlay = resolve_overlay(request.quantization_config, shared_experts=request.shared_experts)
    checkpoint = open_checkpoint(str(source), hf_overrides=parse_hf_overrides(request.hf_overrides))
    layers, exclude = list(request.layers) or None, list(request.exclude) or None
    try:
        layer_plan = plan_layers(checkpoint, overlay=overlay, layers=layers, exclude=exclude,
                                 language_model_only=request.language_model_only)
    except ConfigError:
        if not layers:
            raise
        # --layers matching only stored modules: a re-run on OUT of a hydrate made with the same globs is a no-op
        layer_plan = plan_layers(checkpoint, overlay=overlay, language_model_only=request.language_model_only)
        import fnmatch

        picked = [e for e in layer_plan.excluded if any(fnmatch.fnmatchcase(e.prefix, g) for g in layers)]
        if not picked or any(e.reason != "stored_exl3" for e in picked) or not _hydrated_by_us(
                checkpoint, _storage_location(checkpoint)):
            raise
        files = _files(source)
        total = sum((source / f).stat().st_size for f in files)
        return HydratePlan(source=source, out=out_path, model=str(source), bits=request.bits,
                           tp_sizes=tuple(sorted(set(request.tp_sizes or (1,)))), dtype=str(checkpoint.dtype)
                           .removeprefix("torch."), layers=(), left_bf16=(), not_planned=(), changed_shards=(),
                           unchanged_files=tuple(files), bytes_before=total, bytes_after=total,
                           storage_file=_storage_location(checkpoint), checkpoint=checkpoint,
                           already_stored=f"every layer --layers selects is stored ({plural(len(picked), 'module')})")
    kind = layer_plan.kind
    if kind is not None and kind.kind != "exl3":
        raise ConfigError(
            f"{source}: a {kind.kind} checkpoint cannot be hydrated: the fork reads its stored layers "
            + ("from config.json alone (its rank-sliced metadata, never quantization_config.json) and its routed "
               "experts per rank, a format exl3tool does not write" if kind.kind == "rank_sliced" else
               "under the glm53_routed_experts_only scope, which counts every dense linear as BF16 whatever is "
               "stored (and needs the scope's inline config)")
            + "; serve it with a warm cache instead (`exl3tool cache warm`)")
    if not layer_plan.server_lookup:
        raise ConfigError(f"{source}: the server would not encode any layer of this checkpoint online "
                          f"({'; '.join(layer_plan.notes[:1])}); there is nothing to hydrate")
    whole = layer_plan if not (layers or exclude) else plan_layers(  # the server builds every layer
        checkpoint, overlay=overlay, language_model_only=request.language_model_only)
    shardable = whole.shardable_tp_sizes(MAX_TP)
    tp_sizes = tuple(sorted(set(request.tp_sizes))) or shardable
    for tp in tp_sizes:  # vLLM cannot shard the model at all there: say so before anything else
        why = whole.shard_problem(tp)
        if why:
            raise ConfigError(why)
    dtype = serving_torch_dtype(request.dtype) or checkpoint.dtype
    base = dict(source=source, out=out_path, model=str(source), bits=request.bits, tp_sizes=tp_sizes,
                dtype=str(dtype).removeprefix("torch."), checkpoint=checkpoint,
                storage_file=_storage_location(checkpoint), tp_default=not request.tp_sizes)
    files = _files(source)
    total = sum((source / f).stat().st_size for f in files)
    not_planned = tuple((e.prefix, e.reason, e.detail) for e in layer_plan.excluded)
    stored = stored_only_reason(layer_plan, (1,))
    if stored:  # already hydrated (or stored by its converter): nothing to write
        return HydratePlan(**base, layers=(), left_bf16=(), not_planned=not_planned, changed_shards=(),
                           unchanged_files=tuple(files), bytes_before=total, bytes_after=total, already_stored=stored)
    _check_paths(source, out_path)
    # cache warm's plan at TP 1, the same function (prepare) with the cache off: the layers a TP 1 server encodes
    _, warm_plan, _ = prepare(replace(request, model=str(source), tp_sizes=(1,), tp_ranks=None, mode="off"),
                              environ=environ)
    hydrated: list[HydrateLayer] = []
    stored_layers: list[tuple[Any, list[SourceModule]]] = []
    left: list[tuple[str, str]] = []
    left_tp: dict[str, tuple[int, ...]] = {}
    used: set[int] = set()  # the --bits-for rules that matched a stored module
    family = layer_plan.family
    packed = family.packed(layer_plan.text) if family is not None and layer_plan.text is not None else {}
    mapper = family.storage_mapper if family is not None else ()
    aliases = family.aliases if family is not None else ()
    for job in warm_plan.jobs:
        if job.state == "skipped":
            continue  # a TP 1 server keeps it MXFP8 (not 128-aligned): no look-up, nothing to store
        layer = job.rank_job.layer
        rows = {name: checkpoint.info(name).shape[0] for name in layer.sources}
        sources = source_modules(layer, rows)
        problem = storage_problem(layer, sources)
        at = tp_problems(layer, sources, tp_sizes) if problem is None else {}
        if problem or at:  # kept BF16, as in SOURCE: a server at any TP size loads it as it loads SOURCE's
            left.append((layer.prefix, problem or at[min(at)]))
            left_tp[layer.prefix] = tuple(sorted(at))
            continue
        stored_layers.append((layer, sources))
        mods = []
        for i, s in enumerate(sources):
            info = checkpoint.info(s.weight)
            k, n = s.in_features, s.out_features
            stored_as = _primary_spelling(s.module, aliases)
            vllm_name = _source_prefix(layer, i, packed)
            bits = _module_bits(rules, (stored_as, s.module, vllm_name, layer.prefix), request.bits, used)
            exl3 = tensor_nbytes((k // 16, n // 16, 16 * bits), "I16") + 2 * (k + n) + 4
            key = _record_key(stored_as, vllm_name, mapper)
            mods.append(HydrateModule(s, _layer_seed(layer, s), info.file.name,
                                      tensor_nbytes(info.shape, info.dtype_code), exl3, key, stored_as, bits))
        hydrated.append(HydrateLayer(layer.prefix, layer.parallel, tuple(mods)))
    base.update(left_tp=left_tp)
    unused = [f"{glob}={k}" for n, (glob, k) in enumerate(rules) if n not in used]
    if unused and hydrated:
        raise ConfigError(f"--bits-for {unused[0]} matches no module hydrate stores; a glob matches checkpoint modules "
                          f"(e.g. '{hydrated[0].modules[0].module}') or vLLM layer prefixes "
                          f"(e.g. '{hydrated[0].prefix}')")
    if not hydrated and left and _hydrated_by_us(checkpoint, base["storage_file"]):
        return HydratePlan(**base, layers=(), left_bf16=tuple(left), not_planned=not_planned, changed_shards=(),
                           unchanged_files=tuple(files), bytes_before=total, bytes_after=total,
                           already_stored=f"every storable layer is stored; {plural(len(left), 'layer')} left BF16")
    if not hydrated:
        sizes = ",".join(map(str, tp_sizes))
        narrow = "; narrow --tp-size to the sizes you serve" if any(left_tp.values()) else ""
        raise ConfigError(f"{source}: nothing to hydrate for TP {sizes}: every layer a TP 1 server encodes online "
                          f"stays BF16 ({left[0][0]}: {left[0][1]}){narrow}" if left else
                          f"{source}: nothing to hydrate")
    fails_at: dict[int, str] = {}
    for tp in shardable:  # the sizes not asked for: recorded in OUT, so `cache check` there names the layer
        if tp in tp_sizes:
            continue
        why = next((f"{layer.prefix}: {w}" for layer, srcs in stored_layers
                    if (w := slicing_problem(layer, srcs, tp))), None)
        if why:
            fails_at[tp] = why
    base.update(fails_at=fails_at)
    changed = sorted({m.shard for layer in hydrated for m in layer.modules})
    meta_files = {_INDEX, base["storage_file"]}
    unchanged = tuple(f for f in files if f not in changed and f not in meta_files)
    removed = sum(m.weight_bytes for layer in hydrated for m in layer.modules)
    added = sum(m.exl3_bytes for layer in hydrated for m in layer.modules)
    return HydratePlan(**base, layers=tuple(hydrated), left_bf16=tuple(left), not_planned=not_planned,
                       changed_shards=tuple(changed), unchanged_files=unchanged, bytes_before=total,
                       bytes_after=total - removed + added)


# --------------------------------------------------------------------------------------------------------------
# the run


def _fingerprint(plan: HydratePlan, m: HydrateModule) -> str:
    """What a kept per-layer result was made from: a change to any of it (a re-downloaded shard, other bits or
    dtype) makes the resume encode the module again."""
    st = (plan.source / m.shard).stat()
    return json.dumps({"weight": m.source.weight, "shard": m.shard, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                       "bits": m.bits or plan.bits, "seed": m.seed, "dtype": plan.dtype, "schema": 1}, sort_keys=True)


def _job_json(plan: HydratePlan) -> str:
    return json.dumps({"source": str(plan.source), "bits": plan.bits, "dtype": plan.dtype, **_bits_for_json(plan),
                       "modules": [m.module for m in plan.modules]}, sort_keys=True)


def temp_dir(out: Path) -> Path:
    """The temporary folder a hydrate into ``out`` writes in, beside it."""
    return out.parent / f".{out.name}{TEMP_SUFFIX}"


def lock_file(out: Path) -> Path:
    """The lock a hydrate into ``out`` holds while it runs, beside it (not in the temporary folder, which becomes
    OUT): a second hydrate into the same OUT is refused at once instead of writing into the first one's folder."""
    return out.parent / f".{out.name}.hydrate.lock"


@contextmanager
def _exclusive(out: Path):
    """Hold ``lock_file(out)`` or refuse: one hydrate per OUT at a time. Removed when the run leaves nothing to
    resume (OUT written: a later hydrate into it is refused because it exists; or no temporary folder); kept beside
    a partial run's temporary folder, which the next run resumes."""
    from filelock import FileLock, Timeout

    path = lock_file(out)
    lock = FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise ConfigError(f"{out}: another hydrate into it is running (it holds {path}); wait for it to finish, or "
                          "stop it and run this command again to resume its work") from None
    except OSError as exc:
        raise InputError(f"{out.parent}: cannot create {path.name} there ({exc.strerror}); choose a writable folder "
                         "for OUT") from None
    try:
        yield
    finally:
        lock.release()
        if out.exists() or not temp_dir(out).exists():
            path.unlink(missing_ok=True)


def _result_path(work: Path, module: str) -> Path:
    return work / "layers" / (hashlib.sha256(module.encode()).hexdigest()[:24] + ".safetensors")


def _load_result(path: Path, fingerprint: str) -> Optional[dict[str, torch.Tensor]]:
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("fingerprint") != fingerprint:
                return None
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception:  # a result cut short: encode it again
        return None


def _save_result(path: Path, tensors: dict[str, torch.Tensor], fingerprint: str) -> None:
    from safetensors.torch import save_file

    part = path.with_suffix(".part")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(part), metadata={"fingerprint": fingerprint})
    with open(part, "rb") as f:
        os.fsync(f.fileno())
    os.replace(part, path)


def _encode_module(plan: HydratePlan, m: HydrateModule, encode: Optional[EncodeFn], device: torch.device):
    from exl3tool.checkpoint import encoder_input

    checkpoint = plan.checkpoint
    dtype = getattr(torch, plan.dtype)
    weight = encoder_input(checkpoint.read(m.source.weight).to(dtype))  # as warm's _prepare_input at TP 1
    if not torch.isfinite(weight).all():
        raise InputError(f"{m.source.weight}: {int((~torch.isfinite(weight)).sum())} non-finite values; the server "
                         "would refuse to encode it, and hydrate stores nothing for it")
    if encode is None:
        from exl3tool.encode import encode_linear

        return encode_linear(weight.to(device), bits=m.bits or plan.bits, seed=m.seed, device=device, name=m.module)
    return encode(weight, m.bits or plan.bits, m.seed, device)


def _free_space_check(plan: HydratePlan, temp: Path, pending: list[HydrateModule]) -> None:
    same_fs = os.stat(plan.source).st_dev == os.stat(plan.out.parent).st_dev
    shards = sum((plan.source / s).stat().st_size for s in plan.changed_shards)
    added = sum(m.exl3_bytes for m in plan.modules)
    needed = shards + added + sum(m.exl3_bytes + 4096 for m in pending) + 65536
    if not same_fs:
        needed += sum((plan.source / f).stat().st_size for f in plan.unchanged_files)
    free = shutil.disk_usage(plan.out.parent).free
    if free < needed:
        raise InputError(f"{plan.out.parent}: {free / 2**20:.1f} MiB free on its filesystem, but hydrate writes "
                         f"{needed / 2**20:.1f} MiB ({plural(len(plan.changed_shards), 'shard')}"
                         f"{'' if same_fs else ' and copies of the unchanged files'}); free space or choose another OUT")


def _link_or_copy(src: Path, dst: Path) -> bool:
    """Hard-link ``src`` at ``dst`` (True), else copy it with its times (False)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() or dst.is_symlink():
        dst.unlink()
    src = src.resolve()  # a Hub snapshot's files are links into ../../blobs: link or copy what they point at
    try:
        os.link(src, dst)
        return True
    except OSError:
        part = dst.with_name(dst.name + ".part")
        shutil.copy2(src, part)
        os.replace(part, dst)
        return False


def _write_json(path: Path, data: dict, indent: int) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(data, indent=indent) + "\n")
    if path.exists() or path.is_symlink():
        path.unlink()  # never write through a hard link into SOURCE
    os.replace(part, path)


def _assemble(plan: HydratePlan, temp: Path, results: dict[str, dict[str, torch.Tensor]]) -> tuple[int, int]:
    """Write OUT's files into ``temp``: changed shards, links to the rest, the index and tensor_storage."""
    linked = copied = 0
    for rel in plan.unchanged_files:
        if _link_or_copy(plan.source / rel, temp / rel):
            linked += 1
        else:
            copied += 1
    by_weight = {m.source.weight: m for m in plan.modules}
    new_names: dict[str, str] = {}  # tensor name -> shard
    shapes: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}
    for shard in plan.changed_shards:
        header, _ = read_header(plan.source / shard)
        meta = header.pop("__metadata__", None)
        order: list[tuple[str, object]] = []
        for name in sorted(header, key=lambda n: header[n]["data_offsets"][0]):
            m = by_weight.get(name)
            if m is None:
                order.append((name, None))
                continue
            for suffix in EXL3_SUFFIXES:
                tname = f"{m.module}.{suffix}"
                order.append((tname, results[m.module][tname]))
                new_names[tname] = shard
        part = temp / (shard + ".part")
        write_shard(part, plan.source / shard, order, meta)
        dest = temp / shard
        if dest.exists():
            dest.unlink()
        os.replace(part, dest)
    for m in plan.modules:
        rec: dict[str, tuple[tuple[int, ...], str]] = {}
        for suffix in EXL3_SUFFIXES:
            t = results[m.module][f"{m.module}.{suffix}"]
            rec[f"{m.module}.{suffix}"] = (tuple(t.shape), DTYPE_CODES[t.dtype])
        bias = f"{m.source.module}.bias"
        if plan.checkpoint.has_tensor(bias):
            info = plan.checkpoint.info(bias)
            rec[bias] = (tuple(info.shape), info.dtype_code)
        shapes[m.module] = rec
    if (plan.source / _INDEX).is_file():
        index = json.loads((plan.source / _INDEX).read_text())
        wm = {k: v for k, v in index.get("weight_map", {}).items() if k not in by_weight}
        wm.update(new_names)
        index["weight_map"] = dict(sorted(wm.items()))
        total = 0
        for shard in sorted(set(wm.values())):
            h, _ = read_header(temp / shard)
            total += sum(r["data_offsets"][1] - r["data_offsets"][0] for k, r in h.items() if k != "__metadata__")
        index.setdefault("metadata", {})["total_size"] = total
        _write_json(temp / _INDEX, index, 2)
    records = {m.record_key or m.module: storage_record(m.module, shapes[m.module], plan.bits) for m in plan.modules}
    note = plan.note()
    if plan.storage_file == "config.json":
        cfg = json.loads((plan.source / "config.json").read_text())
        cfg["quantization_config"]["tensor_storage"].update(records)
        cfg["quantization_config"][HYDRATED_BY] = note
        _write_json(temp / "config.json", cfg, 2)
    else:
        qc = json.loads((plan.source / _QUANT).read_text())
        qc.setdefault("tensor_storage", {}).update(records)
        qc[HYDRATED_BY] = note
        _write_json(temp / _QUANT, qc, 4)
    return linked, copied


def _share(modules: list[HydrateModule], workers: int) -> list[list[HydrateModule]]:
    """Modules split between workers by tiles, largest first, each to the least loaded (the same on every worker)."""
    shares: list[list[HydrateModule]] = [[] for _ in range(workers)]
    load = [0] * workers
    for m in sorted(modules, key=lambda m: (-(m.source.in_features * m.source.out_features), m.module)):
        w = load.index(min(load))
        shares[w].append(m)
        load[w] += m.source.in_features * m.source.out_features
    return shares


def hydrate(plan: HydratePlan, *, device: str = "auto", encode: Optional[EncodeFn] = None,
            on_layer: Optional[LayerFn] = None) -> Optional[HydrateReport]:
    """Run ``plan``: encode (or reuse) every module, write OUT atomically. Returns the report.

    A run killed at any point leaves SOURCE untouched and OUT absent; the same command resumes from the per-layer
    results kept in the temporary folder beside OUT and writes the same bytes. ``encode`` replaces the encoder
    (tests); ``on_layer(done, total, module, seconds, reused)`` hears of each module. Under ``torchrun`` each
    process encodes its share (by tiles) on its GPU, and worker 0 writes OUT and returns the report (None elsewhere).

    Args:
        plan: ``plan_hydrate``'s result.
        device: auto (this process's GPU under torchrun, else CPU), cpu, cuda or cuda:N.
        encode: an encoder ``(weight [K, N] float32, bits, seed, device) -> EncodedLinear`` (None: ``encode_linear``).
        on_layer: hears of each module done.

    Returns:
        A ``HydrateReport`` (``as_json()``: the ``--json`` document), or None on a torchrun worker other than 0.
    """
    from exl3tool.operations.warm.distributed import distributed_context

    start = time.perf_counter()
    if plan.already_stored:
        return HydrateReport(plan, 0, 0, 0, 0, plan.bytes_before, 0.0, noop=True)
    ctx = distributed_context()
    if ctx.worker != 0:
        return _run(plan, ctx, device, encode, on_layer, start)
    _check_paths(plan.source, plan.out)  # bad paths refused before anything is created beside OUT
    with _exclusive(plan.out):
        return _run(plan, ctx, device, encode, on_layer, start)


def _run(plan: HydratePlan, ctx, device: str, encode: Optional[EncodeFn], on_layer: Optional[LayerFn],
         start: float) -> Optional[HydrateReport]:
    """``hydrate``'s work, worker 0 holding OUT's lock."""
    from exl3tool.plan.request import resolve_device

    dev = resolve_device(device, ctx.local_rank)
    temp = temp_dir(plan.out)
    work = temp / _WORK
    mods = plan.modules
    fingerprints = {m.module: _fingerprint(plan, m) for m in mods}
    if ctx.worker == 0:
        _prepare_temp(plan, temp, work, fingerprints)
    if ctx.initialised:
        import torch.distributed as dist

        dist.barrier()
    mine = _share(mods, ctx.workers)[ctx.worker] if ctx.initialised else mods
    encoded = reused = 0
    results: dict[str, dict[str, torch.Tensor]] = {}
    for i, m in enumerate(mine, 1):
        t0 = time.perf_counter()
        path = _result_path(work, m.module)
        got = _load_result(path, fingerprints[m.module])
        was_kept = got is not None
        if got is None:
            enc = _encode_module(plan, m, encode, dev)
            got = exl3_tensors_of(m.module, enc.trellis, enc.suh, enc.svh)
            _save_result(path, got, fingerprints[m.module])
            encoded += 1
        else:
            reused += 1
        results[m.module] = got
        if on_layer is not None:
            on_layer(i, len(mine), m.module, time.perf_counter() - t0, was_kept)
    if ctx.initialised:
        import torch.distributed as dist

        counts: Optional[list] = [None] * ctx.workers if ctx.worker == 0 else None
        dist.gather_object((encoded, reused), counts, dst=0)
        dist.destroy_process_group()  # before any worker exits: gloo's threads abort a process that leaves them running
        if ctx.worker != 0:
            return None
        assert counts is not None
        encoded, reused = sum(c[0] for c in counts), sum(c[1] for c in counts)
        for m in mods:  # the other workers' results, from the folder they wrote them to
            if m.module not in results:
                got = _load_result(_result_path(work, m.module), fingerprints[m.module])
                if got is None:
                    raise InputError(f"{m.module}: a worker's result is missing from {work}; run the command again "
                                     "to resume")
                results[m.module] = got
    linked, copied = _assemble(plan, temp, results)
    shutil.rmtree(work)
    os.rename(temp, plan.out)
    after = sum((plan.out / f).stat().st_size for f in _files(plan.out))
    return HydrateReport(plan, encoded, reused, linked, copied, after, round(time.perf_counter() - start, 3))


def _prepare_temp(plan: HydratePlan, temp: Path, work: Path, fingerprints: dict[str, str]) -> None:
    """Worker 0, before any encode: OUT still free, the temporary folder ours (or new), room for what is written."""
    _check_paths(plan.source, plan.out)
    job = _job_json(plan)
    if temp.exists():
        known = (work / "job.json").read_text() if (work / "job.json").is_file() else None
        if known != job:
            raise ConfigError(f"{temp}: a partial hydrate with other settings (or not exl3tool's) is there; remove "
                              "it to start over, or run the command that made it to resume it")
    pending = [m for m in plan.modules if _load_result(_result_path(work, m.module), fingerprints[m.module]) is None]
    _free_space_check(plan, temp, pending)
    try:
        (work / "layers").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{plan.out.parent}: cannot create {temp.name} there ({exc.strerror}); choose a "
                         "writable folder for OUT") from None
    if not (work / "job.json").is_file():
        (work / "job.json").write_text(job)
