"""Exceptions that the CLI maps to one-line messages and exit codes.

Library code raises these (or plain ``ValueError`` for bad arguments); the CLI turns them
into a single line on stderr and an exit code CI can act on: 1 for findings, 2 for usage,
configuration or I/O errors.
"""

from __future__ import annotations

__all__ = ["Exl3ToolError", "ConfigError", "InputError", "FindingsError", "describe"]


class Exl3ToolError(Exception):
    """Base class: a problem the user can fix; the message says how."""

    exit_code = 2


class ConfigError(Exl3ToolError):
    """Missing or inconsistent configuration (identities, cache mode, options)."""


class InputError(Exl3ToolError):
    """A checkpoint, file or cache entry that cannot be read or is malformed."""


class FindingsError(Exl3ToolError):
    """The command ran and found problems (failed layers, invalid entries)."""

    exit_code = 1


def describe(exc: BaseException) -> str:
    """The sentence a user should read for ``exc``: its message, never its class name.

    OSErrors become "PATH: reason" (``[Errno 21] Is a directory: 'x'`` reads as ``x: Is a directory``); an
    exception with no message falls back to its class name so the line is never empty.
    """
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror}"
    text = str(exc).strip()
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        text = f"missing {exc.args[0]!r}"
    return text or type(exc).__name__
