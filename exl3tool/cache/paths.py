"""Where an entry lives: ``<root>/v1/<model_identity[:20]>/tp<W>-rank<R>/<digest>.safetensors`` (docs/cache-format.md §4)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from exl3tool.cache.key import CacheKey

__all__ = ["entry_path", "entry_relpath", "layout_parts", "lock_path", "link_below_root", "link_problem", "ENTRY_SUFFIX", "LOCK_SUFFIX", "TEMP_RE", "ENTRY_RE", "LOCK_RE", "LAYOUT_RE"]

ENTRY_SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"
ENTRY_RE = re.compile(r"^([0-9a-f]{64})\.safetensors$")
LOCK_RE = re.compile(r"^([0-9a-f]{64})\.safetensors\.lock$")
TEMP_RE = re.compile(r"^\.([0-9a-f]{64})\.safetensors\..*\.tmp$")
LAYOUT_RE = re.compile(r"^tp([0-9]+)-rank([0-9]+)$")


def layout_parts(model_identity: str, tp_size: int, tp_rank: int, schema: int = 1) -> tuple[str, str, str]:
    """The three folders of an entry below the cache root: ``v<schema>``, the model identity's first 20 characters,
    ``tp<W>-rank<R>``. The one place the layout is spelled (the store, records, bundles, scans and verdicts ask here).

    >>> layout_parts("c9ab4d59bf201df6de4427b1", 2, 1)
    ('v1', 'c9ab4d59bf201df6de44', 'tp2-rank1')
    """
    return f"v{schema}", model_identity[:20], f"tp{tp_size}-rank{tp_rank}"


def entry_relpath(model_identity: str, tp_size: int, tp_rank: int, digest: str, schema: int = 1) -> str:
    """An entry's path relative to the cache root, with ``/`` (a bundle's manifest names entries so)."""
    return "/".join((*layout_parts(model_identity, tp_size, tp_rank, schema), f"{digest}{ENTRY_SUFFIX}"))


def entry_path(key: CacheKey, root: str | Path) -> Path:
    """The file the server looks up for ``key`` under cache root ``root``.

    >>> entry_path(key, "/cache/exl3").parts[-3:-1]   # doctest: +SKIP
    ('c9ab4d59bf201df6de44', 'tp2-rank1')
    """
    return Path(root) / entry_relpath(key.model_identity, key.tp_world_size, key.tp_rank, key.digest(), key.schema)


def lock_path(path: str | Path) -> Path:
    """The entry's lock file: the entry path plus ``.lock`` (never deleted by the server)."""
    return Path(f"{path}{LOCK_SUFFIX}")


def link_below_root(root: str | Path, path: str | Path) -> Path | None:
    """The first symlink among the directories from below ``root`` down to ``path``'s folder, or None.

    ``root`` itself may be a link (the cache's mount point); a link below it would let a write land outside the
    cache, where ``cache verify``, ``prune`` and ``export`` never look. ``path`` itself is not checked (publishing
    replaces an entry file, never writes through it). Folders that do not exist yet are no link.
    """
    root, path = Path(root), Path(path)
    try:
        parts = path.parent.relative_to(root).parts
    except ValueError:
        return None
    here = root
    for part in parts:
        here = here / part
        try:
            if stat.S_ISLNK(os.lstat(here).st_mode):
                return here
        except OSError:
            return None
    return None


def link_problem(root: str | Path, path: str | Path) -> str | None:
    """``link_below_root`` as one line with the fix (callers add how to remove it), or None."""
    link = link_below_root(root, path)
    if link is None:
        return None
    try:
        target = f" (to {os.readlink(link)})"
    except OSError:
        target = ""
    return (f"{link} is a symlink{target} below the cache root; exl3tool never writes through it (entries there are "
            "invisible to cache verify, prune and export): replace it with a real directory")
