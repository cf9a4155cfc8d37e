"""`exl3tool encode` (one TP layout, any mode) and `exl3tool cache warm` (every rank of several TP sizes)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.filesize import decimal

from exl3tool.cli.commands.command import Call, NotWith, command
from exl3tool.cli.commands.launching import launch_json
from exl3tool.cli.commands.planview import discard_note, plan_notes
from exl3tool.errors import FindingsError
from exl3tool.cli.output import Output, plural

if TYPE_CHECKING:
    from exl3tool.operations.warm import WarmSummary
    from exl3tool.plan import LookupPlan, ServerRequest

# The library (and torch through it) is imported inside the functions, where the work happens: `--help` stays light.

__all__ = ["register", "encode", "cache_warm", "render_plan", "render_summary"]


def render_plan(out: Output, plan: LookupPlan, extra: Optional[dict] = None) -> None:
    """The dry-run table: one row per job, then the modules the server does not encode and why."""
    from rich.table import Table
    from rich.text import Text

    lp = plan.layer_plan
    overlay = f", quantization config {lp.overlay.text}" if lp is not None and lp.overlay is not None else ""
    kind = f", {lp.kind.kind} checkpoint" if lp is not None and lp.kind is not None else ""
    table = Table(title=f"plan for {plan.model} ({plan.bits} bits, TP {','.join(map(str, plan.tp_sizes))}"
                        f"{kind}{overlay})")
    for col in ("layer", "tp", "rank", "shape (in x out)", "tiles", "state", "note"):
        table.add_column(col, justify="right" if col in ("tp", "rank", "tiles") else "left")
    for j in plan.jobs:
        style = {"hit": "green", "miss": "yellow", "invalid": "red", "skipped": "dim"}.get(j.state, "")
        table.add_row(j.prefix, str(j.tp_size), str(j.tp_rank), f"{j.input_size} x {j.output_size}", str(j.tiles),
                      Text(j.state, style=style), j.reason)
    out.table(table)
    from exl3tool.plan.sharing import sharing_figures

    excluded = lp.excluded if lp is not None else ()
    if excluded and not out.json:
        ex = Table(title="not encoded by the server")
        for col in ("layer", "reason"):
            ex.add_column(col)
        for e in excluded:
            ex.add_row(e.prefix, e.detail or e.reason)
        out.table(ex)
    plan_notes(out, plan)
    discard_note(out, plan)
    looked_up = [j for j in plan.jobs if j.state != "skipped"]
    todo = plan.todo
    sharing = sharing_figures(todo)
    out.line(f"{plural(len(plan.jobs), 'job')}: {plan.count('hit')} hit, {plan.count('miss')} miss, "
             f"{plan.count('invalid')} invalid, {plan.count('skipped')} skipped; "
             f"{plural(len(excluded), 'module')} not encoded by the server; {plural(sum(j.tiles for j in looked_up), 'tile')} "
             f"in all, {plural(sum(j.tiles for j in todo), 'tile')} to encode; cache {plan.cache_root}")
    out.line(_sharing_line(sharing))
    if plan.shard is not None:
        out.note(plan.shard.note)  # which shard, and what said so
    out.data({**plan.as_json(), **(extra or {})})


def _sharing_line(f: dict) -> str:
    """How many encodes the pending entries need, and how many one shared encode saves (same rank-local shard)."""
    share = f"{100 * f['tiles_saved'] / f['tiles']:.1f}%" if f["tiles"] else "0%"
    return (f"{f['entries']} entries to encode need {f['encodes']} encodes: {f['encodes_saved']} saved by encoding "
            f"each distinct shard once ({f['tiles_saved']} of {f['tiles']} tiles, {share})")


def render_summary(out: Output, summary: WarmSummary, extra: Optional[dict] = None) -> None:
    """Counts, failures and the JSON summary."""
    from rich.table import Table

    c = summary.counts
    failed = [e for e in summary.entries if e.status == "failed"]
    if failed and not out.json:
        table = Table(title="failed layers")
        for col in ("layer", "tp", "rank", "error"):
            table.add_column(col)
        for e in failed:
            table.add_row(e.prefix, str(e.tp_size), str(e.tp_rank), e.error)
        out.table(table)
    saved = f" ({summary.encodes} encodes, {summary.encodes_saved} saved by sharing)" if summary.encodes_saved else ""
    shard = ""
    if summary.shard is not None:
        shard = f"shard {summary.shard['index']}/{summary.shard['count']}: "
    out.line(f"{shard}{c['hit']} hit, {c['encoded']} encoded{saved}, {c['skipped']} skipped, {c['failed']} failed; "
             f"{decimal(summary.bytes_written)} written in {summary.seconds:.1f} s on {summary.device}"
             f" ({summary.workers} worker{'s' if summary.workers != 1 else ''}); cache {summary.cache_root}")
    for st in summary.worker_stats:
        if st.get("gpu_budget_mib") is not None:
            out.note(f"worker {st.get('worker', 0)} on {st.get('device')}: GPU memory budget "
                     f"{st['gpu_budget_mib'] / 1024:.1f} GiB, peak {st.get('peak_cuda_mib', 0) / 1024:.1f} GiB")
    if summary.record_error:
        out.warn(summary.record_error)
    elif summary.record:
        out.note(f"provenance record {summary.record}" + ("" if summary.record_written else " (already there)"))
    render_unchecked(out, summary)
    out.data({**summary.as_json(), **(extra or {})})


def render_unchecked(out: Output, summary: WarmSummary) -> None:
    """Name every hit without exl3tool's checksum (prefix, TP layout and path), with what --check-unchecked did."""
    if not summary.unchecked:
        return
    checked = any(u.verdict is not None for u in summary.unchecked)
    n = len(summary.unchecked)
    if checked:
        replaced = sum(u.action == "replaced" for u in summary.unchecked)
        out.warn(f"{plural(n, 'hit')} carried no exl3tool checksum (written by the server?); checked against a fresh encode: "
                 f"{replaced} replaced, {n - replaced} kept")
    else:
        out.warn(f"{plural(n, 'hit')} carry no exl3tool checksum (written by the server?): kept as the server would load them; "
                 "`cache warm --check-unchecked` or `exl3tool verify MODEL --exact` checks their weights")
    for u in summary.unchecked:
        what = f"  {u.verdict}, {u.action or 'kept'}: {u.detail}" if u.verdict is not None else ""
        out.warn(f"unchecked {u.prefix} tp{u.tp_size}-rank{u.tp_rank} {u.path}{what}")


def _run(out: Output, request: ServerRequest, dry_run: bool, command: str = "cache warm",
         environ: Optional[dict] = None, extra: Optional[dict] = None) -> None:
    from exl3tool.operations.warm import warm
    from exl3tool.plan.request import prepare
    from exl3tool.plan.sharing import sharing_figures

    from exl3tool.releases import release_same_note

    same = release_same_note(request.release_choice, "would write the same entries in the same root")
    if request.mode == "readonly":  # its hits are read where a release nothing named may not look (readwrite: below)
        from exl3tool.operations.release_rules import cache_root

        cache_root(request, environ, what=f"the cache this {command} reads")
    if dry_run:
        _refuse_a_file_as_cache(request, environ)  # a real warm refuses it before its first encode
        checkpoint, plan, _ = prepare(request, environ=environ)
        if request.mode == "readwrite":  # as the warm itself refuses it (operations.warm.run)
            from exl3tool.operations.release_rules import refuse_undetermined, release_rules

            refuse_undetermined(request, release_rules(request, checkpoint.config, environ, writes=True)[0],
                                f"what this {command} writes")
            if same:
                out.note(same)
        render_plan(out, plan, extra)
        return
    display = out.progress_display()

    def on_plan(plan: LookupPlan, ctx, todo) -> None:
        if ctx.workers > 1:
            from exl3tool.plan import share_jobs

            todo = share_jobs(todo, ctx.worker, ctx.workers)
        plan_notes(out, plan)
        discard_note(out, plan)
        if same and plan.mode == "readwrite":  # the warm refused the run had any rule differed
            out.note(same)
        if plan.shard is not None:
            out.note(plan.shard.note)
        f = sharing_figures(todo)
        out.note(f"{plan.model}: {plural(len(plan.jobs), 'job')}, {plan.count('hit')} already cached, "
                 f"{len(todo)} to encode here ({plural(f['tiles'], 'tile')})"
                 + (f"; {f['encodes']} encodes ({f['encodes_saved']} saved: same shard)" if f["encodes_saved"] else ""))
        display.begin(todo)

    def on_checked(u) -> None:
        out.note(f"checked  {u.prefix} tp{u.tp_size}-rank{u.tp_rank} {u.verdict} ({u.action or 'kept'}) {u.seconds:.1f}s")

    finished = {status: 0 for status in ("hit", "encoded", "skipped", "failed")}

    def on_done(job, result) -> None:
        finished[result.status] = finished.get(result.status, 0) + 1
        display.done(job, result)

    def on_parity(parity) -> None:
        if parity.status == "identical":
            out.note(parity.line())
        else:  # unverified, or differs written under --trust-encoder-identity: one line
            out.warn(parity.line())

    try:
        summary = warm(request, environ=environ, on_start=display.started, on_done=on_done, on_plan=on_plan,
                       on_tiles=display.tiles, command=command, on_checked=on_checked, on_parity=on_parity)
    except KeyboardInterrupt:  # Ctrl-C: the error document says what this process published before it
        out.note_interrupted({"published": finished["encoded"], "counts": dict(finished)})
        raise
    finally:
        display.end()
    if summary is None:  # a torchrun worker other than 0: worker 0 reports for everyone
        return
    render_summary(out, summary, extra)
    if not summary.ok:
        where = "the entries with status 'failed'" if out.json else "the list above"
        raise FindingsError(f"{plural(summary.counts['failed'], 'layer job')} failed; see {where}")


def _refuse_a_file_as_cache(request: ServerRequest, environ: Optional[dict]) -> None:
    """A dry run for a cache root that is a file would plan writes that can never happen: exit 2, as the warm
    itself would (``cache check`` reports it as its finding instead)."""
    from exl3tool.errors import InputError

    root = request.cache_root(environ)
    if root.exists() and not root.is_dir():
        raise InputError(f"cache directory {root} is not a directory (check --cache-dir or "
                         "VLLM_EXL3_ONLINE_CACHE_DIR)")


def encode(call: Call, dry_run: bool) -> None:
    """Encode the eligible layers of MODEL for one TP size into the cache.

    Example: exl3tool encode Qwen/Qwen3-8B --revision main --tp-size 2 --encoder-root /encoders/exllamav3 --encoder-revision v0.0.18 --dry-run

    From the server's launch: exl3tool encode --dry-run --launch "vllm serve /models/M -tp 2 --quantization-config '{...}'"

    Exit codes: 0 every layer present, 1 some layers failed, 2 usage, configuration or I/O error, 130 interrupted.
    """
    request, settings, environ = call.resolve(call.request())
    _run(call.out, request, dry_run, "encode", environ, launch_json(settings))


def _shard_option(value: Optional[str]) -> Optional[str]:
    """``--shard I/N``: checked here so a bad value is a usage error before any work."""
    if value is not None:
        try:
            from exl3tool.plan.shards import parse_shard

            parse_shard(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


ShardOpt = Annotated[Optional[str], typer.Option(
    "--shard", metavar="I/N", callback=_shard_option,
    help="Warm only shard I of N (0-based) of the plan: a static split by encode cost, the same on every task. "
    "Default: a scheduler's index, JOB_COMPLETION_INDEX (Kubernetes, with --shard-count) or SLURM_ARRAY_TASK_ID; "
    "0/1 is the whole plan.")]
ShardCountOpt = Annotated[Optional[int], typer.Option(
    "--shard-count", metavar="N", min=1,
    help="The shard count where the scheduler gives only the index (a Kubernetes Indexed Job's spec.completions).")]


def cache_warm(
    call: Call,
    dry_run: bool,
    shard_option: ShardOpt = None,  # with --shard-count and the task's environment: resolve_shard
    shard_count: ShardCountOpt = None,
) -> None:
    """Leave the cache as the server would after starting MODEL at each TP size: every layer, every rank.

    Idempotent (a second run is all hits) and resumable (a killed run leaves only complete entries). Hits without
    exl3tool's checksum (server-written) are kept and named; --check-unchecked re-encodes each, compares it with
    `verify --exact`'s rule and replaces (entry lock, atomic publish) the ones that differ.

    Under `torchrun --nproc-per-node N -m exl3tool cache warm ...` each process takes a balanced share. Across
    hosts, --shard I/N (or a Kubernetes Indexed Job's or Slurm array's index) takes shard I of a static split; every
    shard done, `cache check` over the whole plan hits everything (docs/deploy.md, "Sharded warms").

    Exit codes: 0 all present, 1 some layers failed, 2 usage or configuration error.

    Example: exl3tool cache warm meta-llama/Llama-3.1-8B-Instruct --revision main --tp-size 1,2,4,8 --json

    From the server's launch (its TP size; --tp-size adds more): exl3tool cache warm --launch "docker run -v
    /srv/m:/models/m -v /srv/cache:/cache/exl3-online --env-file server.env IMAGE vllm serve /models/m -tp 2 ..."
    """
    request, settings, environ = call.resolve(call.request(), add_tp_sizes=True)
    # the task's own environment (a scheduler's variables), never the server's
    from exl3tool.plan.shards import resolve_shard

    request = replace(request, shard=resolve_shard(shard_option, shard_count, os.environ))
    _run(call.out, request, dry_run, "cache warm", environ, launch_json(settings))


_ENCODES = ("model", "plan", "encoder", "cache", "encoding", "launch")  # the groups of a command that encodes


def _dry_run(*reads: str):
    """A dry run plans and looks up: it encodes, probes, locks and shows the progress of nothing, so the encoding
    options are refused there but ``reads`` (``encode``'s --mode) and --device and --file-mode, which it checks as
    the run would."""
    return NotWith("dry_run", groups=("encoding",), but=("device", "file_mode", *reads), names=("progress",),
                   fix="drop it: a dry run only plans (nothing is encoded, probed, locked or written), or run without "
                   "--dry-run")


def register(app: typer.Typer) -> None:
    """Add ``encode`` and ``cache warm`` (to the ``cache`` group)."""
    from exl3tool.cli.commands.cache import cache_app

    command(app, "encode", groups=_ENCODES, options=("tp_size", "tp_rank", "dry_run", "mode", "progress"),
            rules=(_dry_run("mode"),))(encode)
    command(cache_app, "warm", groups=_ENCODES, options=("dry_run", "check_unchecked", "progress"),
            rules=(_dry_run(),))(cache_warm)
