"""The exl3tool command line: wires command groups to the library and maps errors to exit codes.

Commands live in ``exl3tool.commands``; each parses options, calls one library function and renders the result.
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

from exl3tool import __version__
from exl3tool.commands.group import ClickException, Exl3Group
from exl3tool.errors import Exl3ToolError, describe
from exl3tool.output import forget_json_document, json_document_written

__all__ = ["app", "main", "debug_enabled"]


app = typer.Typer(
    name="exl3tool",
    help="Encode dense layers into EXL3 trellis weights offline, into the serving stack's cache.",
    epilog="Exit codes: 0 ok; 1 findings (failed layers, invalid entries, failed checks); 2 usage, configuration "
    "or I/O error (inputs that select no work included); 130 interrupted (entries published so far are complete; "
    "the same command resumes). EXL3TOOL_DEBUG=1 adds tracebacks.",
    cls=Exl3Group,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
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
    """Attach every command group, once per process; imported lazily so `--help` stays fast."""
    if _registered:
        return
    from exl3tool.commands import register

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


def _fail(message: str, exit_code: int, json_mode: bool, *, show_usage=None) -> None:
    """Report one failure: the sentence on stderr (or Click's usage block), a JSON document on stdout in JSON mode."""
    if debug_enabled():
        traceback.print_exc()
    if show_usage is not None:
        show_usage()
    else:
        print(f"error: {message}", file=sys.stderr)
    if json_mode and not json_document_written():  # a findings error follows its own report: one document
        sys.stdout.write(json.dumps({"error": message, "exit_code": exit_code}, indent=2) + "\n")
        sys.stdout.flush()
    sys.exit(exit_code)


def _interrupted(json_mode: bool) -> None:
    """Ctrl-C: exit 130 (128 + SIGINT, as shells report it), saying that the cache is consistent."""
    _fail("interrupted: entries published so far are complete (a publish is atomic); run the same command again "
          "to resume", 130, json_mode)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app, turning every error into one line and an exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    json_mode = "--json" in args
    forget_json_document()
    try:
        from exl3tool.knobs import read_knobs

        read_knobs()  # every EXL3TOOL_* variable checked before a command runs: a bad one is one line, exit 2
        _register()  # imports the commands
        rc = app(args=args, prog_name="exl3tool", standalone_mode=False)  # errors come back here, not to Click
        if rc == 130:  # typer turns Ctrl-C into Exit(130), which non-standalone Click returns (no command does)
            _interrupted(json_mode)
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except Exl3ToolError as exc:
        _fail(describe(exc), exc.exit_code, json_mode)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort as exc:
        if isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt):  # Click < 8.2 / older typer
            _interrupted(json_mode)
        _fail("aborted", 2, json_mode)
    except KeyboardInterrupt:
        _interrupted(json_mode)
    except ClickException as exc:  # usage errors: Click's own usage line, "Try ... --help" and the message
        _fail(exc.format_message(), exc.exit_code, json_mode, show_usage=exc.show)
    except (ValueError, OSError) as exc:  # bad values and I/O problems raised below the commands
        _fail(describe(exc), 2, json_mode)
    except Exception as exc:  # a bug: say so, with what we know
        hint = "" if debug_enabled() else "; set EXL3TOOL_DEBUG=1 for the traceback"
        _fail(f"internal error ({type(exc).__name__}: {describe(exc)}){hint}; please report it", 2, json_mode)
