"""One object decides how command results are shown: Rich tables for people, JSON for machines.

Data goes to stdout; progress, notes and warnings go to stderr, so ``--json`` output stays parseable.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["Output", "to_jsonable"]


def to_jsonable(obj: Any) -> Any:
    """Turn dataclasses, paths and tuples into plain JSON values (stable key order)."""
    import dataclasses
    from pathlib import PurePath

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, PurePath):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return obj.item()
    return obj


@dataclass
class Output:
    """Renders results: ``json`` prints only machine output, ``quiet`` drops notes and progress."""

    json: bool = False
    quiet: bool = False
    stdout: Console = field(default_factory=lambda: Console(file=sys.stdout, soft_wrap=True))
    stderr: Console = field(default_factory=lambda: Console(file=sys.stderr, soft_wrap=True))

    @property
    def show_progress(self) -> bool:
        """Progress bars only for a person at a terminal."""
        return not self.quiet and not self.json and self.stderr.is_terminal

    def note(self, message: str) -> None:
        """A diagnostic line on stderr (suppressed by --quiet)."""
        if not self.quiet:
            self.stderr.print(message, highlight=False)

    def warn(self, message: str) -> None:
        """A warning on stderr, shown even with --quiet."""
        self.stderr.print(f"[yellow]warning:[/yellow] {message}", highlight=False)

    def table(self, table: Table) -> None:
        """A table for people; skipped in JSON mode (the caller emits ``data`` instead)."""
        if not self.json:
            self.stdout.print(table)

    def line(self, message: str) -> None:
        """A result line on stdout for people; skipped in JSON mode."""
        if not self.json:
            self.stdout.print(message, highlight=False)

    def data(self, obj: Any) -> None:
        """The machine-readable result: printed as JSON on stdout in JSON mode."""
        if self.json:
            sys.stdout.write(json.dumps(to_jsonable(obj), indent=2, sort_keys=True) + "\n")
            sys.stdout.flush()
