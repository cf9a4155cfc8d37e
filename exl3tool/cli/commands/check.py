"""`exl3tool cache check`: will the server's look-ups hit? Every miss grouped by cause, one line each with the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from exl3tool.cli.commands.command import Call, NotWith, command
from exl3tool.cli.commands.launching import launch_json, lookup_off
from exl3tool.cli.commands.planview import plan_notes
from exl3tool.errors import FindingsError
from exl3tool.cli.output import Output, plural

if TYPE_CHECKING:
    from exl3tool.operations.check import CheckReport

# The library (and torch through it) is imported inside the functions, where the work happens: `--help` stays light.

__all__ = ["register", "cache_check", "render_check", "render_no_lookup", "check_nodes"]


def _where(cause) -> str:
    jobs = cause.lookups
    if not jobs:  # look-ups the plan cannot hold: not counted, each a miss
        return "look-ups outside the plan (not counted)"
    layouts = sorted({(j.tp_size, j.tp_rank) for j in jobs})
    ranks = ",".join(f"tp{w}-rank{r}" for w, r in layouts[:4]) + (" ..." if len(layouts) > 4 else "")
    return f"{plural(len(jobs), 'look-up')}, e.g. {jobs[0].prefix} ({ranks})"


def render_check(out: Output, report: CheckReport, extra: Optional[dict] = None) -> None:
    """First why the server will not start (if it will not: the hits do not matter then), then counts, then one
    block per cause (where, which fields differ) with one line per finding and its fix."""
    plan = report.plan
    if report.hydrated is not None:
        out.note(f"{plan.model}: {report.hydrated.line()}")
    if report.release_note:
        out.note(report.release_note)
    for line in report.release_depends():
        out.warn(line)  # the rules whose outcome differs between the releases the server could run
    _start_failures(out, report)  # the report's first finding (stdout): nothing below makes this server start
    if report.stored:  # a hydrated checkpoint: the server encodes and looks up nothing exl3tool models
        for f in report.cannot_tell:
            out.warn(f"cannot tell whether this server starts: {f.text}; fix: {f.fix}")
        _causes(out, report)
        for f in report.notes:
            out.note(f"note ({f.field.replace('_', ' ')}): {f.text}; {f.fix}")
        unplanned = any(c.kind == "unplanned" for c in report.causes)
        out.line(f"0 look-ups: {report.stored}; " + (
            "those look-ups miss (above)" if unplanned else "the server encodes nothing online and needs no cache")
            + ("; but it will not start (first line)" if report.start_failures else ""))
        out.data({**report.as_json(), **(extra or {})})
        return
    plan_notes(out, plan, starts=False)
    for f in report.cannot_tell:
        out.warn(f"cannot tell whether this server starts: {f.text}; fix: {f.fix}")
    _causes(out, report)
    for f in report.notes:
        out.note(f"note ({f.field.replace('_', ' ')}): {f.text}; {f.fix}")
    o = report.hit_origins
    out.line(f"{plural(len(report.lookups), 'look-up')}: {plan.count('hit')} hit ({o['record']} recorded warms, "
             f"{o['exl3tool']} exl3tool without a record, {o['server']} written by the server), "
             f"{plan.count('miss')} miss, {plan.count('invalid')} invalid; {plural(plan.count('skipped'), 'layer rank')} the "
             f"server keeps unencoded (not 128-aligned); cache {plan.cache_root}")
    out.data({**report.as_json(), **(extra or {})})


def _start_failures(out: Output, report: CheckReport) -> None:
    """Why this server will not start, in the report itself (stdout), before anything else: the hits do not
    matter then."""
    for f in report.start_failures:
        out.line(f"{f.text}; fix: {f.fix}")


def _causes(out: Output, report: CheckReport) -> None:
    """One table per cause: where, which fields differ, one line per finding and its fix."""
    from rich.table import Table
    from rich.text import Text

    for n, cause in enumerate(report.causes, 1):
        title = {"miss": "miss", "invalid": "invalid", "server_written": "server-written",
                 "unplanned": "miss"}[cause.kind]
        table = Table(title=Text(f"{n}. {title}: {_where(cause)}"), show_header=False)
        table.add_column("field", no_wrap=True)
        table.add_column("what", overflow="fold")
        for f in cause.findings:
            table.add_row(f.field.replace("_", " "), f.text)
            table.add_row("", Text(f"fix: {f.fix}", style="green"))
        out.table(table)


def render_no_lookup(out: Output, reasons: tuple[str, ...], extra: dict, what: str = "launch") -> None:
    """A launch whose server looks nothing up: zero look-ups, each reason, and ``"server_lookup": false``. A finding
    (exit 1), never "all hit": the cache cannot make this server start warm."""
    from exl3tool.operations.check import no_lookup_json

    out.line(f"0 look-ups: this {what} encodes nothing online, because {reasons[0]}")
    for line in reasons[1:]:
        out.line(f"  and {line}")
    out.data({**no_lookup_json(reasons), **extra})


def cache_check(
    call: Call,
    nodes: Annotated[list[str], typer.Option(
        "--nodes", metavar="[NAME=]FILE",
        help="Compare the identities of a fleet before a rollout instead: one `exl3tool identity --json` document "
             "(or provenance record) gathered on each node; names the field that differs (docs/deploy.md).")] = [],
) -> None:
    """Will a server started with these settings hit? Every look-up it will make, as hit, miss or invalid.

    Takes `cache warm`'s options and plans exactly as `cache warm --dry-run`; reads entry headers and provenance
    records only, never encodes or writes. Misses are grouped by cause (model identity component, encoder identity,
    bits, shape, TP layout, overlay; entries the server wrote itself), one line each with the fix. Run it where the
    server runs, before it starts. Exit codes: 0 every look-up hits, 1 some miss or are invalid, 2 usage error or
    an assumed release (a label it does not know, a patched image not read, or none named where the releases
    answer differently, e.g. an XDG_CACHE_HOME root: give --server-release).

    Example: exl3tool cache check /models/GLM-5.3 --tp-size 2 --quantization-config "$QUANT_CONFIG" --cache-dir /cache/exl3

    From the server's launch (its TP size; --tp-size adds more), or a running server: exl3tool cache check
    --launch "vllm serve /models/GLM-5.3 -tp 2 --quantization-config '{...}'", exl3tool cache check --pid PID
    """
    out = call.out
    if nodes:
        check_nodes(out, nodes)
        return
    request, settings, environ = call.resolve(call.request(), add_tp_sizes=True, no_lookup="report")
    from exl3tool.releases import no_online_encoding

    rel = request.release
    if settings is None and not rel.online_cache:
        render_no_lookup(out, (no_online_encoding(rel),), {"release": request.release_choice.as_json()})
        _refuse_assumption(request.release_choice.unknown)
        raise FindingsError("this server makes no cache look-up: a warm cache changes nothing for it")
    off = lookup_off(settings, environ)
    from exl3tool.operations.check import check, stored_only_report

    stored = stored_only_report(request, environ) if off else None
    if stored is not None:  # every online layer is stored: encoding nothing is what this server should do
        out.note("this server encodes nothing online, which is right for this checkpoint: every online layer is "
                 "stored (the notes above about online-encode variables do not apply to it)")
        render_check(out, stored, launch_json(settings))
        _refuse_assumption(tuple(stored.assumptions()), _unknown_fix(stored))
        if stored.start_failures:
            raise FindingsError(stored.start_failures[0].text)
        if not stored.ok:  # the server encodes layers exl3tool does not model: those look-ups miss
            raise FindingsError("the server makes look-ups outside the plan that would miss"
                                + ("" if out.json else "; see the causes above"))
        return
    if off:
        what = "launch" if settings is not None else "environment"
        render_no_lookup(out, off, launch_json(settings), what)
        _refuse_assumption(request.release_choice.unknown)
        raise FindingsError(f"this {what} makes no cache look-up: a warm cache changes nothing for it")
    report = check(request, environ=environ)
    render_check(out, report, launch_json(settings))
    _refuse_assumption(tuple(report.assumptions()), _unknown_fix(report))
    if report.start_failures:
        raise FindingsError(report.start_failures[0].text)
    if not report.ok:
        bad = report.plan.count("miss") + report.plan.count("invalid")
        what = f"{bad} of {len(report.lookups)} look-ups would not hit"
        if any(c.kind == "unplanned" for c in report.causes):
            what += (", and the server makes look-ups outside the plan that would miss" if bad else
                     f": the {len(report.lookups)} planned look-ups hit, but the server makes others that would miss")
        raise FindingsError(what if out.json else f"{what}; see the causes above")


def _unknown_fix(report: CheckReport) -> str:
    """The fix for a report whose only assumptions are what exl3tool cannot tell about the start (a stored module
    whose layout it does not model): that finding's own, not a release to name; "" otherwise."""
    release = (report.release is not None and report.release.unknown) or report.release_depends()
    return "" if release or not report.cannot_tell else report.cannot_tell[0].fix


def _refuse_assumption(assumptions: tuple[str, ...], fix: str = "") -> None:
    """``cache check`` never answers on an assumption: exit 2 naming what exl3tool did not know (the report above
    says what it found under the assumed rules), with the fix (``fix``, else naming the release)."""
    if assumptions:
        from exl3tool.errors import ConfigError

        more = f" (and {len(assumptions) - 1} more above)" if len(assumptions) > 1 else ""
        raise ConfigError(f"no answer on an assumption: {assumptions[0]}{more}; " + (
            fix or "name the release the server runs: --server-release NAME (docs/releases.md)"))


def check_nodes(out: Output, specs: list[str]) -> None:
    """``cache check --nodes``: every node's identities against the first node's, one line per differing field."""
    from exl3tool.operations.fleet import compare_nodes

    report = compare_nodes(specs)
    for name, f in report.differences:
        out.line(f"{name}: {f.text}")
        out.line(f"  fix: {f.fix}")
    ref = report.nodes[0].name
    if report.ok:
        out.line(f"{plural(len(report.nodes), 'node')}: the same model and encoder identity as {ref} (model "
                 f"{report.nodes[0].model_identity[:20]}): entries warmed for one hit on every node")
    out.data(report.as_json())
    if not report.ok:
        differ = sorted({name for name, _ in report.differences})
        raise FindingsError(f"{plural(len(differ), 'node')} of {len(report.nodes)} compute other identities than "
                            f"{ref} ({', '.join(differ)}): entries warmed on {ref} miss there")


def register(app: typer.Typer) -> None:
    """Add ``cache check`` (to the ``cache`` group)."""
    from exl3tool.cli.commands.cache import cache_app

    # the fleet's identity documents are compared, nothing is planned: every other option means nothing there
    nodes = NotWith("nodes", groups=("model", "plan", "encoder", "cache", "launch"),
                    fix="drop it (--nodes compares the identity documents given), or check one launch without --nodes")
    # `cache warm`'s groups that can change a look-up (tests/operations/test_provenance.py): not how an encode runs
    command(cache_app, "check", groups=("model", "plan", "encoder", "cache", "launch"), rules=(nodes,))(cache_check)
