"""When nothing determined the server's release: which of its rules change this request's answer.

A run whose release was named, or read from its image's files or labels, follows that release. Otherwise its rules
could be any of several releases' (``ReleaseChoice.candidates``); this module gathers the request's
release-dependent inputs (where its cache root comes from, its checkpoint's r7 block, the K_r of its 128-unaligned
shards, its entries invalid only for non-finite data) and asks ``exl3tool.releases.rule_splits`` which rules then
differ. ``cache check`` reports them (exit 2) or notes that every release answers alike; a writing command
(``cache warm``, ``encode``, ``hydrate``) refuses before its first write where what it writes depends on them, and
every other command that picks a cache root (``cache ls``, ``show``, ``verify``, ``prune``, ``export``, ``import``,
``verify``, a read-only warm) takes it through ``cache_root``, which refuses a root that depends on them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from exl3tool.checkpoint.plan import ALIGN, LayerPlan, rank_sizes
from exl3tool.checkpoint.routing import r7_reading_differs
from exl3tool.errors import ConfigError
from exl3tool.plan.plan import LookupPlan
from exl3tool.plan.request import ServerRequest
from exl3tool.releases import MXFP8_BLOCK, NAME_IT, RuleSplit, release_depends, release_same_note, rule_splits

__all__ = ["release_rules", "refuse_undetermined", "root_rules", "cache_root"]


def root_rules(request: ServerRequest, environ: Optional[dict] = None) -> tuple[RuleSplit, ...]:
    """The cache-root rule alone: when the request's release is not determined, whether the root its server reads
    differs between the releases it could be (``()`` when it does not, or when the release is determined).

    A launch's root was compared as the launch was read, in its server's environment (``ReleaseChoice.splits``);
    without a launch the root comes from ``environ`` (None: this process's) by the release's rule, unless
    ``cache_dir`` gives it (``--cache-dir``: no release picks it)."""
    choice = request.release_choice
    if choice.determined:
        return ()
    env = os.environ if environ is None else environ
    return (*(s for s in choice.splits if s.rule == "cache_root"),
            *rule_splits(choice.candidates, root_env=None if request.cache_dir else env.get))


def cache_root(request: ServerRequest, environ: Optional[dict] = None, *, what: str = "the cache this command reads",
               writes: bool = False, cache_dir: str = "--cache-dir DIR") -> Path:
    """``request.cache_root(environ)`` (the one place the root is computed), where it does not depend on a release
    nothing determined; else a ConfigError (exit 2) naming the rule, the roots on each side and the fix: name the
    release, or give the cache (``cache_dir``: how the command takes it). For reads and writes alike: a listing of
    another release's root is as false an answer as a write into it. ``writes``: the refusal says no write was made
    on an assumption, as a warm's does."""
    splits = root_rules(request, environ)
    if splits:
        line = release_depends(request.release_choice, splits, what)[0]
        raise ConfigError(("no write on an assumption: " if writes else "") + f"{line}; {NAME_IT}, or give the cache: "
                          + cache_dir)
    return request.cache_root(environ)


def release_rules(request: ServerRequest, config: dict, environ: Optional[dict] = None,
                  plan: Optional[LookupPlan] = None, full: Optional[LayerPlan] = None, *, writes: bool = False,
                  lookups: bool = True) -> tuple[tuple[RuleSplit, ...], str]:
    """When the request's release is not determined (nothing named it, or what named it was not known): the rules
    whose outcome for this request differs between the releases that could be serving it, and, when none does,
    the one note saying that every one gives this answer (``exl3tool.releases.rule_splits``).

    Compared are the request's release-dependent inputs, not a plan per release: the cache root where it comes from
    the release's rule (``root_rules``),
    the checkpoint's r7 block (``config``), and with ``plan`` (``cache check``) the K_r of its 128-unaligned shards
    (``full``: the layer plan the server builds) and its entries invalid for non-finite data. ``writes``: what a
    warm writes (the root and the plan), not the start verdict; ``lookups`` False: the server looks nothing up
    (a hydrated checkpoint), so no root matters. ``((), "")`` when the release is determined."""
    choice = request.release_choice
    if choice.determined:
        return (), ""
    env = os.environ if environ is None else environ
    widths: set[int] = set()
    nonfinite = False
    if plan is not None and not writes:
        lp = full or plan.layer_plan
        for tp in plan.tp_sizes:
            for layer in (lp.layers if lp is not None and lp.server_lookup else ()):
                try:
                    k_r, n_r = rank_sizes(layer, tp)
                except (ValueError, ConfigError):
                    continue
                if (k_r % ALIGN or n_r % ALIGN) and k_r % MXFP8_BLOCK:
                    widths.add(k_r)
        nonfinite = any(j.state == "invalid" and "non-finite" in j.reason for j in plan.jobs)
    splits = (*(root_rules(request, env) if lookups else ()), *rule_splits(
        choice.candidates, r7=r7_reading_differs(config), unaligned=tuple(sorted(widths)), nonfinite=nonfinite))
    if splits:
        return splits, ""
    return (), release_same_note(choice, "would write the same entries in the same root" if writes else
                                 "gives this answer")


def refuse_undetermined(request: ServerRequest, splits: tuple[RuleSplit, ...], what: str) -> None:
    """No write on an assumption: a ConfigError (exit 2) naming the rule that differs between the releases the
    server could run, and the fix, when ``splits`` (``release_rules``) has any."""
    if splits:
        lines = release_depends(request.release_choice, splits, what)
        more = f" (and {len(lines) - 1} more rule(s))" if len(lines) > 1 else ""
        raise ConfigError(f"no write on an assumption: {lines[0]}{more}; {NAME_IT}")
