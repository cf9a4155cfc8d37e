"""Cache mode and cache root, read from the environment exactly as the server reads them (docs/cache-format.md §1.3, §1.4)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from exl3tool.errors import ConfigError

if TYPE_CHECKING:
    from exl3tool.releases import ServerRelease

__all__ = ["CACHE_MODES", "BITS_RANGE", "DEFAULT_BITS", "BITS_VAR", "cache_mode", "cache_root", "trellis_bits",
           "server_bits", "vllm_cache_root"]

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


def server_bits(bits: int | None, environ: Mapping[str, str] | None = None) -> int:
    """The key's ``bits``: ``bits`` when given, else the server's ``VLLM_EXL3_ONLINE_TRELLIS_BITS``, else 6.

    The one place this default lives: ``prepare`` (the library) and every command's ``--bits`` reach it, so a
    ``ServerRequest`` without bits plans what ``cache warm`` plans under the same environment. Either way the value
    must be from 3 to 8 (ConfigError naming the option or the variable).

    >>> server_bits(None, {"VLLM_EXL3_ONLINE_TRELLIS_BITS": "4"}), server_bits(8, {"VLLM_EXL3_ONLINE_TRELLIS_BITS": "4"})
    (4, 8)
    """
    lo, hi = BITS_RANGE
    if bits is None:
        env = trellis_bits(environ)
        return DEFAULT_BITS if env is None else env
    if isinstance(bits, bool) or not isinstance(bits, int) or not lo <= bits <= hi:
        raise ConfigError(f"--bits {bits}: must be from {lo} to {hi} (what the server accepts)")
    return bits


def _expanduser(path: str, env: Mapping[str, str]) -> str:
    """``os.path.expanduser`` with ``env``'s HOME when it has one (the server's), else this process's."""
    if (path == "~" or path.startswith("~/")) and env.get("HOME"):
        return env["HOME"].rstrip("/") + path[1:] or "/"
    return os.path.expanduser(path)


def vllm_cache_root(environ: Mapping[str, str] | None, release: "ServerRelease") -> Path:
    """vLLM's cache root as ``release``'s cache module computes it (``exl3tool.releases.server_vllm_root``; the run's
    release, ``ServerRequest.release``), ``~``-expanded: newer releases ``VLLM_CACHE_ROOT``, else
    ``$XDG_CACHE_HOME/vllm``, else ``~/.cache/vllm``; older ones (Gilded Gnosis up to r33) ignore ``XDG_CACHE_HOME``.
    ``environ`` None: this process's environment.
    """
    from exl3tool.releases import server_vllm_root

    env = _env(environ)
    return Path(_expanduser(server_vllm_root(env.get, release)[0], env))


def cache_root(environ: Mapping[str, str] | None, release: "ServerRelease") -> Path:
    """The server's cache root: ``VLLM_EXL3_ONLINE_CACHE_DIR`` (not stripped, not resolved) or
    ``<VLLM_CACHE_ROOT>/exl3_online`` (``exl3tool.releases.server_cache_root``, the one rule, per release: the run's,
    ``ServerRequest.release``; the root of Gilded Gnosis up to r33 ignores ``XDG_CACHE_HOME``). ``environ`` None:
    this process's environment.

    A relative value stays relative (the server takes it relative to its own working directory).
    """
    from exl3tool.releases import server_cache_root

    env = _env(environ)
    return Path(_expanduser(server_cache_root(env.get, release)[0], env))
