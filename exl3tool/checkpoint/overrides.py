"""The server's ``--hf-overrides`` applied to config.json as the fork applies it, before any layer is planned.

The fork (``vllm/config/model.py`` ``ModelConfig.__post_init__``, ``_apply_dict_overrides``, ``_update_nested``;
``vllm/transformers_utils/config.py`` ``get_config``) splits the overrides: a key whose value is not a dict is set
on the loaded config (``config.update``); a key whose value is a dict is merged recursively into the config's
sub-config of that name (``text_config``, ``vision_config``: a ``PretrainedConfig``; nested dicts are merged, other
values set), and otherwise replaces the attribute whole (``rope_scaling``, ``quantization_config``: plain dicts).
In config.json a sub-config is a dict named in ``SUB_CONFIGS`` or carrying its own ``model_type``.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Optional

from exl3tool.errors import ConfigError

__all__ = ["SUB_CONFIGS", "apply_hf_overrides", "parse_hf_overrides"]

# config.json keys transformers loads as nested PretrainedConfig objects (the families exl3tool plans use these)
SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "thinker_config", "talker_config", "llm_config",
               "language_config", "vision_tower_config")


def parse_hf_overrides(text: Optional[str], where: str = "--hf-overrides") -> Optional[dict[str, Any]]:
    """The overrides as a dict (None for none); a ConfigError naming ``where`` when it is not a JSON object."""
    if text is None or not str(text).strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} is not valid JSON ({exc.msg} at column {exc.colno}): {text[:60]!r}; the server "
                          "takes a JSON object such as '{\"num_hidden_layers\": 40}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a JSON object of config fields (the server takes a dict), "
                          f"got {text[:60]!r}")
    return value


def _is_sub_config(key: str, value: Any) -> bool:
    return isinstance(value, dict) and (key in SUB_CONFIGS or "model_type" in value)


def _update_nested(target: dict[str, Any], updates: dict[str, Any]) -> None:
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _update_nested(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def apply_hf_overrides(config: dict[str, Any], overrides: Optional[dict[str, Any]]) -> dict[str, Any]:
    """A copy of ``config`` (config.json) with ``overrides`` applied as the fork applies them.

    >>> apply_hf_overrides({"text_config": {"model_type": "t", "n": 1, "rope": {"a": 1}}, "rope_scaling": {"b": 2}},
    ...                    {"text_config": {"rope": {"c": 3}}, "rope_scaling": {"d": 4}})
    {'text_config': {'model_type': 't', 'n': 1, 'rope': {'a': 1, 'c': 3}}, 'rope_scaling': {'d': 4}}
    """
    out = copy.deepcopy(config)
    if not overrides:
        return out
    for key, value in overrides.items():  # flat values first (get_config), then dicts (_apply_dict_overrides)
        if not isinstance(value, dict):
            out[key] = copy.deepcopy(value)
    for key, value in overrides.items():
        if isinstance(value, dict):
            if _is_sub_config(key, out.get(key)):
                _update_nested(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out
