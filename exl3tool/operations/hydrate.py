"""`exl3tool hydrate`: a new checkpoint in which every layer the server would encode online is stored as EXL3.

``plan_hydrate`` decides what to store from ``cache warm``'s own plan at TP 1 (``plan.request.prepare``, one rule,
one place), then checks each layer against the fork's loader at every TP size OUT must start at (by default every
size up to 8 a server of SOURCE starts at; ``checkpoint.slicing.storage_problem`` / ``slicing_problem``). ``hydrate`` runs it: each source module is encoded once
(``encode_linear``, the bytes ``cache warm`` writes for an unfused layer at TP 1), kept under a temporary folder
beside OUT so a stopped run resumes (``STEPS``), then the changed shards are written from SOURCE and those files
(bytes copied, never held in memory), the others hard-linked (else copied), the index and ``tensor_storage``
rewritten, and the assembled folder renamed to OUT. Nothing is written to SOURCE. The rules and their sources in the
fork: docs/hydrate.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from exl3tool.checkpoint.hydrate_record import HYDRATED_BY, hydrate_note
from exl3tool.checkpoint.hydrated import (
    EXL3_SUFFIXES, FileTensor, SourceModule, exl3_tensors_of, read_header, slicing_problem, source_modules,
    storage_problem, storage_record, tensor_nbytes, tp_problems, write_shard,
)
from exl3tool.checkpoint.slicing import load_order
from exl3tool.errors import ConfigError, InputError
from exl3tool.text import plural

__all__ = ["HydrateLayer", "HydratePlan", "HydrateReport", "plan_hydrate", "hydrate", "stored_only_reason",
           "TEMP_SUFFIX", "temp_dir", "bits_rules", "stopped_state"]

TEMP_SUFFIX = ".hydrate-partial"  # the temporary folder beside OUT: ".<OUT name>.hydrate-partial"
_INDEX = "model.safetensors.index.json"
_QUANT = "quantization_config.json"
STORED_BITS = (1, 8)  # the K a stored module may have: exl3.py _validate_loaded_tensors reads 1 to 8 from its trellis
MAX_TP = 8  # the default TP sizes: every size up to this one that a server of SOURCE starts at

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
    left_bf16: tuple[tuple[str, str], ...]  # (prefix, why) of planned layers kept BF16 (not storable at a TP size)
    not_planned: tuple[tuple[str, str, str], ...]  # (prefix, reason, why) as `cache warm --dry-run` lists them
    changed_shards: tuple[str, ...]
    unchanged_files: tuple[str, ...]
    bytes_before: int  # every file of SOURCE
    bytes_after: int  # every file of OUT, estimated: tensor bytes change; headers and JSON files grow a little
    storage_file: str  # where tensor_storage lives: quantization_config.json or config.json (inline)
    already_stored: str = ""  # non-empty: nothing to do, every online layer is stored already (why)
    checkpoint: Any = field(default=None, compare=False, repr=False)
    tp_default: bool = False  # tp_sizes are the default (every size up to MAX_TP a server of SOURCE starts at)
    left_tp: dict[str, tuple[int, ...]] = field(default_factory=dict)  # left_bf16 prefix -> the TP sizes it fails at
    fails_at: dict[int, str] = field(default_factory=dict)  # other TP sizes <= MAX_TP where OUT fails: "layer: why"
    # (prefix, why) of modules the server encodes online that exl3tool does not model: OUT does not store them, so
    # a server of OUT still encodes them at start-up (a vision tower the overlay does not ignore)
    not_modelled: tuple[tuple[str, str], ...] = ()
    left_out: tuple[str, ...] = ()  # SOURCE's hidden folders (.git, .cache, ...): tool data, not copied into OUT

    @property
    def modules(self) -> list[HydrateModule]:
        return [m for layer in self.layers for m in layer.modules]

    def bits_by_module(self) -> dict[str, int]:
        """The modules stored at another K than ``bits`` (``--bits-for``), by name."""
        return {m.module: m.bits for m in sorted(self.modules, key=lambda m: m.module) if m.bits and m.bits != self.bits}

    def note(self) -> dict[str, Any]:
        """The ``exl3tool_hydrate`` record written into OUT beside ``tensor_storage`` (``checkpoint.hydrate_record``):
        the TP sizes checked, those up to ``MAX_TP`` where a stored layer cannot be sliced, what is stored."""
        mods = sorted(self.modules, key=lambda m: m.module)
        return hydrate_note(bits=self.bits, tp_sizes=self.tp_sizes, modules={m.module: m.source.weight for m in mods},
                            bits_by_module=self.bits_by_module(),
                            left_bf16=[p for p, _ in self.left_bf16],
                            left_tp=self.left_tp, fails_at=self.fails_at, checked_up_to=MAX_TP,
                            not_modelled=[p for p, _ in self.not_modelled])

    def _left_json(self) -> list[dict[str, Any]]:
        return [{"prefix": p, "why": w, "tp_sizes": list(self.left_tp.get(p, ()))} for p, w in self.left_bf16]

    def _not_modelled_json(self) -> list[dict[str, str]]:
        return [{"prefix": p, "why": w} for p, w in self.not_modelled]

    def as_json(self) -> dict[str, Any]:
        """The `hydrate --dry-run --json` document (docs/hydrate.md)."""
        mods = self.modules
        return {"source": str(self.source), "out": str(self.out), "model": self.model, "bits": self.bits,
                "tp_sizes": list(self.tp_sizes), "tp_default": self.tp_default,
                "fails_at": {str(tp): why for tp, why in sorted(self.fails_at.items())}, "dtype": self.dtype,
                "already_stored": self.already_stored or None,
                "layers": [layer.as_json() for layer in self.layers], "modules": len(mods),
                "tiles": sum((m.source.in_features // 16) * (m.source.out_features // 16) for m in mods),
                "left_bf16": self._left_json(), "not_modelled": self._not_modelled_json(),
                "left_out": list(self.left_out),
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
                "reused": self.reused, "left_bf16": p._left_json(), "not_modelled": p._not_modelled_json(),
                "left_out": list(p.left_out),
                "shards_written": len(p.changed_shards), "files_linked": self.linked, "files_copied": self.copied,
                "bytes": {"before": p.bytes_before, "after": self.bytes_after}, "seconds": self.seconds}


# --------------------------------------------------------------------------------------------------------------
# the plan


def stored_only_reason(layer_plan, tp_sizes=(1,)) -> str:
    """Non-empty when a server at ``tp_sizes`` looks nothing up *because* the layers it would encode online are
    stored as EXL3: no planned layer is 128-aligned there and at least one module is stored (the one rule `cache
    check` and `hydrate` use to say "every online layer is stored"). Where the server also encodes modules exl3tool
    does not model (``not_modelled``: a vision tower the overlay does not ignore), it says so instead of "every
    online layer": those are encoded online, and looked up, whatever is stored."""
    if not layer_plan.server_lookup:
        return ""
    try:
        looked_up = sum(len(layer_plan.for_tp(tp)) for tp in tp_sizes)
    except ConfigError:
        return ""
    reasons = [e.reason for e in layer_plan.excluded]
    if looked_up or "stored_exl3" not in reasons:
        return ""
    unmodelled = [e.prefix for e in layer_plan.excluded if e.reason == "not_modelled"]
    stored = reasons.count("stored_exl3")
    rest = len(reasons) - stored - len(unmodelled)
    kept = len(layer_plan.layers)
    what = (f"{plural(stored, 'module')} stored as EXL3 in the checkpoint"
            + (f", {rest} kept BF16 by the overlay (ignored or without a spec)" if rest else "")
            + (f", {plural(kept, 'layer')} the server keeps MXFP8 (not 128-aligned)" if kept else ""))
    if unmodelled:
        return (f"every layer exl3tool models is stored ({what}), but the server still encodes "
                f"{', '.join(unmodelled)} online, which exl3tool does not model")
    return f"every online layer is stored: {what}"


def refuse_other_launch_model(source: str, settings) -> None:
    """ConfigError (exit 2, one line naming both) when ``hydrate --launch L SOURCE OUT`` is given a launch that
    serves another model than SOURCE: its bits, overlay, TP size and dtype are that model's server's, so a plan of
    SOURCE with them would be silently wrong. Same model: the launch's folder, as seen here (through its volumes),
    resolves to SOURCE's. A launch that names no model, or no launch (``settings`` None), is not judged."""
    if settings is None:
        return
    named = settings.settings.get("model")
    if named is None or named.source != "launch argument":
        return  # the launch names no model: SOURCE is the model
    here = Path(os.path.expanduser(source)).resolve()
    seen = settings.model_seen_here
    if seen is not None and Path(os.path.expanduser(seen)).resolve() == here:
        return
    where = (f"{named.value} (here: {seen})" if seen is not None and seen != named.value else
             f"{named.value}" + ("" if seen is not None else ", which is not a folder seen here"))
    raise ConfigError(f"the launch serves {where}, not SOURCE {source}: its bits, overlay, TP size and dtype are "
                      "that model's server's; give the launch that serves SOURCE, or SOURCE's settings as options "
                      "(--bits, --quantization-config, --tp-size) without --launch")


def nothing_encoded_online(request, environ: Optional[dict] = None) -> str:
    """Why a server of ``request.model`` (a local checkpoint) encodes nothing online at its TP sizes (default 1):
    every layer it would encode is stored (``stored_only_reason``, and no module it encodes is outside exl3tool's
    model), so it computes no cache key and needs no encoder identity; "" otherwise (or when it cannot tell)."""
    from exl3tool.checkpoint import open_checkpoint, plan_layers, resolve_overlay
    from exl3tool.checkpoint.overrides import parse_hf_overrides
    from exl3tool.errors import Exl3ToolError

    model = os.path.expanduser(request.model or "")
    if not model or not os.path.isdir(model):
        return ""
    try:
        checkpoint = open_checkpoint(model, hf_overrides=parse_hf_overrides(request.hf_overrides))
        layer_plan = plan_layers(checkpoint, overlay=resolve_overlay(request.quantization_config),
                                 language_model_only=request.language_model_only, release=request.release)
    except Exl3ToolError:
        return ""
    why = stored_only_reason(layer_plan, tuple(request.tp_sizes) or (1,))
    return "" if not why or not_modelled(layer_plan) else why


def not_modelled(layer_plan) -> list[tuple[str, str]]:
    """``(prefix, why)`` of the modules a server encodes online that exl3tool does not model (``plan_layers``'
    ``not_modelled``): hydrate cannot store them, so a server of OUT still encodes them at start-up."""
    return [(e.prefix, e.detail) for e in layer_plan.excluded if e.reason == "not_modelled"]


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
    if (out.exists() or out.is_symlink()) and not _committed(out):
        raise ConfigError(f"OUT {out} exists; hydrate writes a new checkpoint: remove it or name a new folder")
    if not out.parent.is_dir():
        raise ConfigError(f"OUT {out}: its parent folder {out.parent} does not exist; create it first")


_HUB_REPO_KINDS = ("models", "datasets", "spaces")


def source_boundary(source: Path) -> Path:
    """The folder every file of ``source`` (resolved) must resolve into: ``source`` itself, or, for a Hub cache
    snapshot (``models--org--name/snapshots/REV``, whose files are links to ``../../blobs/SHA``: huggingface_hub's
    cache layout), its repository folder."""
    snapshots, repo = source.parent, source.parent.parent
    kind, sep, name = repo.name.partition("--")
    if snapshots.name == "snapshots" and kind in _HUB_REPO_KINDS and sep and name and (repo / "blobs").is_dir():
        return repo
    return source


def _refuse_entry(shown: Path, what: str, link: bool = True) -> InputError:
    fix = ("copy what it points at into SOURCE (`cp -L`) or remove the link" if link else "remove it from SOURCE")
    return InputError(f"{shown}: {what}; OUT (what you upload) holds SOURCE's own files only: {fix}, then run the "
                      "command again")


def _files(root: Path, hidden: Optional[list[str]] = None) -> list[str]:
    """Every file of the checkpoint folder ``root``, relative: each folder's files sorted, then its folders (hidden
    files included; hidden folders, a tool's data such as ``.git``, ``.cache``, ``.store``, are not the model: left
    out and, when ``hidden`` is given, appended to it, relative). A link is followed where it resolves inside ``source_boundary(root)`` (a file, or a folder
    walked by the same rule); a link that resolves elsewhere, a dangling one, a link to a folder that holds it,
    and a fifo, device or socket are refused naming the entry (InputError): nothing outside SOURCE reaches OUT."""
    real_root = Path(os.path.realpath(root))
    boundary = source_boundary(real_root)
    out: list[str] = []

    def walk(real: Path, rel: Path, ancestors: tuple[Path, ...]) -> None:
        try:
            entries = sorted(os.scandir(real), key=lambda e: e.name)
        except OSError as exc:
            raise InputError(f"{root / rel}: cannot list it ({exc.strerror})") from None
        folders: list[tuple[Path, Path]] = []
        for e in entries:
            shown = root / rel / e.name
            target = Path(e.path)
            if e.is_symlink():
                target = Path(os.path.realpath(e.path))
                if not os.path.lexists(target):
                    raise _refuse_entry(shown, f"a link to {os.readlink(e.path)}, which does not exist")
                if not _inside(target, boundary):
                    raise _refuse_entry(shown, f"a link to {target}, outside "
                                               f"{'its Hub repository ' if boundary != real_root else 'SOURCE '}"
                                               f"{boundary}")
            try:
                mode = os.stat(target).st_mode
            except OSError:
                raise _refuse_entry(shown, f"a link to {os.readlink(e.path)}, which does not exist") from None
            if stat.S_ISDIR(mode) and e.name.startswith("."):
                if hidden is not None:
                    hidden.append(str(rel / e.name))
                continue
            if stat.S_ISDIR(mode):
                if target in ancestors:
                    raise _refuse_entry(shown, f"a link to {target}, a folder that holds it (a loop)")
                folders.append((target, rel / e.name))
            elif stat.S_ISREG(mode):
                out.append(str(rel / e.name))
            else:
                kind = ("a fifo" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                        else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
                raise _refuse_entry(shown, kind + (" (through a link)" if e.is_symlink() else ""), e.is_symlink())
        for target, sub in folders:
            walk(target, sub, ancestors + (target,))

    walk(real_root, Path(), (real_root,))
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
    """``--bits-for`` rules as ``(glob, K)``: ``"GLOB=K"`` strings (or pairs), GLOB ASCII, K from 1 to 8
    (``STORED_BITS``: the fork reads a stored module's K from its trellis, 1 to 8); ConfigError naming the rule (in
    ASCII), what is wrong and the accepted form otherwise."""

    lo, hi = STORED_BITS
    out = []
    for rule in rules:
        glob, sep, k = rule.rpartition("=") if isinstance(rule, str) else (rule[0], "=", str(rule[1]))
        k = k.strip()
        if (not sep or not glob.strip() or not k.isascii() or not k.isdigit() or not lo <= int(k) <= hi
                or not glob.isascii()):
            shown = ascii(rule if isinstance(rule, str) else f"{rule[0]}={rule[1]}")  # the rule, in ASCII
            why = ("not GLOB=K" if not sep or not glob.strip() else
                   "non-ASCII characters" if not (glob.isascii() and k.isascii()) else
                   f"K {k!r} is not a whole number from {lo} to {hi}")
            raise ConfigError(f"--bits-for {shown}: {why}; the accepted form is GLOB=K, GLOB a shell glob over "
                              f"module names (ASCII) and K from {lo} to {hi}, e.g. --bits-for '*.mlp.down_proj=5'")
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
    other = plan.bits_by_module()
    return {"bits_for": other} if other else {}


def plan_hydrate(request, out: str | Path, *, environ: Optional[dict] = None,
                 bits_for: Sequence[str | tuple[str, int]] = ()) -> HydratePlan:
    """The hydrate plan of ``request.model`` into ``out``: ``cache warm``'s layer plan at TP 1, each layer checked
    for the fork's loader at every TP size OUT must start at; headers only.

    The TP sizes are ``request.tp_sizes``, or, when empty, every size up to ``MAX_TP`` a server of SOURCE starts
    at (``LayerPlan.startable_tp_sizes``: vLLM splits the model there and every rank slices SOURCE's own stored
    modules): OUT starts wherever SOURCE starts. A layer a server at one of them could not slice stays BF16, as in
    SOURCE, and is listed with those sizes (``left_bf16``, ``left_tp``); the other sizes up to ``MAX_TP`` vLLM can
    split the model into where a stored layer (hydrate's or SOURCE's) could not be sliced are recorded in OUT
    (``fails_at``). Refuses (ConfigError / InputError, one line): OUT inside SOURCE or existing, a checkpoint the
    server does not encode online (a BF16 model, a plan with no layer), kinds whose stored layers the fork reads
    another way (rank-sliced routed experts, the GLM-5.3 routed-only scope), a TP size vLLM cannot split the model
    into or SOURCE does not start at, and a plan where every layer is left BF16.
    Example: ``hydrate(plan_hydrate(ServerRequest(model="./m", tp_sizes=()), "./m-k6"))``.

    Args:
        request: the server's settings (``ServerRequest``): SOURCE as ``model``, bits, overlay, dtype, the TP sizes
            OUT must serve (empty: every one), ``layers`` / ``exclude``.
        out: the new checkpoint folder.
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

    if not str(out).strip():  # "" would be the working folder: never guessed
        raise ConfigError("OUT is empty: give the new checkpoint's folder (one that does not exist yet, not inside "
                          "SOURCE), e.g. exl3tool hydrate /models/M /models/M-k6")
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
    from exl3tool.operations.release_rules import refuse_undetermined, release_rules

    refuse_undetermined(request, release_rules(request, checkpoint.config, environ, writes=True, lookups=False)[0],
                        "what this hydrate writes")  # the layer plan, where a release nothing named decides it
    layers, exclude = list(request.layers) or None, list(request.exclude) or None
    try:
        layer_plan = plan_layers(checkpoint, overlay=overlay, layers=layers, exclude=exclude,
                                 language_model_only=request.language_model_only, release=request.release)
    except ConfigError:
        if not layers:
            raise
        # --layers matching only stored modules: a re-run on OUT of a hydrate made with the same globs is a no-op
        layer_plan = plan_layers(checkpoint, overlay=overlay, language_model_only=request.language_model_only,
                                 release=request.release)
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
        checkpoint, overlay=overlay, language_model_only=request.language_model_only, release=request.release)
    shardable = whole.shardable_tp_sizes(MAX_TP)
    starts = whole.startable_tp_sizes(MAX_TP)  # SOURCE's own stored modules slice there too
    tp_sizes = tuple(sorted(set(request.tp_sizes))) or starts
    for tp in tp_sizes:  # vLLM cannot shard the model at all there: say so before anything else
        why = whole.shard_problem(tp)
        if why:
            raise ConfigError(why)
    for tp in tp_sizes or shardable[:1]:  # nor does SOURCE start there: OUT would not either
        why = whole.start_problem(tp)
        if why:
            where = (f"it starts at TP {','.join(map(str, starts))}: hydrate for those (--tp-size)" if starts else
                     f"it starts at no TP size up to {MAX_TP}")
            raise ConfigError(f"SOURCE {source} does not start at TP {tp}, so neither would OUT: {why}; {where}")
    if not tp_sizes:
        raise ConfigError(f"{source}: {whole.shard_problem(1) or 'vLLM can split this model into no TP size'}")
    dtype = serving_torch_dtype(request.dtype) or checkpoint.dtype
    base = dict(source=source, out=out_path, model=str(source), bits=request.bits, tp_sizes=tp_sizes,
                dtype=str(dtype).removeprefix("torch."), checkpoint=checkpoint,
                storage_file=_storage_location(checkpoint), tp_default=not request.tp_sizes,
                not_modelled=tuple(not_modelled(layer_plan)))
    hidden: list[str] = []
    files = _files(source, hidden)
    base.update(left_out=tuple(hidden))
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
        # the first module, hydrate's or SOURCE's own, in the order the server slices them: the error it raises
        failing = [(layer.prefix, w) for layer, srcs in stored_layers if (w := slicing_problem(layer, srcs, tp))]
        failing += [(m.prefix, w) for m, w in whole.stored_failures(tp)]
        if failing:
            prefix, why = min(failing, key=lambda f: load_order(f[0]))  # stable: the first of equal order
            fails_at[tp] = f"{prefix}: {why}"
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


def _bits(plan: HydratePlan, m: HydrateModule) -> int:
    """The K ``m`` is encoded at: its own (``--bits-for``), else the plan's."""
    return m.bits or plan.bits


def _fingerprint(plan: HydratePlan, m: HydrateModule) -> str:
    """What a kept per-layer result was made from: a change to any of it (a re-downloaded shard, other bits or
    dtype) makes the resume encode the module again."""
    st = (plan.source / m.shard).stat()
    return json.dumps({"weight": m.source.weight, "shard": m.shard, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                       "bits": _bits(plan, m), "seed": m.seed, "dtype": plan.dtype, "schema": 1}, sort_keys=True)


def _job_json(plan: HydratePlan) -> str:
    return json.dumps({"source": str(plan.source), "bits": plan.bits, "dtype": plan.dtype, **_bits_for_json(plan),
                       "modules": [m.module for m in plan.modules]}, sort_keys=True)


def temp_dir(out: Path) -> Path:
    """The temporary folder of a hydrate into ``out``, beside it: the job's settings, each module's result as soon as
    it is encoded (the kept results a stopped run resumes from) and ``out/``, OUT being assembled (renamed to OUT)."""
    return out.parent / f".{out.name}{TEMP_SUFFIX}"


def lock_file(out: Path) -> Path:
    """The lock a hydrate into ``out`` holds while it runs, beside it: a second hydrate into the same OUT is refused
    at once instead of writing into the first one's folder. Removed when the run ends (a run killed with SIGKILL
    leaves it; the next run takes it over: an flock dies with its process)."""
    return out.parent / f".{out.name}.hydrate.lock"


# Inside temp_dir(OUT):
_JOB = "job.json"  # the job's settings (_job_json): a temporary folder of another job is refused, not reused
_LAYERS = "layers"  # one safetensors file per module (its EXL3 tensors, the fingerprint in its metadata)
_STAGE = "out"  # OUT being assembled; renamed to OUT when complete
_ASSEMBLED = "assembled.json"  # once _STAGE is complete and on disk: its inode, the files linked/copied, the job

#: The steps of a run, in order, as ``hydrate``'s ``on_step`` hears them (a state on disk after each one; the
#: same command resumes from every one): ``locked``, ``prepared`` (the temporary folder and its job settings),
#: ``saved <module>`` (each module encoded and kept), ``linked`` (the unchanged files), ``shard <file>`` (each
#: changed shard written), ``index``, ``storage`` (tensor_storage), ``assembled``, ``renamed`` (OUT complete),
#: ``unlocked`` (the lock file removed), ``cleaned`` (the temporary folder removed).
STEPS = ("locked", "prepared", "saved <module>", "linked", "shard <file>", "index", "storage", "assembled",
         "renamed", "unlocked", "cleaned")
StepFn = Callable[[str], None]


class _Lock:
    """OUT's lock, held: ``drop()`` removes its file while still held (no second run can then lock the removed
    inode and believe it alone), the flock goes with the process."""

    def __init__(self, lock, path: Path):
        self.lock, self.path, self.dropped = lock, path, False

    def holds_path(self) -> bool:
        fd = getattr(getattr(self.lock, "_context", None), "lock_file_fd", None)
        try:
            return fd is None or os.path.samestat(os.stat(self.path), os.fstat(fd))
        except OSError:
            return False

    def drop(self) -> None:
        if not self.dropped and self.holds_path():
            self.path.unlink(missing_ok=True)
        self.dropped = True


@contextmanager
def _exclusive(out: Path):
    """Hold ``lock_file(out)`` or refuse at once: one hydrate per OUT at a time. The lock file is removed when the
    run ends, whatever the outcome (``_Lock.drop``); a run killed with SIGKILL leaves it, and the next run takes it."""
    from filelock import FileLock, Timeout

    from exl3tool.cache.locks import lock_holders

    path = lock_file(out)
    for _ in range(8):  # the file we locked was removed by its last holder before we locked it: lock the new one
        lock = FileLock(str(path), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            holders = lock_holders(path)
            who = ", ".join(holders) or "a process exl3tool cannot name (on another host, or another user's)"
            pids = " ".join(h.split()[1] for h in holders if h.startswith("pid "))
            raise ConfigError(f"{out}: another hydrate into it is running: {who} holds its lock file {path}; wait "
                              "for it to finish, or stop it" + (f" (kill {pids})" if pids else "")
                              + " and run this command again: it resumes the work kept so far") from None
        except OSError as exc:
            raise InputError(f"{out.parent}: cannot create {path.name} there ({exc.strerror}); choose a writable "
                             "folder for OUT") from None
        held = _Lock(lock, path)
        if held.holds_path():
            break
        lock.release()
    else:
        raise ConfigError(f"{out}: another hydrate into it keeps taking {path}; run this command again")
    try:
        yield held
    finally:
        try:
            held.drop()
        finally:
            lock.release()


class _Interrupts:
    """Ctrl-C that is never lost: SIGINT is recorded before it raises KeyboardInterrupt, and every step raises it
    again if it was swallowed (a KeyboardInterrupt raised inside a ctypes callback is printed and dropped: llvmlite's
    object-cache hooks run when numba loads or compiles the CPU kernels). ``defer`` holds it off while the finished
    checkpoint is renamed into place and the temporary folder removed; ``check`` raises it afterwards."""

    def __init__(self) -> None:
        self.hit = False
        self.defer = False

    def handler(self, signum, frame) -> None:
        self.hit = True
        if not self.defer:
            raise KeyboardInterrupt

    def check(self) -> None:
        if self.hit and not self.defer:
            raise KeyboardInterrupt


@contextmanager
def _interrupts():
    stop = _Interrupts()
    if threading.current_thread() is not threading.main_thread():
        yield stop  # signals reach the main thread only: nothing to install here
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:  # ignored (nohup, `&`) or the embedding program's own: kept
        yield stop
        return
    signal.signal(signal.SIGINT, stop.handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


class _Steps:
    """Tells ``on_step`` of each step done, then raises a Ctrl-C that was swallowed since."""

    def __init__(self, hook: Optional[StepFn], stop: _Interrupts):
        self.hook, self.stop = hook, stop

    def __call__(self, name: str) -> None:
        if self.hook is not None:
            self.hook(name)
        self.stop.check()


def _result_path(temp: Path, module: str) -> Path:
    return temp / _LAYERS / (hashlib.sha256(module.encode()).hexdigest()[:24] + ".safetensors")


def _expected_result(m: HydrateModule, bits: int) -> dict[str, tuple[str, list[int]]]:
    k, n = m.source.in_features, m.source.out_features
    shapes = {"trellis": ("I16", [k // 16, n // 16, 16 * bits]), "suh": ("F16", [k]), "svh": ("F16", [n]),
              "mcg": ("I32", [])}
    return {f"{m.module}.{suffix}": shapes[suffix] for suffix in EXL3_SUFFIXES}


def _load_result(path: Path, fingerprint: str, m: HydrateModule, bits: int) -> Optional[dict]:
    """The header of ``m``'s kept result when it is complete and made from the same inputs (its fingerprint, its
    tensors' names, dtypes and shapes, the file's size), else None (encode it again). Reads the header only: a
    result is written whole (a ``.part`` file fsynced, then renamed) or not at all."""
    try:
        header, start = read_header(path)
        size = path.stat().st_size
    except (InputError, OSError):
        return None
    if (header.get("__metadata__") or {}).get("fingerprint") != fingerprint:
        return None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    want = _expected_result(m, bits)
    if set(tensors) != set(want) or any([tensors[k].get("dtype"), tensors[k].get("shape")] != list(want[k])
                                        for k in want):
        return None
    end = max(v["data_offsets"][1] for v in tensors.values())
    return header if start + end == size else None


def _save_result(path: Path, tensors: dict[str, torch.Tensor], fingerprint: str) -> None:
    part = path.with_suffix(".part")
    with _writing(path, part):
        write_shard(part, None, [(k, v.contiguous()) for k, v in tensors.items()], {"fingerprint": fingerprint})
        os.replace(part, path)


def _kept(temp: Path) -> int:
    """How many module results the temporary folder holds."""
    try:
        return sum(1 for p in (temp / _LAYERS).iterdir() if p.suffix == ".safetensors")
    except OSError:
        return 0


def stopped_state(plan: HydratePlan) -> dict[str, Any]:
    """What a run of ``plan`` that stopped (Ctrl-C) left, for its caller to say: ``out_written`` (OUT is in place,
    complete: the stop came after its rename), ``kept`` (module results kept in the temporary folder, which the same
    command reuses) and ``kept_in`` (that folder, None when there is none)."""
    temp = temp_dir(plan.out)
    written = plan.out.is_dir() and not temp.exists()
    return {"out_written": written, "kept": 0 if written else _kept(temp),
            "kept_in": str(temp) if temp.is_dir() else None}


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

        return encode_linear(weight.to(device), bits=_bits(plan, m), seed=m.seed, device=device, name=m.module)
    return encode(weight, _bits(plan, m), m.seed, device)


def _same_filesystem(plan: HydratePlan) -> bool:
    return os.stat(plan.source).st_dev == os.stat(plan.out.parent).st_dev


def _bytes_to_write(plan: HydratePlan, pending: list[HydrateModule]) -> tuple[int, str]:
    """What is still to be written beside OUT with ``pending`` modules to encode, and what it is made of: their
    results, OUT's changed shards (the shard less its weights plus their EXL3 tensors and a bigger header), the
    index and tensor_storage, copies of the unchanged files across filesystems, and 64 KiB to spare."""
    mods = plan.modules
    results = sum(m.exl3_bytes + 4096 for m in pending)
    shards = (sum((plan.source / s).stat().st_size for s in plan.changed_shards)
              - sum(m.weight_bytes for m in mods) + sum(m.exl3_bytes + 1024 for m in mods))
    meta = sum((plan.source / f).stat().st_size * 2 for f in (_INDEX, plan.storage_file) if (plan.source / f).is_file())
    copies = 0 if _same_filesystem(plan) else sum((plan.source / f).stat().st_size for f in plan.unchanged_files)
    parts = [f"{plural(len(pending), 'module')} to encode" if pending else "",
             plural(len(plan.changed_shards), "shard"), "copies of the unchanged files" if copies else ""]
    return results + shards + meta + copies + 65536, ", ".join(p for p in parts if p)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n:,} bytes"


def _free_space_check(plan: HydratePlan, temp: Path, pending: list[HydrateModule]) -> None:
    needed, what = _bytes_to_write(plan, pending)
    free = shutil.disk_usage(plan.out.parent).free
    if free < needed:
        raise InputError(f"{plan.out.parent}: {_mib(free)} free on its filesystem, but hydrate writes {_mib(needed)} "
                         f"({what}); free space or choose another OUT")


@contextmanager
def _writing(path: Path, part: Optional[Path] = None):
    """An OSError while writing ``path`` names ``path`` (a buffered write's error names no file; shutil's copy
    names the file it reads); whatever stops the write (a full disk, Ctrl-C), its half-written ``part`` file is
    removed: a result or a shard is there whole or not at all."""
    try:
        yield
    except BaseException as exc:
        if part is not None:
            try:
                part.unlink(missing_ok=True)
            except OSError:
                pass
        if isinstance(exc, OSError) and exc.filename != str(path) and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path)) from exc
        raise


def _link_or_copy(src: Path, dst: Path, boundary: Path) -> bool:
    """Hard-link ``src`` at ``dst`` (True), else copy it with its times (False). A Hub snapshot's files are links
    into ``../../blobs``: what they point at is linked or copied, never the link; a file that no longer resolves to
    a regular file inside ``boundary`` (changed since the plan) is refused."""
    real = Path(os.path.realpath(src))
    if not _inside(real, boundary) or not real.is_file():
        raise _refuse_entry(src, f"now {'a link to ' + str(real) if real != src else 'not a regular file'}, "
                                 f"not a file inside {boundary}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() or dst.is_symlink():
        dst.unlink()
    try:
        os.link(real, dst)
        return True
    except OSError:
        part = dst.with_name(dst.name + ".part")
        with _writing(dst, part):
            shutil.copy2(real, part)
            os.replace(part, dst)
        return False


def _write_json(path: Path, data: dict, indent: int) -> None:
    _write_text(path, json.dumps(data, indent=indent) + "\n")


def _write_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a ``.part`` file fsynced, then renamed over it)."""
    part = path.with_name(path.name + ".part")
    with _writing(path, part):
        with open(part, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if path.exists() or path.is_symlink():
            path.unlink()  # never write through a hard link into SOURCE
        os.replace(part, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _assemble(plan: HydratePlan, stage: Path, temp: Path, steps: _Steps) -> tuple[int, int]:
    """Write OUT's files into ``stage``: links to the unchanged files, the changed shards (kept tensors and each
    module's EXL3 tensors copied byte for byte from SOURCE and the kept results: one 16 MiB buffer in memory, never
    a whole shard or result), the index and tensor_storage."""
    linked = copied = 0
    boundary = source_boundary(plan.source)
    stage.mkdir()
    for rel in plan.unchanged_files:
        if _link_or_copy(plan.source / rel, stage / rel, boundary):
            linked += 1
        else:
            copied += 1
    steps("linked")
    by_weight = {m.source.weight: m for m in plan.modules}
    new_names: dict[str, str] = {}  # tensor name -> shard
    for shard in plan.changed_shards:
        header, _ = read_header(plan.source / shard)
        meta = header.pop("__metadata__", None)
        order: list[tuple[str, object]] = []
        for name in sorted(header, key=lambda n: header[n]["data_offsets"][0]):
            m = by_weight.get(name)
            if m is None:
                order.append((name, None))
                continue
            result = _result_path(temp, m.module)
            for suffix in EXL3_SUFFIXES:
                tname = f"{m.module}.{suffix}"
                order.append((tname, FileTensor(result, tname)))
                new_names[tname] = shard
        part = stage / (shard + ".part")
        with _writing(stage / shard, part):
            write_shard(part, plan.source / shard, order, meta)
            os.replace(part, stage / shard)
        steps(f"shard {shard}")
    shapes: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}
    for m in plan.modules:
        header, _ = read_header(_result_path(temp, m.module))
        rec = {f"{m.module}.{suffix}": (tuple(header[f"{m.module}.{suffix}"]["shape"]),
                                        header[f"{m.module}.{suffix}"]["dtype"]) for suffix in EXL3_SUFFIXES}
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
            h, _ = read_header(stage / shard)
            total += sum(r["data_offsets"][1] - r["data_offsets"][0] for k, r in h.items() if k != "__metadata__")
        index.setdefault("metadata", {})["total_size"] = total
        _write_json(stage / _INDEX, index, 2)
        steps("index")
    records = {m.record_key or m.module: storage_record(m.module, shapes[m.module], _bits(plan, m))
               for m in plan.modules}
    note = plan.note()
    if plan.storage_file == "config.json":
        cfg = json.loads((plan.source / "config.json").read_text())
        cfg["quantization_config"]["tensor_storage"].update(records)
        cfg["quantization_config"][HYDRATED_BY] = note
        _write_json(stage / "config.json", cfg, 2)
    else:
        qc = json.loads((plan.source / _QUANT).read_text())
        qc.setdefault("tensor_storage", {}).update(records)
        qc[HYDRATED_BY] = note
        _write_json(stage / _QUANT, qc, 4)
    steps("storage")
    for folder in sorted({(stage / rel).parent for rel in plan.unchanged_files} | {stage}):
        _fsync_dir(folder)
    return linked, copied


def _assembled(temp: Path, stage: Path) -> Optional[dict]:
    """The ``assembled.json`` record when ``stage`` (or OUT, renamed from it) is the folder it was written for."""
    try:
        record = json.loads((temp / _ASSEMBLED).read_text())
        st = os.lstat(stage)
    except (OSError, ValueError):
        return None
    ok = stat.S_ISDIR(st.st_mode) and [record.get("dev"), record.get("ino")] == [st.st_dev, st.st_ino]
    return record if ok else None


def _committed(out: Path) -> bool:
    """OUT is the folder a hydrate assembled and renamed into place, stopped before it removed its temporary
    folder: the same command finishes it."""
    return _assembled(temp_dir(out), out) is not None


def _remove(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:  # gone already (a second run finishing the same OUT)
        pass


def _remove_temp(temp: Path) -> None:
    """Remove the temporary folder, ``assembled.json`` last (a run stopped half-way still finds it)."""
    for p in sorted(temp.iterdir()) if temp.is_dir() else ():
        if p.name == _ASSEMBLED:
            continue
        if p.is_dir() and not p.is_symlink():
            _remove(p)
        else:
            p.unlink(missing_ok=True)
    (temp / _ASSEMBLED).unlink(missing_ok=True)
    try:
        temp.rmdir()
    except FileNotFoundError:
        pass


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
            on_layer: Optional[LayerFn] = None, on_step: Optional[StepFn] = None) -> Optional[HydrateReport]:
    """Run ``plan``: encode (or reuse) every module, write OUT atomically. Returns the report.

    Stopped at any point (SIGKILL, Ctrl-C, a full disk, a corrupt shard), the run leaves SOURCE untouched and OUT
    either absent or complete; the same command resumes from the per-module results kept in the temporary folder
    beside OUT and writes the same bytes (or, OUT complete, removes what is left). Ctrl-C always ends in
    KeyboardInterrupt. An error names the file and where the results are kept; a run that kept no result leaves
    no temporary folder. ``encode`` replaces the encoder (tests); ``on_layer(done, total, module, seconds,
    reused)`` hears of each module, ``on_step(name)`` of each step (``STEPS``). Under ``torchrun`` each process
    encodes its share (by tiles) on its GPU and keeps its results in the temporary folder; worker 0 writes OUT from
    them and returns the report (None elsewhere). Host memory: one module's encode and a 16 MiB copy buffer.

    Args:
        plan: ``plan_hydrate``'s result.
        device: auto (this process's GPU under torchrun, else CPU), cpu, cuda or cuda:N.
        encode: an encoder ``(weight [K, N] float32, bits, seed, device) -> EncodedLinear`` (None: ``encode_linear``).
        on_layer: hears of each module done.
        on_step: hears of each step done (a test kills or stops the run there).

    Returns:
        A ``HydrateReport`` (``as_json()``: the ``--json`` document), or None on a torchrun worker other than 0.
    """
    from exl3tool.operations.warm.distributed import distributed_context

    start = time.perf_counter()
    if plan.already_stored:
        return HydrateReport(plan, 0, 0, 0, 0, plan.bytes_before, 0.0, noop=True)
    ctx = distributed_context()
    with _interrupts() as stop:
        steps = _Steps(on_step, stop)
        try:
            if ctx.worker != 0:
                return _run(plan, ctx, device, encode, on_layer, steps, start, None)
            _check_paths(plan.source, plan.out)  # bad paths refused before anything is created beside OUT
            with _exclusive(plan.out) as lock:
                steps("locked")
                report = _run(plan, ctx, device, encode, on_layer, steps, start, lock)
        except Exception as exc:
            if stop.hit:  # what Ctrl-C broke on its way (an import wraps it in a RuntimeError): it is an interrupt
                raise KeyboardInterrupt from exc
            raise
    stop.defer = False
    stop.check()  # a Ctrl-C held off while OUT was renamed into place and the temporary folder removed
    return report


def _run(plan: HydratePlan, ctx, device: str, encode: Optional[EncodeFn], on_layer: Optional[LayerFn],
         steps: _Steps, start: float, lock: Optional[_Lock]) -> Optional[HydrateReport]:
    """``hydrate``'s work; worker 0 holds OUT's lock (``lock``) and answers for the temporary folder."""
    temp = temp_dir(plan.out)
    if ctx.worker != 0:
        if _told(ctx, None) != "go":  # worker 0 refused, or found OUT complete already
            return None
        _encode_share(plan, ctx, device, encode, on_layer, steps, temp)
        return None
    ours = False
    try:
        finishing = _committed(plan.out)
        if not finishing:
            _prepare_temp(plan, temp)
            ours = True
            steps("prepared")
    except BaseException as exc:
        _told(ctx, "stop")
        raise _fault(plan, temp, exc, ours) from None
    _told(ctx, "finish" if finishing else "go")
    try:
        if finishing:  # OUT complete: a run stopped after its rename; what it left is removed
            return _finish(plan, temp, lock, steps, start, 0, len(plan.modules), finishing=True)
        encoded, reused = _encode_share(plan, ctx, device, encode, on_layer, steps, temp)
        stage = temp / _STAGE
        if _assembled(temp, stage) is None:  # else a run stopped before its rename: OUT is assembled already
            (temp / _ASSEMBLED).unlink(missing_ok=True)
            _remove(stage)
            for m in plan.modules:  # every worker's share is kept before OUT is written
                if _load_result(_result_path(temp, m.module), _fingerprint(plan, m), m, _bits(plan, m)) is None:
                    raise InputError(f"{m.module}: its result is missing from {temp / _LAYERS} (a worker stopped?); "
                                     "run the command again to resume")
            linked, copied = _assemble(plan, stage, temp, steps)
            st = os.stat(stage)
            _write_json(temp / _ASSEMBLED, {"dev": st.st_dev, "ino": st.st_ino, "linked": linked, "copied": copied,
                                            "job": _job_json(plan)}, 0)
            _fsync_dir(temp)
        steps("assembled")
        steps.stop.defer = True  # from here OUT is complete: a Ctrl-C is raised once the clean-up is done
        os.rename(stage, plan.out)
        _fsync_dir(plan.out.parent)
        steps("renamed")
        return _finish(plan, temp, lock, steps, start, encoded, reused)
    except BaseException as exc:
        raise _fault(plan, temp, exc, ours) from None


def _told(ctx, state: Optional[str]) -> Optional[str]:
    """Under torchrun, worker 0's word to the others once it has prepared the temporary folder: ``go`` (encode your
    share), ``finish`` (OUT is complete already) or ``stop`` (refused). Elsewhere ``state`` as it is."""
    if not ctx.initialised:
        return state
    import torch.distributed as dist

    box = [state]
    dist.broadcast_object_list(box, src=0)
    if box[0] != "go":
        dist.destroy_process_group()
    return box[0]


def _encode_share(plan: HydratePlan, ctx, device: str, encode: Optional[EncodeFn], on_layer: Optional[LayerFn],
                  steps: _Steps, temp: Path) -> tuple[int, int]:
    """Encode this process's share of the modules, each result saved before the next (nothing kept in memory);
    under torchrun, the counts of all workers (worker 0) once every worker is done: only counts travel, the results
    are files in the temporary folder."""
    from exl3tool.plan.request import resolve_device

    dev = resolve_device(device, ctx.local_rank)
    mine = _share(plan.modules, ctx.workers)[ctx.worker] if ctx.initialised else plan.modules
    encoded = reused = 0
    for i, m in enumerate(mine, 1):
        t0 = time.perf_counter()
        path, fingerprint = _result_path(temp, m.module), _fingerprint(plan, m)
        was_kept = _load_result(path, fingerprint, m, _bits(plan, m)) is not None
        if not was_kept:
            enc = _encode_module(plan, m, encode, dev)
            _save_result(path, exl3_tensors_of(m.module, enc.trellis, enc.suh, enc.svh), fingerprint)
            del enc
            encoded += 1
            steps(f"saved {m.module}")
        else:
            reused += 1
            steps.stop.check()
        if on_layer is not None:
            on_layer(i, len(mine), m.module, time.perf_counter() - t0, was_kept)
    if ctx.initialised:
        import torch.distributed as dist

        counts: Optional[list] = [None] * ctx.workers if ctx.worker == 0 else None
        dist.gather_object((encoded, reused), counts, dst=0)
        dist.destroy_process_group()  # before any worker exits: gloo's threads abort a process that leaves them running
        if ctx.worker == 0:
            assert counts is not None
            encoded, reused = sum(c[0] for c in counts), sum(c[1] for c in counts)
    return encoded, reused


def _finish(plan: HydratePlan, temp: Path, lock: Optional[_Lock], steps: _Steps, start: float, encoded: int,
            reused: int, finishing: bool = False) -> HydrateReport:
    """OUT is in place: remove the lock file, then the temporary folder; the report. ``finishing``: OUT was renamed
    by an earlier run of this job, stopped before its clean-up (another job's OUT is refused, its leftovers removed)."""
    record = _assembled(temp, plan.out) or {}
    steps.stop.defer = True
    if lock is not None:
        lock.drop()
    steps("unlocked")
    _remove_temp(temp)
    steps("cleaned")
    if finishing and record.get("job") != _job_json(plan):
        raise ConfigError(f"OUT {plan.out} exists (a hydrate with other settings wrote it); remove it or name a new "
                          "folder")
    after = sum((plan.out / f).stat().st_size for f in _files(plan.out))
    return HydrateReport(plan, encoded, reused, int(record.get("linked", 0)), int(record.get("copied", 0)), after,
                         round(time.perf_counter() - start, 3))


def _fault(plan: HydratePlan, temp: Path, exc: BaseException, ours: bool) -> BaseException:
    """What a run stopped by ``exc`` leaves and says. OUT complete: the temporary folder removed as a finished run
    would, ``exc`` as it is. Else, in a temporary folder this run prepared (``ours``), OUT's partial assembly is
    removed (the next run assembles again), and the folder too when it keeps no result (a run refused at its first
    module leaves nothing). An error names the file and where the results are kept. KeyboardInterrupt stays itself
    (the CLI says where the results are kept; exit 130)."""
    import errno

    from exl3tool.errors import Exl3ToolError, describe

    if _committed(plan.out):
        try:
            _remove_temp(temp)
        except OSError:
            pass
        return exc
    if not ours:
        return exc
    try:
        (temp / _ASSEMBLED).unlink(missing_ok=True)
        _remove(temp / _STAGE)
        if not _kept(temp):
            _remove(temp)
    except OSError:
        pass
    if isinstance(exc, KeyboardInterrupt) or not isinstance(exc, (OSError, Exl3ToolError)):
        return exc
    n = _kept(temp)
    kept = (f"the {plural(n, 'module')} encoded so far {'is' if n == 1 else 'are'} kept in {temp}" if n else "")
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        pending = [m for m in plan.modules
                   if _load_result(_result_path(temp, m.module), _fingerprint(plan, m), m, _bits(plan, m)) is None]
        needed, what = _bytes_to_write(plan, pending)
        free = shutil.disk_usage(plan.out.parent).free
        return InputError(f"{exc.filename or plan.out.parent}: no space left on its filesystem ({_mib(free)} free; the "
                          f"rest of the run needs about {_mib(needed)}: {what}); free space, then run the same command "
                          f"again" + (f" to resume ({kept})" if n else ""))
    message = describe(exc) if isinstance(exc, OSError) else str(exc)
    if n:
        message += f"; {kept}: run the same command again to resume"
    return InputError(message) if isinstance(exc, OSError) else type(exc)(message)


def _prepare_temp(plan: HydratePlan, temp: Path) -> None:
    """Worker 0, before any encode: OUT still free, the temporary folder ours (or new), room for what is written."""
    _check_paths(plan.source, plan.out)
    job = _job_json(plan)
    if temp.is_symlink() or (temp.exists() and not temp.is_dir()):
        raise ConfigError(f"{temp}: not a folder hydrate made; remove it and run the command again")
    if temp.is_dir():
        try:
            known = (temp / _JOB).read_text()
        except OSError:
            known = None
        ours = {_JOB + ".part", _LAYERS, _STAGE, _ASSEMBLED, _ASSEMBLED + ".part"}
        fresh = known is None and not _kept(temp) and all(p.name in ours for p in temp.iterdir())  # nothing kept
        if known != job and not fresh:
            raise ConfigError(f"{temp}: a partial hydrate with other settings (or not exl3tool's) is there; remove "
                              "it to start over, or run the command that made it to resume it")
    fingerprints = {m.module: _fingerprint(plan, m) for m in plan.modules}
    pending = [m for m in plan.modules
               if _load_result(_result_path(temp, m.module), fingerprints[m.module], m, _bits(plan, m)) is None]
    _free_space_check(plan, temp, pending)
    created = not temp.is_dir()
    try:
        temp.mkdir(exist_ok=True)
        if not (temp / _JOB).is_file():
            _write_text(temp / _JOB, job)
        (temp / _LAYERS).mkdir(exist_ok=True)
    except OSError as exc:
        if created:
            _remove(temp)
        raise InputError(f"{exc.filename or temp}: cannot create it ({exc.strerror}); choose a writable folder with "
                         "room for OUT") from None
