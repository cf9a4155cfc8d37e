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
from typing import TYPE_CHECKING

from exl3tool.errors import ConfigError

if TYPE_CHECKING:
    from exl3tool.cache.serverfs import ServerView

__all__ = ["ResolvedRevision", "resolve_hub_revision", "hub_cache_dir", "hub_offline", "server_hub_cache"]

_FULL_HASH = re.compile(r"^[0-9a-f]{40}$")
_HEX = re.compile(r"^[0-9a-f]{4,40}$")
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub.constants.ENV_VARS_TRUE_VALUES, compared upper-cased
_VAR = re.compile(r"\$(\w+|\{[^}]*\})", re.ASCII)  # what posixpath.expandvars replaces


@dataclass(frozen=True)
class ResolvedRevision:
    """A full commit hash and one sentence on where it came from."""

    sha: str
    how: str


def hub_offline(environ: Mapping[str, str] | None = None) -> bool:
    """``huggingface_hub.constants.HF_HUB_OFFLINE`` for this environment: ``_is_true(HF_HUB_OFFLINE or
    TRANSFORMERS_OFFLINE)``: the first *non-empty* of the two, upper-cased, in {1, ON, YES, TRUE}, unstripped (so
    ``HF_HUB_OFFLINE=0`` wins over ``TRANSFORMERS_OFFLINE=1``, and `` 1`` is not true)."""
    env = os.environ if environ is None else environ
    value = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE")
    return bool(value) and value.upper() in _TRUE


def _expand(value: str, env: Mapping[str, str]) -> str:
    """``os.path.expandvars(os.path.expanduser(value))`` with ``env`` as the environment (an unknown ``$X`` is kept,
    ``~user`` is left as it is)."""
    if (value == "~" or value.startswith("~/")) and "HOME" in env:
        value = (env["HOME"].rstrip("/") + value[1:]) or "/"

    def repl(m: re.Match) -> str:
        name = m.group(1)[1:-1] if m.group(1).startswith("{") else m.group(1)
        return env.get(name, m.group(0))

    return _VAR.sub(repl, value)


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``huggingface_hub.constants.HF_HUB_CACHE`` for this environment: ``HF_HUB_CACHE``, else the legacy
    ``HUGGINGFACE_HUB_CACHE``, else ``HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
    ``~/.cache/huggingface/hub``; ``~`` and ``$VAR`` expanded as huggingface_hub does (with this environment)."""
    env = os.environ if environ is None else environ
    home_default = os.path.join(_expand("~", env) if "HOME" in env else os.path.expanduser("~"), ".cache")
    hf_home = _expand(env.get("HF_HOME", os.path.join(env.get("XDG_CACHE_HOME", home_default), "huggingface")), env)
    legacy = env.get("HUGGINGFACE_HUB_CACHE", os.path.join(hf_home, "hub"))
    return Path(_expand(env.get("HF_HUB_CACHE", legacy), env))


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


def _cache_here(environ: Mapping[str, str] | None, view: "ServerView | None") -> Path:
    """The Hub cache of ``environ`` (the server's), where it is here through ``view``; exl3tool's own cache when the
    server's is not reachable from here (a cache inside the image)."""
    cache = hub_cache_dir(environ)
    if view is None:
        return cache
    here = _seen(view, cache)
    return Path(here) if here is not None else hub_cache_dir(None)


def _seen(view: "ServerView", cache: Path) -> str | None:
    """The server's Hub cache here, its links read in the server's view (``cache.serverfs``); None inside the
    image (not on a mount); a ConfigError naming a link that leads out of what is here."""
    from exl3tool.cache.serverfs import seen_from_here

    return seen_from_here(view, str(cache), "the server's Hub cache") if cache.is_absolute() else None


def server_hub_cache(environ: Mapping[str, str] | None, view: "ServerView | None") -> Path | None:
    """Where a launch's server keeps its Hub cache, here (its volume's folder); None when it is not on a volume
    (inside the image) or the server runs on this host's own paths."""
    if view is None:
        return None
    cache = hub_cache_dir(environ)
    here = _seen(view, cache)
    return Path(here) if here is not None and here not in (str(cache), os.path.realpath(cache)) else None


def resolve_hub_revision(
    repo_id: str, revision: str | None = None, *, environ: Mapping[str, str] | None = None,
    view: "ServerView | None" = None,
) -> ResolvedRevision:
    """The full commit of ``repo_id`` at ``revision`` (default ``main``); ConfigError when it cannot be resolved.

    ``environ`` is the server's environment: its Hub cache (``HF_HUB_CACHE``, ``HF_HOME``, ...), read here through
    ``view`` (the launch's mounts), answers offline or when the Hub cannot be reached; the Hub is asked unless the
    server's environment or exl3tool's own sets ``HF_HUB_OFFLINE``.
    """
    rev = revision or "main"
    cache = _cache_here(environ, view)
    if _FULL_HASH.match(rev):
        # Already a commit: the server records exactly this hash as _commit_hash; nothing to look up.
        present = (cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / rev).is_dir()
        where = "snapshot present in the local Hub cache" if present else "not in the local Hub cache"
        return ResolvedRevision(rev, f"given as a full commit hash ({where})")
    if hub_offline(environ) or hub_offline(None):
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
