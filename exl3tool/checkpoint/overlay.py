"""The server's ``--quantization-config`` overlay: parsed and validated as the fork does, and its routing rules.

The fork switches online EXL3 on for an EXL3 checkpoint only when it is started with a ``--quantization-config``
JSON overlay (``vllm/config/quantization.py``, ``QuantizationConfigArgs``) and ``VLLM_EXL3_ONLINE_TRELLIS_BITS``.
This module reads that very string: the keys ``linear``, ``moe``, ``shared_experts`` and ``ignore`` (any other key
is refused, as the server's config dataclass forbids extra fields), a spec as a dict ``{"weight", "activation"}``
or a shorthand string (``"mxfp8"``), and then the EXL3 overlay rule: no ``moe`` spec, at least one of ``linear`` /
``shared_experts``, ``ignore`` only with ``linear``, every spec ``weight == mxfp8`` with no activation.

Routing helpers mirror the server: ``is_shared_expert_projection`` picks the spec a layer uses and
``should_ignore_layer`` is vLLM's compressed-tensors matcher (exact names, ``re:`` patterns, fused modules judged
through their unfused names).

Example: ``parse_overlay('{"linear": "mxfp8", "ignore": ["lm_head"]}').spec_for("model.layers.0.mlp.down_proj")``
is ``"linear"``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from exl3tool.errors import ConfigError
from exl3tool.jsontext import loads_json

__all__ = [
    "QUANT_KEY_NAMES", "DEFAULT_OVERLAY_JSON", "QuantSpec", "Overlay", "parse_overlay", "resolve_overlay",
    "is_shared_expert_projection", "should_ignore_layer",
]

# The names the server accepts for a spec's weight/activation (QUANT_KEY_NAMES in vllm/config/quantization.py).
QUANT_KEY_NAMES = (
    "fp8_per_block_dynamic", "fp8_per_block_static", "fp8_per_channel_static", "fp8_per_tensor_dynamic",
    "fp8_per_tensor_static", "fp8_per_token", "int8_per_channel_static", "mxfp4", "mxfp8",
)
# ``--quantization`` shorthands: a string spec on ``linear``/``moe`` takes the shorthand's slot. Value: the weight
# name of its (linear, moe) slots, None where the shorthand does not define that slot.
_SHORTHANDS: dict[str, tuple[Optional[str], Optional[str]]] = {
    "fp8_per_tensor": ("fp8_per_tensor_static", "fp8_per_tensor_static"),
    "fp8_per_block": ("fp8_per_block_static", "fp8_per_block_static"),
    "fp8_per_channel": ("fp8_per_channel_static", "fp8_per_channel_static"),
    "mxfp8": ("mxfp8", "mxfp8"),
    "int8_per_channel_weight_only": (None, "int8_per_channel_static"),
    "nvfp4_per_token": (None, "nvfp4_static"),
}
_FIELDS = ("linear", "moe", "shared_experts", "ignore")
_ONLINE_NAMES = sorted([*_SHORTHANDS, "online"])

# What exl3tool plans with when --quantization-config is not given: the smallest overlay that turns the fork's
# online Trellis encoding on (every eligible non-shared dense linear; shared experts stay BF16).
DEFAULT_OVERLAY_JSON = '{"linear": {"weight": "mxfp8"}}'


@dataclass(frozen=True)
class QuantSpec:
    """One spec of the overlay: weight and activation quantization names (None: not set)."""

    weight: Optional[str] = None
    activation: Optional[str] = None

    def as_json(self) -> dict[str, Any]:
        return {"weight": self.weight, "activation": self.activation}


@dataclass(frozen=True)
class Overlay:
    """A validated ``--quantization-config`` overlay; ``text`` is the string as given (or the default)."""

    linear: Optional[QuantSpec] = None
    shared_experts: Optional[QuantSpec] = None
    ignore: tuple[str, ...] = ()
    text: str = DEFAULT_OVERLAY_JSON
    default: bool = False  # True when the user gave no --quantization-config

    def spec_for(self, prefix: str) -> Optional[str]:
        """``"shared_experts"`` or ``"linear"`` when that spec covers ``prefix``, else None (no overlay)."""
        if is_shared_expert_projection(prefix):
            return "shared_experts" if self.shared_experts is not None else None
        return "linear" if self.linear is not None else None

    def ignores(self, prefix: str, packed: Mapping[str, tuple[str, ...]]) -> bool:
        """The server applies ``ignore`` to non-shared layers only (``should_ignore_layer``)."""
        if is_shared_expert_projection(prefix) or not self.ignore:
            return False
        return should_ignore_layer(prefix, self.ignore, packed)

    def as_json(self) -> dict[str, Any]:
        """The resolved overlay (what the plan's header and JSON show)."""
        return {
            "linear": self.linear.as_json() if self.linear else None,
            "shared_experts": self.shared_experts.as_json() if self.shared_experts else None,
            "ignore": list(self.ignore),
            "given": self.text,
            "default": self.default,
        }


def _quant_key(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"--quantization-config {where}: expected str or QuantKey, got {type(value).__name__} "
                          "(the server refuses this overlay)")
    if value not in QUANT_KEY_NAMES:
        raise ConfigError(f"--quantization-config {where}: unknown quantization name {value!r}; expected one of "
                          f"{sorted(QUANT_KEY_NAMES)} (the server refuses this overlay)")
    return value


def _spec(field: str, value: Any) -> Optional[QuantSpec]:
    """A spec the way the server's field validator reads it: null, a shorthand/name string, or a dict."""
    if value is None:
        return None
    if isinstance(value, str):
        if value in _SHORTHANDS and field != "shared_experts":
            weight = _SHORTHANDS[value][0 if field == "linear" else 1]
            if weight is None:
                raise ConfigError(f"--quantization-config {field}: online shorthand {value!r} does not define a "
                                  f"{field} spec (the server refuses this overlay)")
            return QuantSpec(weight=weight)
        return QuantSpec(weight=_quant_key(value, field))
    if isinstance(value, dict):
        extra = sorted(set(value) - {"weight", "activation"})
        if extra:
            raise ConfigError(f"--quantization-config {field}: unknown key {extra[0]!r} (Unexpected keyword argument; "
                              "a spec has only 'weight' and 'activation'); the server refuses this overlay")
        weight = None if value.get("weight") is None else _quant_key(value["weight"], f"{field}.weight")
        act = None if value.get("activation") is None else _quant_key(value["activation"], f"{field}.activation")
        return QuantSpec(weight, act)
    raise ConfigError(f"--quantization-config {field}: expected a spec object or a name string, got "
                      f"{type(value).__name__} (the server refuses this overlay)")


def parse_overlay(text: str, *, default: bool = False) -> Overlay:
    """Parse and validate the server's ``--quantization-config`` string for an EXL3 checkpoint.

    Raises ConfigError (exit 2) with the server's reason for anything the fork refuses: invalid JSON, unknown
    keys, a ``moe`` spec, no spec at all, ``ignore`` without ``linear``, or any weight format but ``mxfp8`` or an
    activation override. Example: ``parse_overlay('{"linear": "mxfp8"}').linear.weight == "mxfp8"``.
    """
    try:
        raw = loads_json(text)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--quantization-config is not valid JSON ({e}); pass the exact string the server is "
                          "started with, e.g. '{\"linear\": {\"weight\": \"mxfp8\"}}'") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--quantization-config must be a JSON object with keys {list(_FIELDS)}, got "
                          f"{type(raw).__name__}")
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"--quantization-config: unknown key {unknown[0]!r} (Unexpected keyword argument; the "
                          f"server's QuantizationConfigArgs accepts only {list(_FIELDS)}); the server refuses it")
    linear, moe, shared = (_spec(f, raw.get(f)) for f in ("linear", "moe", "shared_experts"))
    ignore = raw.get("ignore", [])
    if ignore is None:
        ignore = []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise ConfigError("--quantization-config ignore: expected a list of strings (exact module names or "
                          "'re:' patterns); the server refuses this overlay")
    for target in ignore:
        if target.startswith("re:"):
            try:
                re.compile(target[3:])
            except (re.error, RecursionError, OverflowError) as e:
                raise ConfigError(f"--quantization-config ignore: {target!r} is not a valid regular expression ({e}); "
                                  "the server would fail on it while loading the model") from None
    # The EXL3 checkpoint overlay rule (_is_checkpoint_online_overlay with quantization='exl3').
    specs = [s for s in (linear, shared) if s is not None]
    why = None
    if moe is not None:
        why = "a 'moe' spec is not allowed on an EXL3 checkpoint"
    elif not specs:
        why = "it sets neither 'linear' nor 'shared_experts'"
    elif ignore and linear is None:
        why = "'ignore' only filters the 'linear' overlay, and 'linear' is not set"
    elif any(s.weight != "mxfp8" or s.activation is not None for s in specs):
        why = "EXL3 BF16 online overlay only supports weight='mxfp8' with no activation override"
    if why:
        raise ConfigError(
            f"--quantization-config {text.strip()}: {why}. The server refuses it: quantization_config is only "
            f"supported when quantization is one of {_ONLINE_NAMES}, or when using a supported checkpoint online "
            "overlay on 'shared_experts' and/or 'linear' (optional 'ignore'), got quantization='exl3'"
        )
    return Overlay(linear=linear, shared_experts=shared, ignore=tuple(ignore), text=text, default=default)


def resolve_overlay(text: Optional[str], *, shared_experts: bool = False) -> Overlay:
    """The overlay a command plans with: ``text`` (the server's string) or the documented default.

    ``shared_experts`` is the older ``--shared-experts`` flag: it adds a ``shared_experts`` spec to the default
    overlay; with an explicit ``--quantization-config`` put the spec in that string instead.
    """
    if text is None:
        base = json.loads(DEFAULT_OVERLAY_JSON)
        if shared_experts:
            base["shared_experts"] = {"weight": "mxfp8"}
        return parse_overlay(json.dumps(base), default=not shared_experts)  # "default": exactly the default
    if not text.strip():
        raise ConfigError("--quantization-config is empty: omit the option for the default overlay, or pass the "
                          "server's exact JSON string")
    overlay = parse_overlay(text)
    if shared_experts and overlay.shared_experts is None:
        raise ConfigError("--shared-experts conflicts with --quantization-config, which has no 'shared_experts' "
                          "spec; pass the server's exact string, e.g. add \"shared_experts\": \"mxfp8\" to it")
    return overlay


def is_shared_expert_projection(prefix: str) -> bool:
    """True for ``...shared_expert(s).{gate,up,gate_up,down}_proj``: covered by the ``shared_experts`` spec only."""
    parts = prefix.split(".")
    return (len(parts) >= 2 and parts[-1] in ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
            and parts[-2] in ("shared_expert", "shared_experts"))


def _matches(name: str, targets: tuple[str, ...] | list[str]) -> bool:
    for t in targets:
        if t.startswith("re:"):
            if re.match(t[3:], name):
                return True
        elif t == name:
            return True
    return False


def should_ignore_layer(prefix: str, ignore: tuple[str, ...] | list[str],
                        packed: Mapping[str, tuple[str, ...]]) -> bool:
    """vLLM's ``should_ignore_layer``: exact names or ``re:`` regexes (``re.match``, anchored at the start).

    A fused module (its leaf in the model's ``packed_modules_mapping``) not listed exactly is judged through its
    unfused names (every occurrence of the leaf replaced by each source leaf); sources that disagree are refused.
    """
    leaf = prefix.rsplit(".", 1)[-1]
    if leaf in packed and prefix not in ignore:
        verdicts = [(src, _matches(prefix.replace(leaf, src), ignore)) for src in packed[leaf]]
        if len({v for _, v in verdicts}) > 1:
            only = ", ".join(s for s, v in verdicts if v)
            raise ConfigError(
                f"{prefix}: ignore covers only {only} of its fused parts {list(packed[leaf])}; the server refuses "
                f"this (Found a different quantization schemes for {list(packed[leaf])} in {prefix}. vLLM "
                "requires all to use the same scheme.); ignore all parts or none"
            )
        return verdicts[0][1]
    return _matches(prefix, ignore)
