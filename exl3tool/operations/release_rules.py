"""When nothing determined the server's release: which of its rules change this request's answer.

A run whose release was named, or read from its image's files or labels, follows that release. Otherwise its rules
could be any of several releases' (``ReleaseChoice.candidates``); this module gathers the request's
release-dependent inputs (where its cache root comes from, its checkpoint's r7 block, the K_r of its 128-unaligned
shards, its entries invalid only for non-finite data) and asks ``exl3tool.releases.rule_splits`` which rules then
differ. ``cache check`` reports them (exit 2) or notes that every release answers alike; a writing command
(``cache warm``, ``encode``, ``hydrate``) refuses before its first write where what it writes depends on them.
"""

from __future__ import annotations

import os
from typing import Optional

from exl3tool.checkpoint.plan import ALIGN, LayerPlan, rank_sizes
from exl3tool.checkpoint.routing import r7_reading_differs
from exl3tool.errors import ConfigError
from exl3tool.plan.plan import LookupPlan
from exl3tool.plan.request import ServerRequest
from exl3tool.releases import MXFP8_BLOCK, NAME_IT, RuleSplit, release_depends, release_same_note, rule_splits

__all__ = ["release_rules", "refuse_undetermined"]


def release_rules(request: ServerRequest, config: dict, environ: Optional[dict] = None,
                  plan: Optional[LookupPlan] = None, full: Optional[LayerPlan] = None, *, writes: bool = False,
                  lookups: bool = True) -> tuple[tuple[RuleSplit, ...], str]:
    """When the request's release is not determined (nothing named it, or what named it was not known): the rules
    whose outcome for this request differs between the releases that could be serving it, and, when none does,
    the one note saying that every one gives this answer (``exl3tool.releases.rule_splits``).

    Compared are the request's release-dependent inputs, not a plan per release: the cache root where it comes from
    the release's rule (no ``cache_dir``; a launch's root was compared as it was read, ``ReleaseChoice.splits``),
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
    splits = (*(choice.splits if lookups else ()), *rule_splits(
        choice.candidates, root_env=None if request.cache_dir or not lookups else env.get,
        r7=r7_reading_differs(config), unaligned=tuple(sorted(widths)), nonfinite=nonfinite))
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
