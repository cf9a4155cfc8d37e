"""How a plan is told on stderr (its overlay, kind, notes; what a readonly or off mode discards): shared by the
commands that plan, `encode`, `cache warm` and `cache check`, so none of them imports another."""

from __future__ import annotations

from typing import TYPE_CHECKING

from exl3tool.cli.output import Output, plural

if TYPE_CHECKING:
    from exl3tool.plan import LookupPlan

__all__ = ["plan_notes", "discard_note"]


def plan_notes(out: Output, plan: LookupPlan, *, starts: bool = True) -> None:
    """The plan's header on stderr: overlay, kind, notes; a warning when the server will not look entries up, and
    (``starts``; `cache check` reports them itself) one per TP size where a server of the checkpoint will not start
    because a rank cannot slice a module it stores as EXL3 (``LayerPlan.start_problem``)."""
    for warning in plan.identity_warnings:
        out.warn(warning)
    lp = plan.layer_plan
    if lp is None:
        return
    if lp.overlay is not None:
        out.note(f"quantization config: {lp.overlay.text}" + (" (default)" if lp.overlay.default else ""))
    gaps = {e.detail for e in lp.excluded if e.reason == "not_modelled"}  # layers the server encodes, we do not
    for note in lp.notes:
        (out.note if lp.server_lookup and note not in gaps else out.warn)(note)
    if plan.fetch is not None:
        out.note(plan.fetch.line())
    if starts and lp.server_lookup:
        for tp in plan.tp_sizes:
            why = lp.start_problem(tp)
            if why:
                out.warn(f"a server of this checkpoint at TP {tp} will not start, whatever the cache holds: {why}; "
                         "`exl3tool cache check` says where it does")


def discard_note(out: Output, plan: LookupPlan) -> None:
    """`encode --mode readonly|off`: say before the first encode that its results will be thrown away."""
    if plan.mode != "readwrite":
        what = ("the cache is neither read nor written: every planned layer" if plan.mode == "off" else
                "the cache is read, never written: every layer missing from it")
        out.note(f"mode {plan.mode}: {what} is encoded ({plural(len(plan.todo), 'job')}) and the result discarded "
                 "(a timing or a dry check); --mode readwrite publishes the entries")
