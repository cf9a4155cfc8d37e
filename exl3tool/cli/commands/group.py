"""The command and group classes every exl3tool command uses, their help layout (Click's own formatter, wrapping
whole words), and Click's exception classes as this Typer raises them."""

from __future__ import annotations

import importlib
import textwrap

import typer
from typer.core import TyperCommand, TyperGroup

__all__ = ["Exl3Group", "Exl3Command", "LaunchCommand", "LAUNCH_ARGV", "Run", "ReaderGone", "ClickException",
           "HELP_OPTIONS", "Exl3Formatter", "wrap_whole_words"]

HELP_OPTIONS = ["--help", "-h"]  # the root's context_settings, inherited by every command ("Try ... --help")

# Click's errors, from the module that defines the BadParameter this Typer exports (its own copy of Click from typer
# 0.2x on, Click itself before)
ClickException = importlib.import_module(typer.BadParameter.__module__).ClickException


def wrap_whole_words(text: str, width: int, initial_indent: str = "", subsequent_indent: str = "",
                     preserve_paragraphs: bool = False) -> str:
    """Click's ``wrap_text`` for help pages, never splitting a token: a word longer than the line stays whole (the
    terminal wraps it) and no line ends inside a hyphenated word (``--quantization-config``, ``encoder-source``).
    With ``preserve_paragraphs`` blank lines part paragraphs, each keeps its first line's indent, and one that
    starts with a ``\\b`` line is kept as written (Click's rules).

    >>> print(wrap_whole_words("see --quantization-config and VLLM_EXL3_ONLINE_CACHE_DIR", 16))
    see
    --quantization-config
    and
    VLLM_EXL3_ONLINE_CACHE_DIR
    """

    def wrapper(extra: str = "") -> textwrap.TextWrapper:
        return textwrap.TextWrapper(width, initial_indent=initial_indent + extra,
                                    subsequent_indent=subsequent_indent + extra, replace_whitespace=False,
                                    break_long_words=False, break_on_hyphens=False)

    text = text.expandtabs()
    if not preserve_paragraphs:
        return wrapper().fill(text)
    paragraphs: list[tuple[str, bool, list[str]]] = []  # (indent, kept as written, lines)
    for block in text.split("\n\n"):
        lines = [line for line in block.splitlines() if line]
        if not lines:
            continue
        indent = " " * (len(lines[0]) - len(lines[0].lstrip()))
        raw = lines[0].strip() == "\b"
        paragraphs.append((indent, raw, lines[1:] if raw else [line.lstrip() if i == 0 else line
                                                              for i, line in enumerate(lines)]))
    out = []
    for indent, raw, lines in paragraphs:
        w = wrapper(indent)
        out.append("\n".join((w.initial_indent if i == 0 else w.subsequent_indent) + line
                              for i, line in enumerate(lines)) if raw else w.fill(" ".join(lines)))
    return "\n\n".join(out)


class Exl3Formatter(typer.Context.formatter_class):
    """Click's help formatter, wrapping whole words (``wrap_whole_words``); on a narrow terminal the options' column
    is narrower (help text at least 38 characters wide) so that the longest words still fit the line."""

    def write_usage(self, prog: str, args: str = "", prefix=None) -> None:
        prefix = "Usage: " if prefix is None else prefix
        head = f"{prefix:>{self.current_indent}}{prog} "
        width = self.width - self.current_indent
        if width >= len(head) + 20:  # the arguments beside the prefix
            self.write(wrap_whole_words(args, width, initial_indent=head, subsequent_indent=" " * len(head)))
        else:  # below it
            indent = " " * (max(self.current_indent, len(prefix)) + 4)
            self.write(head + "\n" + wrap_whole_words(args, width, initial_indent=indent, subsequent_indent=indent))
        self.write("\n")

    def write_text(self, text: str) -> None:
        indent = " " * self.current_indent
        self.write(wrap_whole_words(text, self.width, indent, indent, preserve_paragraphs=True) + "\n")

    def write_dl(self, rows, col_max: int = 30, col_spacing: int = 2) -> None:
        rows = [tuple(row) + ("",) * (2 - len(row)) for row in rows]
        first_col = min(max((len(first) for first, _ in rows), default=0), min(col_max, max(12, self.width - 40)))
        first_col += col_spacing
        for first, second in rows:
            self.write(f"{'':>{self.current_indent}}{first}")
            if not second:
                self.write("\n")
                continue
            if len(first) <= first_col - col_spacing:
                self.write(" " * (first_col - len(first)))
            else:
                self.write("\n" + " " * (first_col + self.current_indent))
            lines = wrap_whole_words(second, max(self.width - first_col - 2, 10), preserve_paragraphs=True).splitlines()
            self.write((lines[0] if lines else "") + "\n")
            for line in lines[1:]:
                self.write(f"{'':>{first_col + self.current_indent}}{line}\n")


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
        """The arguments (each by its metavar) and the options, as Click lists them; the options' rows are Click's
        own (every value option's row names its metavar), hidden ones (old spellings) left out."""
        arguments, options = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append((param.metavar or param.name.upper(), record[1]))
            else:
                options.append(record)
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


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

    @property
    def interrupted_message(self) -> str:
        """An interrupted command's own error line ("" when it gave none)."""
        return self.output.interrupted_message if self.output is not None else ""


class ReaderGone(Exception):
    """stdout's reader closed the pipe (``exl3tool cache ls --json | head``)."""


class Exl3Group(TyperGroup):
    """A command group that shows its help (exit 0) when called bare, and points misplaced commands to their group."""

    context_class = Exl3Context

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
        name = args[0] if args else ""
        if name and self.get_command(ctx, name) is None and not ctx.resilient_parsing:
            for group_name, group in self.commands.items():
                if name in getattr(group, "commands", {}):
                    ctx.fail(f"No such command '{name}'. Did you mean 'exl3tool {group_name} {name}'?")
        return super().resolve_command(ctx, args)
