"""One object decides how command results are shown: Rich tables for people, JSON for machines.

Data goes to stdout; progress, notes and warnings go to stderr, so ``--json`` output stays parseable.
Every string we print is data (paths, layer names, reasons read from cache files), never Rich markup: a
``[/x]`` in a file name must print as itself, not crash the command. Styles come only from ``Text`` objects.
"""

from __future__ import annotations

import json
import sys
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from exl3tool.errors import InputError
from exl3tool.jsontext import to_jsonable  # re-exported: the reports' JSON, as commands print it
from exl3tool.text import plural  # re-exported: commands import it from here

if TYPE_CHECKING:  # rich is imported where output is drawn: `--help` never imports it
    from rich.console import Console
    from rich.table import Table

__all__ = ["Output", "to_jsonable", "plain_table", "fit_table", "fold_rows", "plural", "KEY_HEADERS", "fields_text",
           "stdout_errors"]

KEY_HEADERS = ("layer",)  # columns never cut: a layer name is what a reader looks for


def _plain(cell: Any) -> str:
    """A cell's text without styles (a ``str`` cell is literal text)."""
    return cell.plain if hasattr(cell, "plain") else str(cell)  # a rich Text, or any value


def _literal(cell: Any) -> Any:
    """A ``str`` as literal ``Text`` (Rich would parse it as markup); anything else unchanged."""
    from rich.text import Text

    return Text(cell) if isinstance(cell, str) else cell


def literal_table(table: Table) -> Table:
    """``table`` with its title and every ``str`` cell made literal text, in place."""
    table.title = _literal(table.title)
    for column in table.columns:
        column._cells = [_literal(c) for c in column._cells]
    return table


def plain_table(table: Table) -> str:
    """``table`` as text: the title, a header row and one line per row, columns padded to their widest cell.

    >>> from rich.table import Table; from rich.text import Text
    >>> t = Table("layer", "error"); t.add_row("model.layers.0.mlp.down_proj", Text("failed", style="red"))
    >>> t.add_row("model.layers.1.[x]", "[/red] a bracket")
    >>> print(plain_table(t), end="")
    layer                         error
    model.layers.0.mlp.down_proj  failed
    model.layers.1.[x]            [/red] a bracket
    """
    headers = [_plain(c.header) for c in table.columns]
    columns = [[_plain(cell) for cell in c._cells] for c in table.columns]
    rows = [list(r) for r in zip(*columns)] if columns else []
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    right = [c.justify == "right" for c in table.columns]

    def fmt(cells: list[str]) -> str:
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return "  ".join(parts).rstrip() + "\n"

    title = f"{_plain(table.title)}\n" if table.title else ""
    return title + fmt(headers) + "".join(fmt(r) for r in rows)


def fields_text(title: str | None, rows: list[tuple[str, str]], width: int | None) -> str:
    """``Output.fields`` as text: labels padded to the longest, each value beside its label when the line fits
    ``width`` (None: always), else below it, indented by two.

    >>> print(fields_text("t", [("key", "v"), ("checksum", "0123456789abcdef")], 20), end="")
    t
    key       v
    checksum
      0123456789abcdef
    """
    pad = max((len(label) for label, _ in rows), default=0)
    lines = [title] if title else []
    for label, value in rows:
        beside = f"{label.ljust(pad)}  {value}".rstrip()
        if width is None or len(beside) <= width:
            lines.append(beside)
        else:
            lines.append(label)
            lines += textwrap.wrap(value, width, initial_indent="  ", subsequent_indent="  ", break_long_words=False,
                                   break_on_hyphens=False) or [""]
    return "".join(line + "\n" for line in lines)


def _overhead(table: Table, columns: int) -> int:
    """The characters a Rich table adds around its cells: padding, and the borders when it has a box."""
    pad = table.padding[1] + table.padding[3] if isinstance(table.padding, tuple) and len(table.padding) == 4 else 2
    lines = (columns - 1 + (2 if table.show_edge else 0)) if table.box is not None else 0
    return columns * pad + lines


def fit_table(table: Table, width: int) -> Table | None:
    """``table`` made to fit ``width`` columns without splitting any word of any cell, or None.

    A key column (``KEY_HEADERS``) and a ``no_wrap`` one keep their widest cell's width; the others may wrap at
    spaces down to their longest word, never below it. Every column gets a fixed width, so Rich never shortens or
    folds one. None when even that is wider than ``width``: then ``fold_rows`` prints each row as label/value
    lines, so no column is left out and no word is cut.
    """
    cols = list(table.columns)
    keys = [c for c in cols if _plain(c.header) in KEY_HEADERS]
    texts = {id(c): [_plain(c.header)] + [_plain(cell) for cell in c._cells] for c in cols}

    def natural(c) -> int:
        return max(len(line) for text in texts[id(c)] for line in (text.splitlines() or [""]))

    def least(c) -> int:
        if c in keys or c.no_wrap:
            return natural(c)
        return max([len(w) for text in texts[id(c)] for w in text.split()] or [1])

    if sum(least(c) for c in cols) + _overhead(table, len(cols)) > width:
        return None
    widths = {id(c): natural(c) for c in cols}
    room = width - _overhead(table, len(cols))
    while sum(widths.values()) > room:  # narrow the column with the most slack above its longest word, by one
        c = max((c for c in cols if widths[id(c)] > least(c)), key=lambda c: widths[id(c)] - least(c))
        widths[id(c)] -= 1
    for c in cols:
        c.width = widths[id(c)]
        c.no_wrap = c in keys or c.no_wrap
    return table


def fold_rows(table: Table, width: int) -> str:
    """``table`` as label/value lines, one block per row (``fields_text``: a value too long beside its label goes
    below it, wrapped at spaces): what a terminal too narrow for the table's columns gets, every cell whole.

    >>> from rich.table import Table
    >>> t = Table("layer", "error", title="failed layers"); t.add_row("model.layers.0.mlp.down_proj", "no space left")
    >>> print(fold_rows(t, 30), end="")
    failed layers
    layer
      model.layers.0.mlp.down_proj
    error  no space left
    """
    headers = [_plain(c.header) for c in table.columns]
    columns = [[_plain(cell) for cell in c._cells] for c in table.columns]
    blocks = [fields_text(None, list(zip(headers, row)), width) for row in zip(*columns)] if columns else []
    title = "\n".join(textwrap.wrap(_plain(table.title), width, subsequent_indent="  ", break_long_words=False,
                                   break_on_hyphens=False)) + "\n" if table.title else ""
    return title + "\n".join(blocks)


def whole_words(message: str, console: Console) -> str:
    """``message`` for ``console``: at a terminal narrower than it, wrapped at spaces with the rest indented by two
    (a word longer than the line stays whole); elsewhere (a log, a pipe) one line as it is.

    >>> from io import StringIO; from rich.console import Console
    >>> print(whole_words("model.layers.0.mlp.down_proj: encoded", Console(file=StringIO(), width=20,
    ...                                                                  force_terminal=True)))
    model.layers.0.mlp.down_proj:
      encoded
    """
    if not console.is_terminal or len(message) <= console.width:
        return message
    return "\n".join("\n".join(textwrap.wrap(line, console.width, subsequent_indent="  ", break_long_words=False,
                                             break_on_hyphens=False)) or line for line in message.split("\n"))


@contextmanager
def stdout_errors():
    """A failed write to stdout (a full disk, ``> /dev/full``) as one line, exit 2; a reader that closed the pipe
    (``| head``) stays a ``BrokenPipeError``, which ``main`` ends quietly."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise InputError(f"cannot write the output to stdout: {exc.strerror or exc} (check where stdout goes, "
                         "e.g. the disk a redirect writes to)") from exc


def _console(file) -> Console:
    from rich.console import Console

    return Console(file=file, soft_wrap=True)


@dataclass
class Output:
    """A run's output, one per command run: ``json`` prints only machine output, ``quiet`` drops notes and
    progress, ``progress`` picks the progress display. It also keeps what ``main`` needs once the command ended:
    whether the JSON document went out (an error then adds none), what an interrupted command had done."""

    json: bool = False
    quiet: bool = False
    progress: str = "auto"  # --progress: auto, bar, lines or none (``progress_display``)
    stdout: Console = field(default_factory=lambda: _console(sys.stdout))
    stderr: Console = field(default_factory=lambda: _console(sys.stderr))
    document_written: bool = False  # the JSON document went to stdout (or was being written when it failed)
    interrupted: dict[str, Any] = field(default_factory=dict)  # fields an interrupted command's error document adds
    interrupted_message: str = ""  # the command's own line for an interrupt ("" : main's, about cache entries)

    def note_interrupted(self, report: dict[str, Any], message: str = "") -> None:
        """What this command had done when it was interrupted (a warm: ``published`` and ``counts``), for the error
        document ``main`` writes; ``message``: the error line itself, where the command keeps other things than
        cache entries (``hydrate``: where its results are kept)."""
        self.interrupted, self.interrupted_message = dict(report), message

    def note(self, message: str) -> None:
        """A diagnostic line on stderr (suppressed by --quiet); at a terminal wrapped at spaces (``whole_words``)."""
        if not self.quiet:
            self.stderr.print(whole_words(message, self.stderr), highlight=False, markup=False)

    def warn(self, message: str) -> None:
        """A warning on stderr, shown even with --quiet."""
        from rich.text import Text

        text = whole_words("warning: " + message, self.stderr)
        self.stderr.print(Text.assemble(("warning:", "yellow"), text[len("warning:"):]), highlight=False)

    @contextmanager
    def on_stderr(self):
        """While inside: the report for people and the JSON document go to stderr (``cache export -``, whose stdout
        carries the bundle)."""
        stdout, self.stdout = self.stdout, self.stderr
        try:
            yield
        finally:
            self.stdout = stdout

    def progress_display(self):
        """The display ``--progress`` asks for on stderr (``cli.progress``): a bar at a terminal, log lines in a pipe
        or a log, nothing under ``--quiet`` (unless a mode is named)."""
        from exl3tool.cli.progress import make_progress, progress_mode

        return make_progress(progress_mode(self.progress, terminal=self.stderr.is_terminal, quiet=self.quiet),
                             self.stderr)

    def table(self, table: Table) -> None:
        """A table for people; skipped in JSON mode (the caller emits ``data`` instead).

        At a terminal Rich draws it to the window's width, never splitting a word (``fit_table``: columns wrap at
        spaces); too wide for that, each row becomes label/value lines (``fold_rows``), no column left out. Piped or
        in a CI log it becomes plain aligned rows that are never cut or folded (a log has no width, and ``encod…``
        or ``2.10e…`` would hide the data).
        """
        if self.json:
            return
        terminal = self.stdout.is_terminal
        fitted = fit_table(literal_table(table), self.stdout.width) if terminal else None
        with stdout_errors():
            if fitted is not None:
                title, fitted.title = fitted.title, None  # above it, wrapped at spaces (Rich folds a long word)
                if title:
                    self.stdout.print(whole_words(_plain(title), self.stdout), highlight=False, markup=False)
                self.stdout.print(fitted)
            else:
                self.stdout.file.write(fold_rows(table, self.stdout.width) if terminal else plain_table(table))
                self.stdout.file.flush()

    def fields(self, title: str | None, rows: list[tuple[str, str]]) -> None:
        """Label/value lines for people (skipped in JSON mode): a value too long to sit beside its label at the
        terminal's width goes on the lines below it, indented and wrapped at spaces, so an identity, a checksum or
        a path is never cut (a single word longer than the line stays whole: the terminal wraps it)."""
        if self.json:
            return
        with stdout_errors():
            self.stdout.file.write(fields_text(title, rows, self.stdout.width if self.stdout.is_terminal else None))
            self.stdout.file.flush()

    def wrapped(self, message: str) -> None:
        """A result line on stdout for people (skipped in JSON mode), wrapped at spaces to a terminal's width with
        the rest indented by two; piped, one line as it is."""
        if self.json:
            return
        if self.stdout.is_terminal and len(message) > self.stdout.width:
            message = "\n".join(textwrap.wrap(message, self.stdout.width, subsequent_indent="  ",
                                               break_long_words=False, break_on_hyphens=False))
        with stdout_errors():
            self.stdout.file.write(message + "\n")
            self.stdout.file.flush()

    def line(self, message: str) -> None:
        """A result line on stdout for people; skipped in JSON mode. At a terminal wrapped at spaces."""
        if not self.json:
            with stdout_errors():
                self.stdout.print(whole_words(message, self.stdout), highlight=False, markup=False)

    def data(self, obj: Any) -> None:
        """The machine-readable result: printed as JSON on stdout in JSON mode."""
        if self.json:
            self.document_written = True  # even if it cannot be written: an error document would follow a partial one
            with stdout_errors():
                self.stdout.file.write(json.dumps(to_jsonable(obj), indent=2, sort_keys=True) + "\n")
                self.stdout.file.flush()

