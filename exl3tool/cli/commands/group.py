"""The command and group classes every exl3tool command uses, and Click's exception classes as this Typer raises
them."""

from __future__ import annotations

import importlib
import types
from contextlib import contextmanager

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption

__all__ = ["Exl3Group", "Exl3Command", "LaunchCommand", "LAUNCH_ARGV", "Run", "ReaderGone", "ClickException", "UsageError", "HIDDEN_ALIASES", "HELP_OPTIONS"]

HELP_OPTIONS = ["--help", "-h"]  # the root's context_settings, inherited by every command ("Try ... --help")
# Old spellings still accepted and left out of the help, for one release (CHANGELOG.md): old -> new
HIDDEN_ALIASES = {"--tp-sizes": "--tp-size"}


def _click_class(name: str) -> type:
    """Click's exception class ``name`` as this Typer raises it (typer 0.29 vendors its own copy of Click)."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


ClickException = _click_class("ClickException")
UsageError = _click_class("UsageError")

_value_type = getattr(TyperOption, "display_type_rich", None)  # typer's rich help type column (newer typers)
_CLICK_NAMES = {"<str>": "TEXT", "<int>": "INTEGER", "<float>": "FLOAT", "<path>": "PATH", "<list[str]>": "TEXT"}


def _help_type(self, ctx):
    """The type column of an option's help row, as Click writes it: Typer's rich help labels every flag ``<bool>``
    and a value ``<str>``; a flag takes no value, so it shows none, and a value shows its metavar (``DAYS``,
    ``JSON``) or Click's ``TEXT``, ``INTEGER``, ``FLOAT``, ``PATH``."""
    if self.is_flag or self.count:
        return None
    label = _value_type(self, ctx)
    return _CLICK_NAMES.get(label, label) if self.metavar is None else label


def _argument_type(self, ctx):
    """An argument's row already shows its metavar (``MODEL``, ``DIR``): no ``<str>`` beside it."""
    return None


@contextmanager
def _help_params(command, ctx):
    """While ``command``'s help is formatted: its options' rows as Click writes them (``_help_type``; set on each
    option, never on Typer's classes) and without the hidden old spellings (``HIDDEN_ALIASES``)."""
    saved = []
    for param in command.get_params(ctx):
        saved.append((param, param.opts))
        param.opts = [o for o in param.opts if o not in HIDDEN_ALIASES] or param.opts
        if _value_type is not None:  # older typers print Click's own type names: nothing to mend
            mend = _help_type if isinstance(param, TyperOption) else _argument_type
            param.display_type_rich = types.MethodType(mend, param)
    try:
        yield
    finally:
        for param, opts in saved:
            param.opts = opts


_HelpFormatter = typer.Context.formatter_class  # Click's, as this Typer vendors it
_textwrap = importlib.import_module(_HelpFormatter.__module__.rsplit(".", 1)[0] + "._textwrap")


class _WholeWords(_textwrap.TextWrapper):
    """Click's wrapper, never cutting a word (a variable, a flag, a path) nor breaking it at a hyphen."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.break_long_words = False
        self.break_on_hyphens = False


@contextmanager
def _whole_words():
    """While one help block is written: Click's ``wrap_text`` (which imports its TextWrapper at each call) wraps
    with ``_WholeWords``; put back after, so nothing outside a help page changes."""
    wrapper = _textwrap.TextWrapper
    _textwrap.TextWrapper = _WholeWords
    try:
        yield
    finally:
        _textwrap.TextWrapper = wrapper


class Exl3Formatter(_HelpFormatter):
    """Help pages that never split a token: words wrap whole, and on a narrow terminal the options' column is
    narrower (help text at least 38 characters wide) so that the longest words still fit the line."""

    def write_dl(self, rows, col_max: int = 30, col_spacing: int = 2) -> None:
        with _whole_words():
            super().write_dl(rows, min(col_max, max(12, self.width - 40)), col_spacing)

    def write_text(self, text: str) -> None:
        with _whole_words():
            super().write_text(text)

    def write_usage(self, prog: str, args: str = "", prefix=None) -> None:
        with _whole_words():
            super().write_usage(prog, args, prefix)


class Exl3Context(typer.Context):
    formatter_class = Exl3Formatter


class Exl3Command(TyperCommand):
    """Every exl3tool command: Click's help layout, old spellings hidden, the knobs checked before it runs."""

    context_class = Exl3Context

    def invoke(self, ctx):
        from exl3tool.knobs import read_knobs

        read_knobs()  # every EXL3TOOL_* variable, once its options parsed: a bad one is one line, exit 2
        try:
            return super().invoke(ctx)
        except BrokenPipeError as exc:  # past Click, which would make it exit 1: ``main`` ends it quietly
            raise ReaderGone() from exc

    def format_options(self, ctx, formatter) -> None:
        with _help_params(self, ctx):
            super().format_options(ctx, formatter)


LAUNCH_ARGV = "exl3tool.launch_argv"  # ctx.meta key: the server's argv, the words after `--`


class LaunchCommand(Exl3Command):
    """A command whose words after ``--`` are the server's launch (``exl3tool cache warm -- vllm serve M -tp 2``)."""

    def parse_args(self, ctx, args):
        if "--" in args:
            at = args.index("--")
            ctx.meta[LAUNCH_ARGV] = tuple(args[at + 1:])
            args = args[:at]
        return super().parse_args(ctx, args)


class Run:
    """What ``main`` learns of one run (the root context's ``obj``): the command's ``Output``, once the command made
    it from its options; before that (a usage error), whether ``--json`` was on the command line."""

    def __init__(self, args: list[str]) -> None:
        self.args, self.output = args, None

    @property
    def json(self) -> bool:
        return self.output.json if self.output is not None else "--json" in self.args

    @property
    def document_written(self) -> bool:
        """Whether the command printed its JSON document (then an error adds none)."""
        return self.output is not None and self.output.document_written

    @property
    def interrupted(self) -> dict:
        """What an interrupted command had done (empty when it said nothing)."""
        return dict(self.output.interrupted) if self.output is not None else {}


class ReaderGone(Exception):
    """stdout's reader closed the pipe (``exl3tool cache ls --json | head``)."""


class Exl3Group(TyperGroup):
    """A command group that shows its help (exit 0) when called bare, and points misplaced commands to their group."""

    context_class = Exl3Context

    def format_options(self, ctx, formatter) -> None:
        with _help_params(self, ctx):
            super().format_options(ctx, formatter)

    def format_commands(self, ctx, formatter) -> None:
        """The commands section, each with its whole first sentence wrapped under it (Click cuts it to the width
        left beside the names and ends it with ``...``)."""
        rows = [(name, command.get_short_help_str(limit=10**6)) for name in self.list_commands(ctx)
                if (command := self.get_command(ctx, name)) is not None and not command.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def parse_args(self, ctx, args):
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            typer.echo(ctx.get_help(), color=ctx.color)
            ctx.exit(0)
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except UsageError:
            name = args[0] if args else ""
            for group_name, group in self.commands.items():
                if hasattr(group, "commands") and name in group.commands:
                    raise UsageError(f"No such command '{name}'. Did you mean 'exl3tool {group_name} {name}'?",
                                     ctx=ctx) from None
            raise
