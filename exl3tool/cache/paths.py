"""Where an entry lives: ``<root>/v1/<model_identity[:20]>/tp<W>-rank<R>/<digest>.safetensors`` (spec §4)."""

from __future__ import annotations

import re
from pathlib import Path

from exl3tool.cache.key import CacheKey

__all__ = ["entry_path", "lock_path", "ENTRY_SUFFIX", "LOCK_SUFFIX", "TEMP_RE", "ENTRY_RE", "LOCK_RE", "LAYOUT_RE"]

ENTRY_SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"
ENTRY_RE = re.compile(r"^([0-9a-f]{64})\.safetensors$")
LOCK_RE = re.compile(r"^([0-9a-f]{64})\.safetensors\.lock$")
TEMP_RE = re.compile(r"^\.([0-9a-f]{64})\.safetensors\..*\.tmp$")
LAYOUT_RE = re.compile(r"^tp([0-9]+)-rank([0-9]+)$")


def entry_path(key: CacheKey, root: str | Path) -> Path:
    """The file the server looks up for ``key`` under cache root ``root``.

    >>> entry_path(key, "/cache/exl3").parts[-3:-1]   # doctest: +SKIP
    ('c9ab4d59bf201df6de44', 'tp2-rank1')
    """
    return (
        Path(root)
        / f"v{key.schema}"
        / key.model_identity[:20]
        / f"tp{key.tp_world_size}-rank{key.tp_rank}"
        / f"{key.digest()}{ENTRY_SUFFIX}"
    )


def lock_path(path: str | Path) -> Path:
    """The entry's lock file: the entry path plus ``.lock`` (never deleted by the server)."""
    return Path(f"{path}{LOCK_SUFFIX}")
