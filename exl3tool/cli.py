"""The exl3tool command line: wires command groups to the library and maps errors to exit codes.

Commands live in ``exl3tool.commands``; each parses options, calls one library function and
renders the result. Set ``EXL3TOOL_DEBUG=1`` to see full tracebacks instead of one-line errors.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

from exl3tool import __version__
from exl3tool.errors import Exl3ToolError

app = typer.Typer(
    name="exl3tool",
    help="Encode dense layers into EXL3 trellis weights offline, into the serving stack's cache.",
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


def _register() -> None:
    """Attach every command group; imported lazily so `--help` stays fast."""
    from exl3tool.commands import register

    register(app)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app, turning library errors into one line and an exit code."""
    _register()
    try:
        rc = app(args=argv, standalone_mode=False)  # in this mode click returns typer.Exit codes instead of raising
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except Exl3ToolError as exc:
        if os.environ.get("EXL3TOOL_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(2)
    except Exception as exc:  # click usage errors and anything unexpected
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(2)
        if os.environ.get("EXL3TOOL_DEBUG"):
            raise
        print(f"error: {type(exc).__name__}: {exc} (set EXL3TOOL_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(2)
