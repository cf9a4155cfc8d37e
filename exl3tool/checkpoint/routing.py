"""How the fork's ``Exl3Config`` sees a checkpoint: its kind, its ``tensor_storage`` map, and each module's route.

Ground truth: ``vllm/model_executor/layers/quantization/exl3.py`` of local-inference-lab/vllm, two versions read:
commit 1702ed2d (``maybe_update_config`` knows the standard and the rank-sliced kinds) and the later stored version
(search-index file id 59216841092, commit not exposed) that also accepts ``scope: glm53_routed_experts_only``.
exl3tool follows the later version, a superset: the older one refuses a GLM-5.3 scope checkpoint because it has no
``tensor_storage`` map (``GLM53_OLD_VERSION_REASON``).

Routing (``get_quant_method`` then ``_get_bf16_online_linear_method``), in the server's order:
1. stored as EXL3: the prefix, or every packed source of a fused module, has a ``tensor_storage`` record with
   ``quant_format == "exl3"`` under one of ``_storage_entry``'s spellings (a mix refuses the checkpoint);
2. covered by a spec: ``shared_experts`` for shared-expert projections, ``linear`` for everything else;
3. not ignored (``should_ignore_layer``; never for shared experts);
4. (per TP size, in ``plan``) 128-aligned rank-local sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from exl3tool.checkpoint.families import Family, ModuleTemplate, text_config
from exl3tool.checkpoint.overlay import Overlay
from exl3tool.errors import ConfigError, InputError
from exl3tool.jsontext import read_json_object
from exl3tool.releases import GLM53_SCOPE, R7_SCHEMA, ServerRelease

__all__ = [
    "NotServable", "CheckpointKind", "Route", "serving_kind", "storage_candidates", "StorageMap", "route_family",
    "GLM53_SCOPE", "GLM53_OLD_VERSION_REASON", "NO_STORAGE_REASON", "read_json", "ServingView", "serving_view",
    "REASONS", "r7_reading_differs",
]

RANK_SLICED_FORMAT = "exl3-trellis"
NO_STORAGE_REASON = (
    "EXL3 requires quantization_config.json with a non-empty tensor_storage map. For branch-indexed Hugging Face "
    "repos, download/serve an actual bpw revision rather than main."
)
GLM53_OLD_VERSION_REASON = (
    f"{NO_STORAGE_REASON} (exl3.py @ 1702ed2d does not know the {GLM53_SCOPE} scope; the later version does)"
)
_RANK_SLICED_SCHEMA = "model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}"
_SHARED_H_SCHEMA = "model.layers.{L}.mlp.experts.shared_h.{proj}.rank{r}.{suh|svh}"


class NotServable(Exception):
    """The server would refuse this checkpoint with the overlay, or never look an entry up; ``str`` is why."""


def read_json(path: Path) -> Optional[dict]:
    """A small JSON file of the checkpoint, None when absent; InputError naming the file when unreadable."""
    if not path.is_file():
        return None
    return read_json_object(path)


def storage_candidates(prefix: str) -> list[str]:
    """``Exl3Config._storage_entry``'s spellings of ``prefix``, in the order the server tries them.

    The prefix; without (or with) a leading ``model.``; then every ``model`` / ``language_model`` path segment
    collapsed (interior or leading), each collapsed form also with ``model.`` added or removed.
    Example: ``language_model.model.layers.0.o_proj`` also tries ``model.language_model.layers.0.o_proj``.
    """
    out = [prefix, prefix.removeprefix("model.") if prefix.startswith("model.") else f"model.{prefix}"]
    parts = prefix.split(".")
    for removable in ("model", "language_model"):
        for idx in range(len(parts) - 1):
            if parts[idx] != removable:
                continue
            collapsed = ".".join(parts[:idx] + parts[idx + 1:])
            out += [collapsed, f"model.{collapsed}"]
            if collapsed.startswith("model."):
                out.append(collapsed.removeprefix("model."))
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class StorageMap:
    """``tensor_storage`` as the server holds it: the checkpoint's keys plus their ``hf_to_vllm_mapper`` forms."""

    records: Mapping[str, Any]

    @classmethod
    def build(cls, storage: Mapping[str, Any], mapper: Iterable[tuple[str, Optional[str]]] = ()) -> "StorageMap":
        mapper = tuple(mapper)
        mapped: dict[str, Any] = {}
        for key, rec in storage.items():
            name: Optional[str] = key
            for orig, new in mapper:
                if name is not None and name.startswith(orig):
                    name = None if new is None else new + name[len(orig):]
            if name is not None:
                mapped[name] = rec
        return cls({**storage, **mapped})

    def entry(self, prefix: str) -> Optional[Any]:
        """The first record found under one of the spellings (it decides, whatever its format)."""
        for candidate in storage_candidates(prefix):
            rec = self.records.get(candidate)
            if rec is not None:
                return rec
        return None

    def is_exl3(self, prefix: str) -> bool:
        rec = self.entry(prefix)
        return isinstance(rec, dict) and rec.get("quant_format") == "exl3"

    def linear_is_exl3(self, prefix: str, packed: Mapping[str, tuple[str, ...]]) -> bool:
        """``_linear_prefix_is_exl3``: the prefix, or all packed sources; a partly stored fused module refuses."""
        if self.is_exl3(prefix):
            return True
        base, _, leaf = prefix.rpartition(".")
        sources = packed.get(leaf)
        if not sources:
            return False
        stored = [self.is_exl3(f"{base}.{s}" if base else s) for s in sources]
        if any(stored) and not all(stored):
            raise ConfigError(
                f"Packed EXL3 projection {prefix!r} mixes EXL3 and BF16 source shards; a fused module must use one "
                f"quantization scheme. (stored as EXL3: {', '.join(s for s, x in zip(sources, stored) if x)}); "
                "the server refuses this checkpoint"
            )
        return all(stored)


@dataclass(frozen=True)
class CheckpointKind:
    """How the server reads the checkpoint's EXL3 metadata."""

    kind: str  # "exl3" | "rank_sliced" | "glm53_routed_experts_only"
    storage: StorageMap
    required_tp: Optional[int] = None  # rank-sliced routed experts: the server starts only at this TP size
    notes: tuple[str, ...] = ()
    r7: bool = False  # r7 routed experts: narrowed per rank while they stream in (``Exl3MoEParameter``)

    def tp_refusal(self, tp: int) -> Optional[str]:
        if self.required_tp is not None and tp != self.required_tp:
            return (f"rank-sliced EXL3 checkpoint TP does not match runtime: checkpoint={self.required_tp}, "
                    f"runtime={tp}; the server refuses to start this {self.kind} checkpoint at TP {tp}")
        return None


def _validate_records(storage: Mapping[str, Any]) -> None:
    """``_validate_storage_metadata``: at least one exl3 record, each with trellis, suh|su, svh|sv, one codebook."""
    bad: list[str] = []
    count = 0
    for prefix, rec in storage.items():
        if not isinstance(rec, dict) or rec.get("quant_format") != "exl3":
            continue
        count += 1
        suffixes = {name.rsplit(".", 1)[-1] for name in rec.get("stored_tensors", {}) or {}}
        required = {"trellis"}
        if not {"suh", "su"} & suffixes:
            required.add("suh|su")
        if not {"svh", "sv"} & suffixes:
            required.add("svh|sv")
        missing = sorted(r for r in required if r not in suffixes)
        if missing:
            bad.append(f"{prefix}: missing {','.join(missing)}")
        if {"mcg", "mul1"} <= suffixes:
            bad.append(f"{prefix}: both mcg and mul1 are present")
    if not count:
        raise NotServable("quantization_config.json has no EXL3 tensor records")
    if bad:
        raise NotServable("Invalid EXL3 tensor metadata: " + "; ".join(bad[:16]))


def _rank_sliced(meta: Mapping[str, Any], text: Mapping[str, Any]) -> int:
    """``_configure_rank_sliced`` checks; returns the TP size the routed experts are sliced for."""
    missing = sorted({"bits", "codebook", "experts_per_layer", "moe_layers", "tensor_schema", "tp"} - set(meta))
    if missing:
        raise NotServable("rank-sliced EXL3 metadata is missing: " + ", ".join(missing))
    if meta["codebook"] != "mcg":
        raise NotServable(f"rank-sliced EXL3 currently requires the MCG codebook, got {meta['codebook']!r}")
    layers = meta["moe_layers"]
    try:
        ok = isinstance(layers, list) and len(layers) == 2 and 0 <= int(layers[0]) <= int(layers[1])
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise NotServable("rank-sliced EXL3 moe_layers must be [first, last]")
    if meta["tensor_schema"] != _RANK_SLICED_SCHEMA:
        raise NotServable(f"unsupported rank-sliced EXL3 tensor schema: {meta['tensor_schema']!r}")
    layout = str(meta.get("rotation_layout", "per_expert_v1"))
    if layout not in ("per_expert_v1", "shared_h_v1"):
        raise NotServable(f"unsupported rank-sliced EXL3 rotation_layout: {layout!r}")
    shared = meta.get("shared_h_tensor_schema")
    if layout == "shared_h_v1" and shared != _SHARED_H_SCHEMA:
        raise NotServable(f"shared_h_v1 rank-sliced EXL3 requires shared_h_tensor_schema={_SHARED_H_SCHEMA!r}")
    if layout != "shared_h_v1" and shared is not None:
        raise NotServable("shared_h_tensor_schema is only valid with rotation_layout='shared_h_v1'")
    bits = meta["bits"]
    if isinstance(bits, str) and bits.strip().lower() == "mixed":
        k_values = meta.get("k_values") or ()
        if not k_values or any(int(v) not in (3, 4, 5, 6) for v in k_values):
            raise NotServable(f"mixed rank-sliced EXL3 requires k_values within 3..6, got {meta.get('k_values')!r}")
        if not isinstance(meta.get("bits_per_expert"), str):
            raise NotServable("mixed rank-sliced EXL3 requires a bits_per_expert JSON reference")
    experts = int(meta["experts_per_layer"])
    model_experts = text.get("n_routed_experts")
    if model_experts is not None and experts != int(model_experts):
        raise NotServable(f"rank-sliced EXL3 expert count does not match the model: checkpoint={experts}, "
                          f"model={model_experts}")
    return int(meta["tp"])


# Glm5NextTextConfig defaults for the fields the GLM-5.3 scope check reads (used when config.json omits them).
_GLM53_DEFAULTS = {"model_type": "glm5_next_text", "num_hidden_layers": 45, "num_nextn_predict_layers": 1,
                   "first_k_dense_replace": 0, "n_routed_experts": 288, "hidden_size": 4096,
                   "moe_intermediate_size": 2048, "qk_nope_head_dim": 256, "qk_rope_head_dim": 0, "v_head_dim": 256,
                   "index_kpool": 4, "index_kpool_compress": True, "index_kpool_always_select_tail": True}
_GLM53_EXPECTED = {"model_type": "glm5_next_text", "num_hidden_layers": 45, "num_nextn_predict_layers": 1,
                   "first_k_dense_replace": 3, "n_routed_experts": 288, "hidden_size": 4096,
                   "moe_intermediate_size": 2048, "mla_use_nope": True, "qk_nope_head_dim": 256,
                   "qk_rope_head_dim": 0, "v_head_dim": 256, "index_n_heads": 32, "index_head_dim": 128,
                   "index_topk": 2048, "index_kpool": 4, "index_kpool_compress": True,
                   "index_kpool_always_select_tail": True}
_GLM53_LINEAR = {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4,
                 "full_attn_layers": [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43]}


def _glm53_scope(qc: Mapping[str, Any], text: Mapping[str, Any]) -> None:
    """``from_config`` + ``_configure_glm53_unsliced_routed_experts`` (later exl3.py): K4 MCG, the Flash geometry."""
    expected = {"bits": 4, "codebook": "mcg", "non_routed_dtype_policy": "official_source_native"}
    mismatches = {k: (qc.get(k), v) for k, v in expected.items() if qc.get(k) != v}
    if mismatches:
        raise NotServable(f"GLM-5.3 routed-only EXL3 metadata is unsupported: {mismatches}")
    mismatches = {k: (text.get(k, _GLM53_DEFAULTS.get(k)), v) for k, v in _GLM53_EXPECTED.items()
                  if text.get(k, _GLM53_DEFAULTS.get(k)) != v}
    if mismatches:
        raise NotServable(f"GLM-5.3 routed-only EXL3 architecture mismatch: {mismatches}")
    linear = text.get("linear_attn_config")
    if not isinstance(linear, dict) or any(linear.get(k) != v for k, v in _GLM53_LINEAR.items()):
        raise NotServable(f"GLM-5.3 routed-only EXL3 linear/sparse attention mismatch: expected {_GLM53_LINEAR}, "
                          f"got {linear!r}")


def _r7(qc: Mapping[str, Any]) -> bool:
    """An r7 routed-expert checkpoint (``r7_routed_experts.schema``): ``Exl3Config.override_quantization_method``
    takes it as EXL3 whatever its ``quant_method``; ``from_config`` then checks the block (the server's messages)."""
    r7 = qc.get("r7_routed_experts")
    if r7 is None:
        return False
    if not isinstance(r7, dict):
        raise NotServable("r7_routed_experts must be an object")
    if r7.get("schema") != R7_SCHEMA:
        return False  # not the server's r7 kind: the quant_method decides
    if r7.get("codebook") != "mcg" or r7.get("bits") != "mixed_tensor":
        raise NotServable("R7 EXL3 requires codebook='mcg' and bits='mixed_tensor'")
    layers = r7.get("moe_layers")
    ints = isinstance(layers, (list, tuple)) and len(layers) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in layers)
    if not ints or layers[0] < 0 or layers[1] < layers[0]:
        raise NotServable("R7 EXL3 moe_layers must be two non-negative JSON integers [first, last] with last >= first")
    ks = r7.get("k_values")
    if not isinstance(ks, (list, tuple)) or not ks:
        raise NotServable("R7 EXL3 k_values must be a non-empty list")
    if any(not isinstance(v, int) or isinstance(v, bool) for v in ks):
        raise NotServable("R7 EXL3 k_values must contain JSON integers")
    bad = sorted(set(ks) - {3, 4, 5})
    if bad:
        raise NotServable(f"R7 EXL3 has unsupported k_values: {bad}")
    return True


def r7_reading_differs(config: Mapping[str, Any]) -> bool:
    """Whether a release that reads r7 routed-expert checkpoints (``ServerRelease.r7_checkpoints``) makes something
    else of this checkpoint than one that does not: its config's r7_routed_experts block is the server's r7 kind
    (``_r7``) and its quant_method is not exl3 (one serves it as EXL3, the other refuses it), or the block is one
    that reading refuses and its quant_method is exl3 (one refuses it, the other serves it)."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("r7_routed_experts") is None:
        return False
    try:
        taken = _r7(qc)
    except NotServable:
        return qc.get("quant_method") == "exl3"
    return taken and qc.get("quant_method") != "exl3"


def serving_kind(config: Mapping[str, Any], quant_file: Optional[Mapping[str, Any]],
                 mapper: Iterable[tuple[str, Optional[str]]] = (), *, release: ServerRelease) -> CheckpointKind:
    """The checkpoint's kind as ``Exl3Config.maybe_update_config`` of ``release`` reads it; NotServable with the
    server's reason.

    ``config`` is config.json, ``quant_file`` quantization_config.json (None when absent), ``mapper`` the model's
    hf_to_vllm prefix rules applied to the ``tensor_storage`` keys, ``release`` the run's (``ServerRequest.release``:
    r7 routed-expert checkpoints are read from gilded-gnosis-r34 and infernal-invocation-r5 on).
    """
    qc = config.get("quantization_config")
    qc = qc if isinstance(qc, dict) else {}
    text = text_config(dict(config))
    hybrid = config.get("hybrid_tr3_tail", text.get("hybrid_tr3_tail"))
    rank_sliced = isinstance(hybrid, dict) and hybrid.get("format") == RANK_SLICED_FORMAT
    glm53 = qc.get("scope") == GLM53_SCOPE
    rel = release
    r7 = _r7(qc) if rel.r7_checkpoints else False
    if qc.get("quant_method") != "exl3" and not rank_sliced and not r7 and not glm53:
        method = qc.get("quant_method")
        older = (f"; {rel.name} does not read r7_routed_experts checkpoints (gilded-gnosis-r34 and "
                 "infernal-invocation-r5 on do)" if isinstance(qc.get("r7_routed_experts"), dict) else "")
        raise NotServable(
            f"not an EXL3 checkpoint (config.json quantization_config.quant_method is {method!r}): the fork encodes "
            "layers online, and looks cache entries up, only for EXL3 checkpoints served with the overlay"
            + ("; a plain BF16/FP16 checkpoint gets no online EXL3 at all" if method is None else "") + older
        )
    inline = qc.get("tensor_storage") or {}
    if glm53:
        _glm53_scope(qc, text)
        return CheckpointKind(GLM53_SCOPE, StorageMap.build(inline, mapper), required_tp=2, notes=(
            "GLM-5.3 routed-experts-only scope (later exl3.py): every dense linear counts as BF16; routed experts "
            "stream unsliced K4 into TP2 slabs, so the server starts at TP 2 only",))
    if rank_sliced:
        tp = _rank_sliced(hybrid, text)
        return CheckpointKind("rank_sliced", StorageMap.build(inline, mapper), required_tp=tp, notes=(
            f"rank-sliced hybrid (hybrid_tr3_tail, {RANK_SLICED_FORMAT}): tensor_storage is not consulted beyond "
            f"config.json; routed experts are sliced for TP {tp}",))
    storage = inline or (quant_file or {}).get("tensor_storage") or {}
    if not isinstance(storage, dict) or not storage:
        raise NotServable(NO_STORAGE_REASON)
    _validate_records(storage)
    notes = ((f"r7 routed-expert checkpoint ({R7_SCHEMA}): taken as EXL3 whatever its quant_method "
              f"({qc.get('quant_method')!r}), as {rel.name} does",) if r7 else ())
    return CheckpointKind("exl3", StorageMap.build(storage, mapper), notes=notes, r7=r7)


@dataclass(frozen=True)
class Route:
    """One module the model builds with the quant config, and what the server does with it."""

    prefix: str  # vLLM prefix, the cache key's
    layer: int
    template: ModuleTemplate
    decision: str  # "planned" | "stored_exl3" | "no_spec" | "ignored"
    spec: Optional[str] = None  # "linear" | "shared_experts" for planned modules
    detail: str = ""


REASONS = {
    "stored_exl3": "stored as EXL3 in the checkpoint: served as stored, never encoded",
    "no_spec": "no spec in the overlay covers it: stays BF16",
    "ignored": "matched by the overlay's ignore list: stays BF16",
}


def route_family(config: Mapping[str, Any], family: Family, storage: StorageMap, overlay: Overlay) -> list[Route]:
    """Every module of every decoder layer, routed as the server routes it (names only, no tensors read)."""
    text = text_config(dict(config))
    if family.check is not None:
        family.check(text)
    packed = family.packed(text)
    n_layers = text.get("num_hidden_layers")
    if not isinstance(n_layers, int) or n_layers <= 0:
        raise InputError(f"config.json: num_hidden_layers must be a positive integer, got {n_layers!r}")
    routes: list[Route] = []
    for i in range(n_layers):
        for tpl in family.modules:
            if tpl.when is not None and not tpl.when(text, i):
                continue
            prefix = f"{family.layers_prefix}.{i}.{tpl.name}"
            if storage.linear_is_exl3(prefix, packed):
                routes.append(Route(prefix, i, tpl, "stored_exl3", detail=REASONS["stored_exl3"]))
                continue
            spec = overlay.spec_for(prefix)
            if spec is None:
                routes.append(Route(prefix, i, tpl, "no_spec", detail=REASONS["no_spec"]))
            elif spec == "linear" and overlay.ignores(prefix, packed):
                routes.append(Route(prefix, i, tpl, "ignored", detail=REASONS["ignored"]))
            else:
                routes.append(Route(prefix, i, tpl, "planned", spec=spec, detail=f"planned ({spec} spec)"))
    return routes


@dataclass(frozen=True)
class ServingView:
    """Kind (or why the server would not serve it with the overlay) and the storage map used for routing."""

    kind: Optional[CheckpointKind]
    refusal: Optional[str]
    storage: StorageMap = field(default_factory=lambda: StorageMap({}))


def serving_view(config: Mapping[str, Any], quant_file: Optional[Mapping[str, Any]],
                 mapper: Iterable[tuple[str, Optional[str]]] = (), *, release: ServerRelease) -> ServingView:
    """``serving_kind`` without raising: a refused checkpoint still gets its storage map for experiments."""
    try:
        kind = serving_kind(config, quant_file, mapper, release=release)
        return ServingView(kind, None, kind.storage)
    except NotServable as e:
        qc = config.get("quantization_config") if isinstance(config.get("quantization_config"), dict) else {}
        storage = (qc or {}).get("tensor_storage") or (quant_file or {}).get("tensor_storage") or {}
        return ServingView(None, str(e), StorageMap.build(storage if isinstance(storage, dict) else {}, mapper))
