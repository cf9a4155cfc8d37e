"""Resolve a Hub revision (branch, tag, full or short hash) to the full 40-hex commit the server would record.

Offline (``HF_HUB_OFFLINE`` or no network) the answer comes from the local Hub cache's ``refs/`` and
``snapshots/``; online from ``HfApi().model_info(...).sha``. Anything else fails closed: a wrong
revision means every look-up on the server misses, so we never guess.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from exl3tool.errors import ConfigError

__all__ = ["ResolvedRevision", "resolve_hub_revision", "hub_cache_dir", "hub_offline"]

_FULL_HASH = re.compile(r"^[0-9a-f]{40}$")
_HEX = re.compile(r"^[0-9a-f]{4,40}$")
_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class ResolvedRevision:
    """A full commit hash and one sentence on where it came from."""

    sha: str
    how: str


def hub_offline(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``HF_HUB_OFFLINE`` (or the older ``TRANSFORMERS_OFFLINE``) is set to a true value."""
    env = os.environ if environ is None else environ
    return any(env.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The local Hub cache, read from the environment at call time (``HF_HUB_CACHE``, ``HF_HOME/hub``, ...)."""
    env = os.environ if environ is None else environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(os.path.expanduser(env[name]))
    if env.get("HF_HOME"):
        return Path(os.path.expanduser(env["HF_HOME"])) / "hub"
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "huggingface" / "hub"


def _resolve_local(repo_id: str, revision: str, cache: Path) -> ResolvedRevision:
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    if not repo_dir.is_dir():
        raise ConfigError(f"{repo_id}: not in the local Hub cache {cache} (download it, or pass the full commit hash)")
    ref = repo_dir / "refs" / revision
    if ref.is_file():
        sha = ref.read_text().strip()
        if not _FULL_HASH.match(sha):
            raise ConfigError(f"{ref}: does not hold a 40-hex commit hash ({sha!r}); re-download {repo_id}")
        return ResolvedRevision(sha, f"ref {revision!r} in the local Hub cache ({ref})")
    snapshots = sorted(p.name for p in (repo_dir / "snapshots").glob("*") if p.is_dir() and _FULL_HASH.match(p.name))
    if _FULL_HASH.match(revision) and revision in snapshots:
        return ResolvedRevision(revision, f"full hash, snapshot present in the local Hub cache ({repo_dir})")
    if _HEX.match(revision):
        matches = [s for s in snapshots if s.startswith(revision)]
        if len(matches) == 1:
            return ResolvedRevision(matches[0], f"short hash {revision!r} matches snapshot {matches[0]} in {repo_dir}")
        if len(matches) > 1:
            raise ConfigError(f"{repo_id}: short hash {revision!r} is ambiguous ({', '.join(matches)}); pass more digits")
    raise ConfigError(
        f"{repo_id}: revision {revision!r} is not a ref or snapshot in the local Hub cache {repo_dir}; "
        "pass the full 40-hex commit hash with --revision"
    )


def resolve_hub_revision(
    repo_id: str, revision: str | None = None, *, environ: Mapping[str, str] | None = None
) -> ResolvedRevision:
    """The full commit of ``repo_id`` at ``revision`` (default ``main``); ConfigError when it cannot be resolved."""
    rev = revision or "main"
    cache = hub_cache_dir(environ)
    if _FULL_HASH.match(rev):
        # Already a commit: the server records exactly this hash as _commit_hash; nothing to look up.
        present = (cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / rev).is_dir()
        where = "snapshot present in the local Hub cache" if present else "not in the local Hub cache"
        return ResolvedRevision(rev, f"given as a full commit hash ({where})")
    if hub_offline(environ):
        return _resolve_local(repo_id, rev, cache)
    try:
        from huggingface_hub import HfApi

        sha = HfApi().model_info(repo_id, revision=rev).sha
        if sha and _FULL_HASH.match(sha):
            return ResolvedRevision(sha, f"revision {rev!r} resolved on the Hub (model_info)")
        online_error = f"the Hub returned no commit hash ({sha!r})"
    except Exception as exc:  # network down, gated, not found: the local cache may still know the ref
        online_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    try:
        found = _resolve_local(repo_id, rev, cache)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (online look-up failed too: {online_error})") from None
    return ResolvedRevision(found.sha, f"{found.how}; online look-up failed ({online_error})")
