"""Cache mode and cache root, read from the environment exactly as the server reads them (docs/cache-format.md §1.3, §1.4)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from exl3tool.errors import ConfigError

__all__ = ["CACHE_MODES", "BITS_RANGE", "DEFAULT_BITS", "BITS_VAR", "cache_mode", "cache_root", "trellis_bits",
           "vllm_cache_root"]

CACHE_MODES = ("off", "readonly", "readwrite")
BITS_RANGE = (3, 8)  # what the server accepts for VLLM_EXL3_ONLINE_TRELLIS_BITS (docs/cache-format.md §1.2)
DEFAULT_BITS = 6
BITS_VAR = "VLLM_EXL3_ONLINE_TRELLIS_BITS"
_ALIASES = {"read-only": "readonly", "rw": "readwrite", "none": "off"}


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def cache_mode(environ: Mapping[str, str] | None = None) -> str:
    """``VLLM_EXL3_ONLINE_CACHE_MODE`` normalised like the server: unset -> readwrite, aliases mapped.

    >>> cache_mode({"VLLM_EXL3_ONLINE_CACHE_MODE": " RW "})
    'readwrite'
    """
    raw = _env(environ).get("VLLM_EXL3_ONLINE_CACHE_MODE")
    if raw is None:
        return "readwrite"
    mode = raw.strip().lower()
    mode = _ALIASES.get(mode, mode)
    if mode not in CACHE_MODES:
        # The server's exact text; an empty string is rejected too (only an unset variable means the default).
        raise ConfigError(f"VLLM_EXL3_ONLINE_CACHE_MODE must be off, readonly, or readwrite; got {mode!r}")
    return mode


def trellis_bits(environ: Mapping[str, str] | None = None) -> int | None:
    """``VLLM_EXL3_ONLINE_TRELLIS_BITS`` read as the server reads it: None when unset or blank, else 3..8.

    The server parses it with ``int()`` (surrounding spaces allowed, ``"6.0"`` rejected); anything else is a
    ConfigError that names the variable.

    >>> trellis_bits({"VLLM_EXL3_ONLINE_TRELLIS_BITS": " 4 "})
    4
    """
    raw = _env(environ).get(BITS_VAR)
    if raw is None or raw.strip() == "":
        return None
    lo, hi = BITS_RANGE
    try:
        bits = int(raw)
    except ValueError:
        raise ConfigError(f"{BITS_VAR}={raw!r} must be an integer from {lo} to {hi} (the server refuses it too)") from None
    if not lo <= bits <= hi:
        raise ConfigError(f"{BITS_VAR}={raw!r} must be from {lo} to {hi} (the server refuses it too)")
    return bits


def vllm_cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """vLLM's ``VLLM_CACHE_ROOT``: ``~``-expanded env value, else ``$XDG_CACHE_HOME/vllm``, else ``~/.cache/vllm``.

    Mirrors ``os.getenv`` semantics: a variable set to an empty string counts as set.
    """
    env = _env(environ)
    default_root = env.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return Path(os.path.expanduser(env.get("VLLM_CACHE_ROOT", os.path.join(default_root, "vllm"))))


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """The server's cache root: ``VLLM_EXL3_ONLINE_CACHE_DIR`` (not stripped, not resolved) or ``<VLLM_CACHE_ROOT>/exl3_online``.

    A relative value stays relative (the server takes it relative to its own working directory).
    """
    env = _env(environ)
    value = env.get("VLLM_EXL3_ONLINE_CACHE_DIR")
    if value is not None and value.strip() != "":
        return Path(os.path.expanduser(value))
    return vllm_cache_root(env) / "exl3_online"
