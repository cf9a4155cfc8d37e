"""``exl3tool cache ls|show|verify|prune``: inspect and tidy the server's cache; each a thin layer over ``exl3tool.cache``.

``cache_app`` is importable so other modules can add commands (``cache warm``) to the same group.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer
from rich.filesize import decimal

from exl3tool.cli.commands.command import Call, NotWith, OnlyWith, command
from exl3tool.cli.commands.group import Exl3Group
from exl3tool.cli.commands.options import MODEL_WANTED, non_empty
from exl3tool.errors import ConfigError, FindingsError, InputError
from exl3tool.cli.output import Output, plural

if TYPE_CHECKING:
    from exl3tool.cache.scan import EntryInfo

# The library (and torch through it) is imported inside each command, where the work happens: `--help` stays light.

__all__ = ["cache_app", "register"]

cache_app = typer.Typer(name="cache", help="Warm, check, list, show, verify, prune, export and import the online EXL3 cache.",
                        epilog="Exit codes: each command's --help states its own; all use 0 ok, 1 findings, 2 usage, "
                        "configuration or I/O error, 130 interrupted.",
                        no_args_is_help=True, cls=Exl3Group, rich_markup_mode=None)  # Click's help: see cli.py


# a cache command's launch and release only pick the cache root, which --cache-dir gives
_ROOT_GIVEN = NotWith("cache_dir", groups=("launch",),
                      fix="the launch and the release only pick the server's cache root, which --cache-dir gives: drop "
                      "one of them")


def _when(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M")


def _ranges(ranks: list[int]) -> str:
    """Ranks as runs: ``0-7``, ``0,2,4-5`` (a TP 8 row stays narrow).

    >>> _ranges([0, 1, 2, 3]), _ranges([0, 2, 4, 5]), _ranges([1])
    ('0-3', '0,2,4-5', '1')
    """
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@command(cache_app, "ls", groups=("cache", "entries", "launch"), rules=(_ROOT_GIVEN,))
def ls(call: Call, model_id: Optional[str]) -> None:
    """List entries grouped by model identity and TP layout (headers only; use `cache verify` to load them).

    The cache is --cache-dir, else the server's: from its launch when given (a container's volumes, its
    environment, its release), as `cache warm` finds it, else from this environment. Every cache command reads it
    so.

    Example: exl3tool cache ls --launch "docker run -v /srv/cache:/cache -e VLLM_EXL3_ONLINE_CACHE_DIR=/cache IMAGE
    vllm serve /models/m"

    Exit codes: 0 listed (an empty cache too), 2 no such cache directory, usage or I/O error.
    """
    from rich.table import Table

    from exl3tool.cache.listing import list_cache

    out = call.out
    root = call.cache_root()
    listing = list_cache(root, model=model_id)
    table = Table(title=f"EXL3 cache {root}", box=None, pad_edge=False, header_style="bold underline")  # 80 columns
    table.add_column("model identity", no_wrap=True, min_width=20)
    for col in ("TP", "ranks", "entries", "malformed", "size", "newest (UTC)"):
        table.add_column(col, justify="right" if col in ("entries", "malformed", "size") else "left", no_wrap=True)
    for g in listing.groups:
        table.add_row(g["model_identity"][:20], str(g["tp_world_size"]), _ranges(g["ranks"]), str(g["entries"]),
                      str(g["malformed"]), decimal(g["bytes"]), _when(g["newest"]))
    out.table(table)
    _identity_table(out, listing.identities)
    for sr in listing.bad_records:
        out.warn(f"{sr.path}: not a provenance record ({sr.error}); remove it with: exl3tool cache prune --invalid")
    out.line(f"{plural(len(listing.infos), 'entry', 'entries')}, {decimal(listing.bytes)}")
    out.data(listing.as_json())


def _identity_table(out: Output, identities: list[dict[str, Any]]) -> None:
    """Entries by model and encoder identity, with where they came from: recorded warms (the model as the warm
    named it, its path or repo), exl3tool, the server. One block per pair, each long value on its own line."""
    if not identities:
        return
    out.line("by model identity and encoder identity (their directory names)")
    for g in identities:
        o = g["origins"]
        out.line(f"{g['model_identity'][:20]} {g['encoder_identity'][:20]}: "
                 f"{plural(g['entries'], 'entry', 'entries')}, TP {','.join(map(str, g['tp_sizes']))}, "
                 f"{'/'.join(map(str, g['bits']))} bits")
        rows = [("  model", model) for model in dict.fromkeys(r["model"] for r in g["records"] if r.get("model"))]
        for r in g["records"]:
            rows.append(("  from", f"{r['command']} on {r['host']} at {r['time']}"
                         + (f" (imported {r['imported']['time']})" if r["imported"] else "")))
        if o["exl3tool"]:
            rows.append(("  from", f"{o['exl3tool']} by exl3tool without a record"))
        if o["server"]:
            rows.append(("  from", f"{o['server']} written by the server itself (no record, no exl3tool checksum)"))
        out.fields(None, rows)


def _model_ok(info: EntryInfo, model: str | None) -> bool:
    from exl3tool.cache.scan import matches_model

    return matches_model(info, model)


def _find_entry(cache_root: Callable[[], Path], entry: str) -> Path:
    """The entry file ``entry`` names: a path as given (no cache root picked), else a digest prefix under
    ``cache_root()``."""
    path = Path(entry)
    if path.exists() or path.is_symlink():
        return path
    needle = entry.lower().removesuffix(".safetensors")
    if len(needle) < 6 or any(c not in "0123456789abcdef" for c in needle):
        raise InputError(f"{entry}: no such file, and not a digest (give a path or at least 6 hex digits)")
    root = cache_root()
    found = sorted((root / "v1").glob(f"*/*/{needle}*.safetensors"))
    if not found:
        raise InputError(f"{entry}: no entry with that digest under {root} (check --cache-dir or the launch)")
    if len(found) > 1:
        raise InputError(f"{entry}: digest prefix matches {len(found)} entries; give more digits")
    return found[0]


@command(cache_app, "show", groups=("cache", "launch"), rules=(_ROOT_GIVEN,))
def show(
    call: Call,
    entry: Annotated[str, typer.Argument(metavar="ENTRY", parser=non_empty("an entry file or its digest"), help="Entry file path, or its digest (a unique prefix of 6+ hex digits).")],
) -> None:
    """Show one entry: key, tensors, metadata and whether the server would load it (exit 1 if not).

    Exit codes: 0 the server loads it, 1 it would not (or exl3tool's checksums fail), 2 no such entry or usage error.
    """
    from exl3tool.cache.scan import inspect_entry

    out = call.out
    path = _find_entry(lambda: call.cache_root(exists=False), entry)
    try:
        info = inspect_entry(path)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    shown = info.show_json()
    tensors = shown["tensors"]
    rows = [("status", info.status + (f" ({info.reason})" if info.reason else "")), ("size", decimal(info.size))]
    if info.key:
        rows += [(f"key.{name}", str(value)) for name, value in sorted(info.key.as_dict().items())]
    rows += [(f"tensor.{name}", f"{t['dtype']} {t['shape']}") for name, t in sorted(tensors.items())]
    rows += [(f"meta.{name}", value) for name, value in sorted(info.metadata.items()) if name != "cache_key"]
    out.fields(str(path), rows)  # identities and checksums whole: below their label when the line is too short
    out.data(shown)
    if info.status == "unchecked":
        out.note(f"{path}: {info.reason}")
    elif info.status != "valid":
        if info.loadable:  # the server's checks pass; only our checksum fails
            raise FindingsError(f"{path}: the server would load this entry, but exl3tool's checksums fail "
                                f"({info.reason.split(': the server would load it')[0]}); a warm re-encodes it, or "
                                "remove it with: exl3tool cache prune --invalid")
        raise FindingsError(f"{path}: the server would not load this entry: {info.reason}")


@command(cache_app, "verify", groups=("cache", "entries", "launch"), rules=(_ROOT_GIVEN,))
def verify(call: Call, model_id: Optional[str]) -> None:
    """Load every entry as the server would, check digest vs name and our checksum; exit 1 if any is invalid.

    Entries without exl3tool's checksum (the server writes none) are `unchecked`: the server would load them,
    and `exl3tool verify MODEL --exact` checks their weights. A lock path that is not a regular file is invalid too,
    and so is a symlinked folder below the root (exl3tool never enters it nor writes through it). Leftovers of killed
    writers (temp files, orphan locks) are counted, each marked held when a live process holds its entry lock.
    Exit codes: 0 every entry valid or unchecked, 1 invalid entries, broken lock paths or symlinked folders, 2 no
    such cache directory or usage error.
    """
    from rich.table import Table

    from exl3tool.cache.scan import CacheHealth, scan

    out = call.out
    root = call.cache_root()
    health = CacheHealth.of(root, [i for i in scan(root, deep=True) if _model_ok(i, model_id)])
    entries, valid, unchecked, invalid = health.entries, health.valid, health.unchecked, health.invalid
    bad_locks, temps, orphans, stale = health.broken_locks, health.temp_files, health.orphan_locks, health.stale_locks
    strays, links = health.stray_files, health.links

    def rel(i: EntryInfo) -> str:
        return str(i.path.relative_to(root) if i.path.is_relative_to(root) else i.path)

    if invalid or bad_locks or temps or strays:
        table = Table(title="Findings")
        table.add_column("file", overflow="fold")
        table.add_column("problem", overflow="fold")
        for i in invalid + bad_locks + temps + strays:
            table.add_row(rel(i), i.reason)
        out.table(table)
    for i in entries:
        if i.is_symlink and i.status == "valid":
            out.warn(f"{i.path}: a symlink; the server follows it and loads the target")
    out.line(
        f"{plural(len(entries), 'entry', 'entries')}: {len(valid)} valid, {len(unchecked)} unchecked, "
        f"{len(invalid)} invalid; {plural(len(bad_locks), 'broken lock path')}, "
        f"{plural(len(temps), 'leftover temp file')} ({sum(1 for i in temps if i.held)} held by a live writer), "
        f"{plural(len(orphans), 'orphan lock')} ({len(stale)} stale: no live holder), "
        f"{plural(len(links), 'symlinked folder')}"
    )
    if unchecked:
        out.note(f"{len(unchecked)} entr{'y has' if len(unchecked) == 1 else 'ies have'} no exl3tool checksum "
                 "(written by the server?): the server would load them; check their weights with: exl3tool verify MODEL --exact "
                 "(or replace the wrong ones with: exl3tool cache warm MODEL --check-unchecked)")
    if any(not i.held for i in temps) or stale:
        out.note("remove leftovers no live process holds with: exl3tool cache prune --temp")

    out.data(health.as_json())
    if not health.ok:
        what = []
        if invalid:
            what.append(f"{len(invalid)} invalid entr{'y' if len(invalid) == 1 else 'ies'}")
        if bad_locks:
            what.append(f"{len(bad_locks)} broken lock path{'' if len(bad_locks) == 1 else 's'}")
        if links:
            what.append(plural(len(links), "symlinked folder"))
        raise FindingsError(f"{' and '.join(what)} under {root}; remove with: exl3tool cache prune --invalid")


@command(cache_app, "prune", groups=("cache", "entries", "launch"), rules=(_ROOT_GIVEN,))
def prune(
    call: Call,
    model_id: Optional[str],
    invalid: Annotated[bool, typer.Option("--invalid", help="Invalid entries (the server would not load them, or exl3tool's checksums fail), broken lock paths and symlinked folders (the link, never its target).")] = False,
    temp: Annotated[bool, typer.Option("--temp", help="Leftover temporary files and orphan locks that no live process holds.")] = False,
    older_than: Annotated[
        Optional[float], typer.Option("--older-than", metavar="DAYS", help="Entries (and leftovers) older than DAYS.")
    ] = None,
    records: Annotated[bool, typer.Option("--records", help="Only provenance records whose entries are all gone (every prune drops those too).")] = False,
    plan_only: Annotated[bool, typer.Option("--dry-run", help="Print the plan and stop.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking.")] = False,
) -> None:
    """Delete invalid entries, leftovers or old entries: prints the plan (bytes freed) first.

    Lock files of entries that stay are never touched. Provenance records whose entries are all gone (after this prune)
    are removed with them; --invalid also removes record files that cannot be read as records.
    Example: exl3tool cache prune --invalid --temp --yes
    Exit codes: 0 removed, nothing to remove or declined, 2 nothing selected, usage error or a file that could not
    be removed.
    """
    from rich.table import Table

    if not (invalid or temp or records or older_than is not None):
        raise ConfigError("nothing selected: pass --invalid, --temp, --records and/or --older-than DAYS")
    if older_than is not None and older_than < 0:
        raise typer.BadParameter("must be >= 0", param_hint="--older-than")
    out = call.out
    root = call.cache_root()
    from exl3tool.cache.prune_report import PruneReport
    from exl3tool.cache.records import execute_record_prune, plan_record_prune, read_records
    from exl3tool.cache.scan import execute_prune, plan_prune, scan

    plan = plan_prune(scan(root, deep=invalid), invalid=invalid, temp=temp, older_than_days=older_than, model=model_id)
    rplan = plan_record_prune(root, read_records(root, model_prefix=model_id), invalid=invalid,
                              removing={info.path for info, _ in plan.items if info.kind == "entry"})
    table = Table(title=f"Prune plan for {root}")
    table.add_column("file", overflow="fold")
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("why", overflow="fold")
    for info, why in plan.items:
        table.add_row(str(info.path.relative_to(root)), decimal(info.size), why)
    for sr, why in rplan.items:
        table.add_row(str(sr.path.relative_to(root)), decimal(sr.size), why)
    out.table(table)
    for info, why in plan.skipped:
        out.note(f"skipping {info.path}: {why}")
    out.line(f"{plural(len(plan.items), 'file')}, {decimal(plan.bytes_freed)} to free"
             + (f"; {plural(len(rplan.items), 'provenance record')}" if rplan.items else ""))
    report = PruneReport(root, plan, rplan, plan_only)
    if plan_only or not (plan.items or rplan.items):
        out.data(report.as_json())
        return
    if not yes:
        if out.json:
            raise ConfigError("prune with --json needs --yes (or --dry-run): there is no prompt in JSON mode")
        try:
            agreed = typer.confirm(f"Delete {plural(len(plan.items) + len(rplan.items), 'file')}?")
        except typer.Abort:  # no answer: stdin closed or not a terminal (a script, CI)
            typer.echo()  # end the prompt's line
            raise ConfigError("no answer to the prompt (stdin is not interactive): pass --yes to prune without a "
                              "prompt, or --dry-run to see the plan") from None
        if not agreed:
            out.line("nothing removed")
            out.data(report.as_json())
            return
    done = execute_prune(plan)
    records_done = execute_record_prune(root, rplan)  # after the entries: a record goes with its last entry
    report = report.done(done, records_done)
    errors = report.errors
    for line in report.kept:
        out.note(line)
    for line in errors:
        out.warn(line)
    out.line(f"freed {decimal(done.freed)}"
             + (f"; {plural(len(done.kept), 'file')} changed since the plan, kept" if done.kept else "")
             + (f"; {plural(report.records_removed, 'provenance record')} removed" if report.records_removed else ""))
    out.data(report.as_json())
    if errors:
        raise InputError(f"{plural(len(errors), 'file')} could not be removed (see warnings); check permissions under {root}")


def register(app: typer.Typer) -> None:
    """Add the ``cache`` group."""
    app.add_typer(cache_app, name="cache")


# --- bundles: `cache export` / `cache import` ------------------------------------------------------------------------


def _tp_filter(tp_sizes: Optional[str]) -> Optional[tuple[int, ...]]:
    from exl3tool.cli.commands.options import parse_positive_ints

    return None if tp_sizes is None else parse_positive_ints(tp_sizes, "--tp-size")


def _export_report(out: Output, plan, bundle: str, size: int) -> None:
    from rich.table import Table

    if plan.left_out:
        table = Table(title="left out (invalid)")
        table.add_column("entry", overflow="fold")
        table.add_column("why", overflow="fold")
        for path, why in plan.left_out:
            table.add_row(path, why)
        out.table(table)
    out.line(f"exported {plural(len(plan.entries), 'entry', 'entries')} ({decimal(plan.bytes)}) to {bundle}: a {decimal(size)} bundle; "
             f"{len(plan.left_out)} invalid left out; cache {plan.root}")
    out.data(plan.as_json(bundle, size))


@command(cache_app, "export", groups=("cache", "entries", "launch"), options=("tp_filter",), rules=(_ROOT_GIVEN,))
def export(
    call: Call,
    model_id: Optional[str],
    tp_filter: Optional[str],
    out_path: Annotated[str, typer.Argument(metavar="OUT", parser=non_empty("a file, or - for stdout"), help="Bundle file to write, or - for stdout.")],
) -> None:
    """Write the valid entries (default: all) into one bundle file: a tar whose first member is the manifest.

    Every entry is loaded as the server would first; invalid ones are never exported and are listed. The same
    entries always give the same bytes. With OUT `-` the bundle goes to stdout and the report to stderr:
    exl3tool cache export - --model 3f2a | ssh node exl3tool cache import -
    Exit codes: 0 every selected entry exported, 1 some invalid ones left out (the bundle holds the rest),
    2 nothing to export, usage or I/O error.
    """
    import sys

    from exl3tool.cache.bundle import plan_export, write_bundle, write_bundle_file

    out = call.out
    root = call.cache_root()
    if out_path == "-" and sys.stdout.isatty():
        raise ConfigError("refusing to write a bundle to a terminal; redirect stdout or pipe it (… | exl3tool cache import -)")
    plan = plan_export(root, model=model_id, tp_sizes=_tp_filter(tp_filter))
    if not plan.entries:
        what = f" of model {model_id}" if model_id else ""
        raise ConfigError(f"no valid entries{what} under {root} to export"
                          + (f" ({len(plan.left_out)} invalid left out)" if plan.left_out else "")
                          + "; check --model / --tp-size / --cache-dir")
    if out_path == "-":
        try:
            size = write_bundle(plan, sys.stdout.buffer)
        except BrokenPipeError:  # not `| head`'s "enough": the importer on the other end got a cut bundle
            raise InputError("the reader of stdout closed the pipe before the bundle was whole; run the export "
                             "again (an import publishes only entries that match the manifest)") from None
        except OSError as exc:
            raise InputError(f"cannot write the bundle to stdout: {exc.strerror or exc}") from None
        if out.json or not out.quiet:  # stdout carries the bundle: the report goes to stderr, and --quiet drops it
            with out.on_stderr():
                _export_report(out, plan, "-", size)
    else:
        size = write_bundle_file(plan, out_path)  # atomic: a failed export never leaves a partial bundle
        _export_report(out, plan, out_path, size)
    if plan.left_out:
        raise FindingsError(f"{len(plan.left_out)} invalid entr{'y' if len(plan.left_out) == 1 else 'ies'} left out of "
                            "the bundle; see them with: exl3tool cache verify")


@command(cache_app, "import", groups=("model", "plan", "encoder", "cache", "launch"), without=("model", "tp_sizes"),
         options=("device", "file_mode"), rules=(
             # the import checks nothing against a model: the model, plan and encoder options mean nothing without it
             OnlyWith("against", groups=("model", "plan", "encoder"), names=("exact", "device"),
                      fix="drop it, or give --against MODEL to check the entries against MODEL's plan"),
             # the launch stays without --against (it picks the cache root), but --cache-dir gives the root
             NotWith("cache_dir", groups=("launch",), unless=("against",), fix=_ROOT_GIVEN.fix)))
def import_(
    call: Call,
    file_mode: str,
    bundle: Annotated[str, typer.Argument(metavar="BUNDLE", parser=non_empty("a file, or - for stdin"), help="Bundle file to read, or - for stdin.")],
    against: Annotated[Optional[str], typer.Option("--against", metavar="MODEL", parser=non_empty(MODEL_WANTED), help="Import only entries of MODEL's plan whose weights are MODEL's (within the verify bound; exactly with --exact); refuse the others. Takes the warm's model and encoder options.")] = None,
    exact: Annotated[bool, typer.Option("--exact", help="With --against: compare each entry with a fresh encode (verify --exact's rule) instead of the verify bound.")] = False,
) -> None:
    """Publish a bundle's entries into the cache, treating it as untrusted input.

    Every entry must match the manifest's size and sha256 and pass the server's checks before it is renamed into
    place (temp file, fsync, atomic rename, entry lock). Links, devices, absolute or '..' paths, extended headers,
    members not in the manifest, duplicates, paths that do not match their key and oversize headers are refused.
    A valid entry already present is kept; an invalid one is replaced. Importing a bundle twice changes nothing.
    With --against MODEL (and the options a warm of MODEL takes) every entry's key must be in MODEL's plan and its
    weights MODEL's: within the verify bound, or with --exact as `verify --exact` compares; others are refused.
    docs/deploy.md says what each mode proves.
    Exit codes: 0 all imported or present, 1 some refused (the rest imported), 2 unreadable bundle or I/O error.
    Example: exl3tool cache import exl3-cache.tar --cache-dir /srv/exl3-cache --file-mode 0644
    """
    import sys
    from dataclasses import replace

    from rich.table import Table

    from exl3tool.cache.bundle import import_bundle
    from exl3tool.cache.store import CacheStore
    from exl3tool.cli.commands.options import parse_file_mode

    out = call.out
    if against is not None:  # MODEL's plan as a warm of it would make: the launch's settings, under these flags
        from exl3tool.operations.release_rules import cache_root

        request, _, environ = call.resolve(call.request(model=against), given=("model",))
        root = cache_root(request, environ, what="where this command writes", writes=True)
    else:
        root = call.cache_root(exists=False, no_lookup="refuse", writes=True)
    try:
        store = CacheStore(root, "readwrite", file_mode=parse_file_mode(file_mode))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--file-mode") from None
    check = None
    if against is not None:
        from exl3tool.operations.against import AgainstModel

        check = AgainstModel.from_request(replace(request, cache_dir=str(root)), exact=exact, environ=environ)
    if bundle == "-":
        report = import_bundle(sys.stdin.buffer, store, source="-", check=check)
    else:
        try:
            fh = open(bundle, "rb")
        except OSError as exc:
            raise InputError(f"cannot read the bundle {bundle}: {exc.strerror}") from None
        with fh:
            report = import_bundle(fh, store, source=str(Path(bundle).resolve()), check=check)
    refused = report.refused
    if refused:
        table = Table(title="refused")
        table.add_column("member", overflow="fold")
        table.add_column("why", overflow="fold")
        for i in refused:
            table.add_row(i.path, i.reason)
        out.table(table)
    out.line(f"{report.count('imported')} imported, {report.count('replaced')} replaced (were invalid), "
             f"{report.count('present')} already present, {len(refused)} refused; "
             f"{decimal(report.bytes_written)} written; {plural(report.count('imported', 'record'), 'provenance record')} "
             f"imported, {report.count('present', 'record')} already there; cache {root}")
    out.data(report.as_json(bundle, None if against is None else {"model": against, "exact": exact}))
    if refused:
        kept = report.count("imported") + report.count("replaced") + report.count("present")
        rest = (f"the other {plural(kept, 'entry', 'entries')} are in the cache ({report.count('imported')} imported, "
                f"{report.count('replaced')} replaced, {report.count('present')} already there)" if kept else
                "no entry was imported")
        raise FindingsError(f"{plural(len(refused), 'bundle member')} refused (nothing of them was written); {rest}")
