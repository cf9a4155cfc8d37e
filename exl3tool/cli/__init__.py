"""The exl3tool command line: wires command groups to the library and maps errors to exit codes.

Commands live in ``exl3tool.cli.commands``; each parses options, calls one library function and renders the result.
Every failure ends here as one sentence on stderr (and, under ``--json``, a JSON error document on stdout) with
exit code 1 (findings) or 2 (usage, configuration or I/O). ``EXL3TOOL_DEBUG=1`` adds the traceback and changes
nothing else.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Annotated, Optional

import typer

from typer.core import TyperCommand

from exl3tool.version import __version__
from exl3tool.cli.commands.group import HELP_OPTIONS, ClickException, Exl3Group, ReaderGone, Run
from exl3tool.errors import Exl3ToolError, describe
from exl3tool.text import plural

__all__ = ["app", "main", "debug_enabled", "COMMANDS"]

# Every top-level command and the first sentence of its help, in the order `exl3tool --help` lists them. The root
# lists these without importing a command module, and imports them all only when a command runs or shows its own
# help, as huggingface_hub's `hf` registers its commands; the command modules import the library (torch) only when
# they run. tests/cli/test_cli_lazy.py checks each line against the command's own help.
COMMANDS: tuple[tuple[str, str], ...] = (
    ("identity", "Print the model and encoder identities the server derives, how, and the --revision to start it "
                 "with."),
    ("encode", "Encode the eligible layers of MODEL for one TP size into the cache."),
    ("verify", "Verify MODEL's cache entries: trellis GEMM vs FP32 references, layer by layer."),
    ("encoder-source", "Write an encoder source that runs exl3tool's encoder inside the server, with exllamav3's "
                       "bytes."),
    ("synth", "Write a tiny EXL3 checkpoint of a served family (random weights, a few MB) to try warm, verify and "
              "ls on."),
    ("hydrate", "Write OUT: SOURCE with every layer the server would encode online stored as EXL3 (no cache "
                "needed)."),
    ("cache", "Warm, check, list, show, verify, prune, export and import the online EXL3 cache."),
)

class _LazyCommand(TyperCommand):
    """A top-level command not imported yet: its name and summary for the root's help, nothing to run."""

    def __init__(self, name: str, summary: str) -> None:
        super().__init__(name=name, short_help=summary)


class _LazyRoot(Exl3Group):
    """The root group: lists ``COMMANDS`` as placeholders and imports the real commands when one is chosen."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for name, summary in COMMANDS:
            self.commands.setdefault(name, _LazyCommand(name, summary))

    def _materialize(self) -> None:
        """Swap every placeholder for its command (importing the command modules once per process)."""
        if any(isinstance(c, _LazyCommand) for c in self.commands.values()):
            _register()
            loaded = typer.main.get_command(app).commands
            self.commands = {name: loaded.get(name, command) for name, command in self.commands.items()}
            self.commands.update(loaded)

    def resolve_command(self, ctx, args):
        self._materialize()  # a command runs or shows its help (and a mistyped one is pointed to its group)
        return super().resolve_command(ctx, args)


app = typer.Typer(
    name="exl3tool",
    help="Encode dense layers into EXL3 trellis weights offline, into the serving stack's cache.",
    epilog="Exit codes: 0 ok; 1 findings (failed layers, invalid entries, failed checks); 2 usage, configuration "
    "or I/O error (inputs that select no work included); 130 interrupted (entries published so far are complete; "
    "the same command resumes). EXL3TOOL_DEBUG=1 adds tracebacks.",
    cls=_LazyRoot,
    no_args_is_help=True,
    rich_markup_mode=None,  # Click's help: never cuts an option name, wraps help under long ones, and needs no rich
    pretty_exceptions_enable=False,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    context_settings={"help_option_names": HELP_OPTIONS},  # -h and --help, inherited by every command
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"exl3tool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool],
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit."),
    ] = None,
) -> None:
    """exl3tool: offline EXL3 encoding and cache warming."""


_registered: list[bool] = []


def _register() -> None:
    """Attach every command group to ``app``, once per process: ``main`` leaves this to the first command run."""
    if _registered:
        return
    from exl3tool.cli.commands import register

    register(app)
    _registered.append(True)


def debug_enabled(environ: Optional[dict] = None) -> bool:
    """``EXL3TOOL_DEBUG`` is on for 1/true/yes/on (any case); 0, false, no, off or empty leave it off.

    Never raises: it decides how an error is reported, including the error that refuses a bad EXL3TOOL_DEBUG
    (``main`` checks every knob first, so a bad value never gets this far unreported).
    """
    from exl3tool.errors import ConfigError
    from exl3tool.knobs import knob_value

    try:
        return knob_value("EXL3TOOL_DEBUG", environ)
    except ConfigError:
        return False


def _fail(run: Run, message: str, exit_code: int, *, show_usage=None, extra: Optional[dict] = None) -> None:
    """Report one failure: the sentence on stderr (or Click's usage block), a JSON document on stdout in JSON mode."""
    if debug_enabled():
        traceback.print_exc()
    if show_usage is not None:
        show_usage()
    else:
        print(f"error: {message}", file=sys.stderr)
    if run.json and not run.document_written:  # a findings error follows its own report: one document
        try:
            sys.stdout.write(json.dumps({"error": message, "exit_code": exit_code, **(extra or {})}, indent=2) + "\n")
            sys.stdout.flush()
        except OSError:  # stdout is what failed (full, closed): the line on stderr is the report
            _drop_stdout()
    sys.exit(exit_code)


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what it could not write stays silent."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _reader_gone() -> None:
    """stdout's reader closed the pipe (``exl3tool cache ls --json | head``): it read what it wanted; end quietly,
    exit 0, as ``head`` would not want a traceback or an error line (a ``cache export -`` whose reader stops early
    is an error of its own)."""
    _drop_stdout()
    sys.exit(0)


def _interrupted(run: Run) -> None:
    """Ctrl-C: exit 130 (128 + SIGINT, as shells report it), saying that the cache is consistent, or what the command
    said of its own results (``Output.note_interrupted``)."""
    report = run.interrupted
    if run.interrupted_message:
        _fail(run, run.interrupted_message, 130, extra=report)
    if run.output is None:  # before the command made its output from its options: no work had begun
        _fail(run, "interrupted before the command began its work: nothing was written; run the same command again",
              130, extra=report)
    done = f" after publishing {plural(report['published'], 'entry', 'entries')}" if "published" in report else ""
    _fail(run, f"interrupted{done}: entries published so far are complete (a publish is atomic); run the same "
          "command again to resume", 130, extra=report)


def _raised_by_ctrl_c(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt is among the causes of ``exc``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _ensure_stderr() -> None:
    """Started with stderr closed (``2>&-``): give fd 2 to /dev/null, so that diagnostics and progress go nowhere
    instead of failing, or going into whatever file took fd 2 (stdout's JSON included)."""
    import fcntl
    import os

    try:
        writable = fcntl.fcntl(2, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
    except OSError:
        writable = False
    if not writable:  # closed, or taken by a file the interpreter (or a shim) opened to read
        fd = os.open(os.devnull, os.O_WRONLY)
        if fd != 2:
            os.dup2(fd, 2)
            os.close(fd)
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app, turning every error into one line and an exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    run = Run(args)  # the root context's obj: the command's Output lands there
    _ensure_stderr()
    try:  # every EXL3TOOL_* variable is checked when a command runs (Exl3Command.invoke), never for its help
        rc = app(args=args, prog_name="exl3tool", standalone_mode=False, obj=run)  # errors come back here
        if rc == 130:  # typer turns Ctrl-C into Exit(130), which non-standalone Click returns (no command does)
            _interrupted(run)
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except Exl3ToolError as exc:
        _fail(run, describe(exc), exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort as exc:
        if isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt):  # Click < 8.2 / older typer
            _interrupted(run)
        _fail(run, "aborted", 2)
    except KeyboardInterrupt:
        _interrupted(run)
    except (BrokenPipeError, ReaderGone):
        _reader_gone()
    except ClickException as exc:  # usage errors: Click's own usage line, "Try ... --help" and the message
        _fail(run, exc.format_message(), exc.exit_code, show_usage=exc.show)
    except (ValueError, OSError) as exc:  # bad values and I/O problems raised below the commands
        _fail(run, describe(exc), 2)
    except Exception as exc:  # a bug: say so, with what we know
        if _raised_by_ctrl_c(exc):  # Ctrl-C during an import: Python wraps it (RuntimeError from __set_name__)
            _interrupted(run)
        hint = "" if debug_enabled() else "; set EXL3TOOL_DEBUG=1 for the traceback"
        _fail(run, f"internal error ({type(exc).__name__}: {describe(exc)}){hint}; please report it", 2)
