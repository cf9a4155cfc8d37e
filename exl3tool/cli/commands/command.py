"""How a command is built from its option rows, and the one object its body receives.

``@command(parent, "warm", groups=(...), without=(...), options=(...))`` registers the body as a Typer command whose
options are, in help order, the rows it takes (``options.taken``: every row of its groups less ``without``, and the
rows named in ``options``, in the table's order), the body's own (a parameter with a Typer annotation), then the
output rows (``--progress`` where named, ``--json``, ``--quiet``: every command's). A row added to a group reaches
every command that takes the group, with nothing else edited. The body's signature declares only what it reads:
``call`` (a ``Call``: the request the rows give, the launch, the output) or ``out`` (the run's ``Output``), its own
options, and rows it reads as they are (a parameter named like a row, without a Typer annotation). ``rules=(...)``
declares the command's modes: the options a mode does not read (groups of rows, or options by name), refused there
with one usage error (``Rule``, built with ``OnlyWith``/``NotWith``), never ignored.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Collection, Optional

import typer

from exl3tool.cli.commands.group import LAUNCH_ARGV, Exl3Command, LaunchCommand, Run
from exl3tool.cli.commands.options import GROUPS, LAUNCH, ROWS, Row, existing_cache_dir, taken
from exl3tool.cli.output import Output

if TYPE_CHECKING:
    from exl3tool.launch import LaunchInput
    from exl3tool.plan import ServerRequest

__all__ = ["command", "Call", "Rule", "OnlyWith", "NotWith", "check_rules"]

_GIVEN = ("COMMANDLINE", "ENVIRONMENT", "PROMPT")  # parameter sources that mean "the user gave it"


def _old(name: str) -> str:
    """The parameter name of a row's old spelling (a hidden option of its own)."""
    return f"{name}_old"


@dataclass(frozen=True)
class Rule:
    """Options that do nothing in one mode of a command, refused there, never ignored (issue 49): the mode is the
    options ``with_`` given and ``without`` not (``cache import`` without ``--against``, ``verify --against``,
    ``cache check --nodes``, ``--cache-dir`` beside ``--server-release``); what it refuses is the command's rows of
    ``groups`` (less ``but``, which the mode does read) and the options ``names``. Any of them given on the command
    line (the server's argv after ``--`` counts as ``--launch``) is named in one usage error, with ``fix``.
    Declared on the command (``command(..., rules=...)``), built with ``OnlyWith`` or ``NotWith``."""

    with_: tuple[str, ...] = ()
    without: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    but: tuple[str, ...] = ()
    fix: str = "drop it"

    def refused(self, options: tuple[str, ...]) -> tuple[str, ...]:
        """Of the command's ``options``, those this rule refuses in its mode."""
        return tuple(n for n in options if n in self.names
                     or (n in ROWS and ROWS[n].group in self.groups and n not in self.but))

    def mode(self, spell: Callable[[str], str]) -> str:
        """The mode as the error names it (``with --cache-dir and without --against``); ``spell``: an option's
        spelling."""
        return " and ".join([*(f"with {spell(n)}" for n in self.with_), *(f"without {spell(n)}" for n in self.without)])

    def problem(self, call: Call) -> Optional[tuple[str, str]]:
        """``(the first option named, the sentence)`` when ``call`` is in the mode and gave options it refuses."""
        if not all(call.given(n) for n in self.with_) or any(call.given(n) for n in self.without):
            return None
        refused = self.refused(call.options)
        given = [call.spelling(n) for n in refused if call.given(n)]
        if "launch" in refused and call.ctx.meta.get(LAUNCH_ARGV) is not None:
            given.append("-- ARGV")
        if not given:
            return None
        verb, fix = ("does", self.fix) if len(given) == 1 else ("do", self.fix.replace("drop it", "drop them"))
        return given[0], f"{', '.join(given)} {verb} nothing {self.mode(call.spelling)}: {fix}"


def OnlyWith(option: str, *, groups: tuple[str, ...] = (), names: tuple[str, ...] = (), but: tuple[str, ...] = (),
             fix: str = "drop it") -> Rule:
    """The rows of ``groups`` (and the options ``names``) apply only with ``option`` given (``cache import``'s
    model, plan and encoder options only with ``--against MODEL``)."""
    return Rule(without=(option,), groups=groups, names=names, but=but, fix=fix)


def NotWith(option: str, *, groups: tuple[str, ...] = (), names: tuple[str, ...] = (), but: tuple[str, ...] = (),
            unless: tuple[str, ...] = (), fix: str = "drop it") -> Rule:
    """The rows of ``groups`` (and the options ``names``) do nothing with ``option`` given, unless one of ``unless``
    is given too (``cache check --nodes`` reads no launch; ``--cache-dir`` gives the root ``--server-release``
    would pick)."""
    return Rule(with_=(option,), without=unless, groups=groups, names=names, but=but, fix=fix)


def check_rules(call: Call, rules: tuple[Rule, ...]) -> None:
    """Every rule of the command in force: one usage error (exit 2) naming each option given that its mode does not
    read, whatever the number of rules it breaks."""
    problems = [found for rule in rules if (found := rule.problem(call)) is not None]
    if problems:
        hint = problems[0][0]
        raise typer.BadParameter("; ".join(sentence for _, sentence in problems),
                                 param_hint=hint if hint.startswith("-") else None)


class Call:
    """One run of a command, as its body receives it: the run's ``Output``, the ``ServerRequest`` its rows give
    (and which fields its command line gave: they win over a launch), the server's launch."""

    def __init__(self, ctx: typer.Context, out: Output, options: tuple[str, ...], values: dict[str, Any]) -> None:
        self.ctx, self.out, self.options, self._values = ctx, out, options, values  # options: the command's, in order

    def given(self, name: str) -> bool:
        """Whether the command line (or the environment) gave option ``name``, in any of its spellings."""
        return any((source := self.ctx.get_parameter_source(n)) is not None and source.name in _GIVEN
                   for n in (name, _old(name)))

    def spelling(self, name: str) -> str:
        """How the help spells option ``name`` (``--tp-size``; an argument: its metavar, ``MODEL``), or the old
        spelling where the command line gave only that one (``--tp-sizes``)."""
        param = next(p for p in self.ctx.command.params if p.name == name)
        if param.param_type_name == "argument":
            return param.metavar or name.upper()
        source = self.ctx.get_parameter_source(name)
        if (source is None or source.name not in _GIVEN) and self.given(name) and ROWS.get(name) and ROWS[name].old:
            return ROWS[name].old
        if getattr(param, "secondary_opts", None) and self._values.get(name) is False:  # --no-overlap
            return max(param.secondary_opts, key=len)
        return max(param.opts, key=len)

    def _request_rows(self) -> list[Row]:
        return [ROWS[name] for name in self.options if name in ROWS and ROWS[name].field]

    def request(self, **fields: Any) -> ServerRequest:
        """The request the command's rows give; ``fields`` are set by the command itself (``verify``'s mode,
        ``import --against``'s model) and win over its rows."""
        from exl3tool.plan import ServerRequest

        values = {row.field: row.convert(self._values[row.name]) for row in self._request_rows()
                  if row.field not in fields}
        return ServerRequest(**values, **fields)

    @cached_property
    def given_fields(self) -> frozenset[str]:
        """The request fields the command line gave (what wins over a launch in ``apply_launch``)."""
        return frozenset(row.field for row in self._request_rows() if self.given(row.name))

    @cached_property
    def launch(self) -> LaunchInput:
        """The server's launch as the launch rows (and the words after ``--``) give it."""
        from exl3tool.cli.commands.launching import launch_input

        return launch_input(self.ctx, **{name: self._values.get(name) for name in LAUNCH})

    def resolve(self, request: ServerRequest, *, given: Collection[str] = (), **how: Any):
        """``request`` with the launch applied (this command line's fields win, and the fields in ``given``, which
        the command set from its own options: ``import --against``'s model), each setting's source said on stderr:
        ``(request, settings or None, the server's environment or None)`` (``launching.apply_options``). A
        ``--tp-rank`` outside the TP size (which the launch may give) is a usage error."""
        from exl3tool.cli.commands.launching import apply_options

        request, settings, environ = apply_options(self.out, request, self.launch, self.given_fields | set(given),
                                                   **how)
        if request.tp_ranks and not 0 <= request.tp_ranks[0] < request.tp_sizes[0]:
            raise typer.BadParameter(f"--tp-rank {request.tp_ranks[0]} is outside 0..{request.tp_sizes[0] - 1}")
        return request, settings, environ

    def cache_root(self, *, exists: bool = True, no_lookup: str = "say", writes: bool = False) -> Path:
        """The cache a cache command reads or writes (``cache ls`` ... ``cache import``): ``--cache-dir``, else the
        server's root as ``cache warm`` finds it (``ServerRequest.cache_root``): from the launch options (a
        container's volumes, the launch's environment, the release; ``apply_launch``'s ``cache_only``), else this
        process's environment, by ``--server-release``'s rule. Where that root depends on a release nothing named,
        a usage error naming both roots (``operations.release_rules.cache_root``; ``writes``: the import's).
        ``exists``: it must be an existing directory (exit 2 otherwise); ``no_lookup``: a launch whose server reads
        no cache is warned about (``say``) or refused."""
        from exl3tool.operations.release_rules import cache_root

        request = self.request(model="")
        environ = None
        if self.launch.any_given:
            request, _, environ = self.resolve(request, cache_only=True, no_lookup=no_lookup)
        root = cache_root(request, environ, writes=writes,
                          what="where this command writes" if writes else "the cache this command reads",
                          # beside a cache command's launch options --cache-dir is refused: it takes their place
                          cache_dir="--cache-dir DIR" + (" in place of the launch options" if self.launch.any_given else ""))
        return existing_cache_dir(root) if exists else root


def _is_option(parameter: inspect.Parameter) -> bool:
    """A body parameter that declares an option of its own (``Annotated[..., typer.Option(...)]``)."""
    return any(isinstance(m, typer.models.ParameterInfo) for m in getattr(parameter.annotation, "__metadata__", ()))


def command(parent: typer.Typer, name: str, *, groups: tuple[str, ...] = (), without: tuple[str, ...] = (),
            options: tuple[str, ...] = (), rules: tuple[Rule, ...] = ()
            ) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register the decorated body as command ``name`` of ``parent``: the rows of ``groups`` less ``without``, the
    rows named in ``options``, the body's own options (see the module's docstring)."""

    def register(body: Callable[..., None]) -> Callable[..., None]:
        own = inspect.signature(body, eval_str=True).parameters
        mine = [n for n, p in own.items() if _is_option(p)]
        try:
            rows = taken(groups, without, options)
        except ValueError as exc:
            raise TypeError(f"{body.__qualname__}: {exc}") from None
        last = tuple(n for n in rows if ROWS[n].group == "output")  # --progress, --json, --quiet: every command's last
        layout = (*(n for n in rows if n not in last), *mine, *last)
        wrong = sorted(set(mine) & set(ROWS)) + [n for n in own if n not in ("call", "out") and n not in layout]
        wrong += [n for rule in rules for n in (*rule.with_, *rule.without, *rule.names, *rule.but) if n not in layout]
        wrong += [g for rule in rules for g in rule.groups if g not in GROUPS]
        if wrong:  # a typo, an own option named like a row, a parameter no option fills: at registration
            raise TypeError(f"{body.__qualname__}: {wrong}: each option is a row or the body's own, named once; a "
                            "row the body reads is one the command takes")
        params = [inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)]
        for n in layout:
            if n in mine:
                params.append(own[n].replace(kind=inspect.Parameter.KEYWORD_ONLY))
                continue
            row = ROWS[n]
            params.append(inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=row.type,
                                            default=row.default))
            if row.old:  # the old spelling: an option of its own, hidden from the help
                info = typer.Option(row.old, hidden=True, metavar=row.type.__metadata__[0].metavar)
                params.append(inspect.Parameter(_old(n), inspect.Parameter.KEYWORD_ONLY,
                                                annotation=Annotated[Optional[row.type.__origin__], info],
                                                default=None))

        def run(ctx: typer.Context, **values: Any) -> None:
            for n in layout:  # an old spelling's value, where the new one was not given
                if ROWS.get(n) is not None and ROWS[n].old and (old := values.pop(_old(n))) is not None \
                        and ctx.get_parameter_source(n).name not in _GIVEN:
                    values[n] = old
            out = Output(json=values["json"], quiet=values["quiet"], progress=values.get("progress", "auto"))
            if isinstance(ctx.obj, Run):
                ctx.obj.output = out
            call = Call(ctx, out, layout, values)
            check_rules(call, rules)
            handed = {"call": call, "out": out}
            body(**{n: handed[n] if n in handed else values[n] for n in own})

        run.__signature__ = inspect.Signature(params)
        run.rules = rules  # type: ignore[attr-defined]  # the command's modes, for its tests (tests/cli/test_modes.py)
        # what it was built from, for its tests (tests/cli/test_option_groups.py)
        run.declared = {"body": body, "groups": groups, "without": without, "options": options}  # type: ignore[attr-defined]
        run.__doc__, run.__name__, run.__qualname__, run.__module__ = (body.__doc__, body.__name__, body.__qualname__,
                                                                       body.__module__)
        cls = LaunchCommand if any(n in LAUNCH for n in layout) else Exl3Command  # `-- ARGV` is a launch
        parent.command(name, cls=cls)(run)
        return run

    return register

