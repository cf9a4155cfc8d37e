"""A command names the groups of options it takes (issue 51, goal 1): adding a row to a group is one row in
`options.ROWS`, and it reaches every command that takes the group, with nothing else edited.

Each command of the app is registered again, from what it was declared with (``command.command``'s groups,
``without`` and ``options``), on a fresh app while the table holds one more row in one group: the new option is in
the help of exactly the commands that take that group. The help lists the rows in the table's order, then the
command's own options, then the output rows.
"""

from __future__ import annotations

from typing import Annotated, Optional

import pytest
import typer
from helpers import CliRunner

from exl3tool.cli import _register, app
from exl3tool.cli.commands.command import command
from exl3tool.cli.commands.group import Exl3Group
from exl3tool.cli.commands.options import GROUPS, ROWS, Row

_register()


def _commands() -> dict[str, typer.core.TyperCommand]:
    """Every command of the app by its path (``cache warm``)."""
    found = {}

    def walk(group, path):
        for name, cmd in group.commands.items():
            if hasattr(cmd, "commands"):
                walk(cmd, [*path, name])
            else:
                found[" ".join([*path, name])] = cmd

    walk(typer.main.get_command(app), [])
    return found


COMMANDS = _commands()


def _declared(cmd) -> dict:
    return cmd.callback.declared


def _options(cmd) -> list[str]:
    return [p.name for p in cmd.params if not p.name.endswith("_old")]  # an old spelling: its row's hidden twin


def test_every_command_is_declared_by_its_groups():
    assert COMMANDS and all("groups" in _declared(c) for c in COMMANDS.values())
    assert {g for c in COMMANDS.values() for g in _declared(c)["groups"]} == set(GROUPS) - {"output"}


@pytest.mark.parametrize("path", list(COMMANDS))
def test_a_command_takes_its_groups_rows_less_its_exceptions_in_the_tables_order(path):
    """Its options are every row of its groups (and of `output`) not taken only by name, less `without`, plus the
    rows it names (a variant in the place of the row it replaces); in help order the rows come in the table's
    order, then the command's own options, then the output rows."""
    cmd, d = COMMANDS[path], _declared(COMMANDS[path])
    groups = (*d["groups"], "output")
    want = {n for n, r in ROWS.items() if r.group in groups and not r.by_name} - set(d["without"])
    want = (want | set(d["options"])) - {ROWS[n].instead for n in d["options"]}
    names = _options(cmd)
    rows = [n for n in names if n in ROWS]
    assert set(rows) == want
    order = list(ROWS)
    last = [n for n in rows if ROWS[n].group == "output"]
    first = [n for n in rows if n not in last]
    own = [n for n in names if n not in ROWS]
    assert first == sorted(first, key=order.index) and last == sorted(last, key=order.index)
    assert names == [*first, *own, *last]
    spellings = [o for p in cmd.params for o in p.opts if o.startswith("-")]
    assert len(spellings) == len(set(spellings)), path  # one --tp-size: a variant replaces its row


@pytest.mark.parametrize("group", GROUPS)
def test_a_row_added_to_a_group_reaches_every_command_that_takes_it(group, monkeypatch):
    probe = Row("probe", Annotated[Optional[str], typer.Option("--probe-row", metavar="TEXT",
                                                                help="A row added to the group.")], None, group)
    monkeypatch.setitem(ROWS, "probe", probe)
    fresh = typer.Typer(cls=Exl3Group, rich_markup_mode=None)  # the app's help layout
    for path, cmd in COMMANDS.items():
        d = _declared(cmd)
        command(fresh, path.replace(" ", "-"), groups=d["groups"], without=d["without"], options=d["options"],
                rules=cmd.callback.rules)(d["body"])
    rebuilt = typer.main.get_command(fresh).commands
    takers = {path for path, cmd in COMMANDS.items() if group == "output" or group in _declared(cmd)["groups"]}
    assert takers, group
    for path in COMMANDS:
        cmd = rebuilt[path.replace(" ", "-")]
        assert ("probe" in _options(cmd)) == (path in takers), path
        if path in takers:  # in its help, after the group's other rows
            res = CliRunner().invoke(fresh, [path.replace(" ", "-"), "--help"], env={"COLUMNS": "80"})
            assert res.exit_code == 0 and "--probe-row TEXT" in res.stdout, res.output
        else:
            assert _options(cmd) == _options(COMMANDS[path])  # nothing else changed


@pytest.mark.parametrize("declared, wrong", [
    (dict(groups=("plans",)), "plans"),
    (dict(groups=("plan",), without=("cache_dir",)), "cache_dir"),  # not a row of its groups
    (dict(groups=("plan",), options=("bits",)), "bits"),  # its group gives it already
    (dict(groups=("plan",), options=("no_such_row",)), "no_such_row"),
])
def test_a_wrong_declaration_fails_at_registration_naming_it(declared, wrong):
    def body(call) -> None:
        """A body."""

    with pytest.raises(TypeError, match=wrong):
        command(typer.Typer(), "x", **declared)(body)
