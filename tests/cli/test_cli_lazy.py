"""The CLI's face: `--help`/`--version` import no command (nor torch, nor rich), the root's lazy list agrees with
the commands' own help, and every help page fits 80 (and 120) columns without cutting an option name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from helpers import CliRunner

from exl3tool.cli import COMMANDS, _register, app
from exl3tool.cli.commands.options import HIDDEN_ALIASES

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy", "rich", "safetensors", "exl3tool.cache", "exl3tool.operations.warm", "exl3tool.cli.output")


_PROBE = """
import json, sys
from exl3tool.cli import main
code = 0
try:
    main(sys.argv[2:])
except SystemExit as exc:
    code = exc.code or 0
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""


def _imports(tmp_path, *argv: str) -> tuple[str, set[str]]:
    """``exl3tool ARGV`` as the console script runs it, in a fresh interpreter: its stdout and every module loaded."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    report = tmp_path / "modules.json"
    out = subprocess.run([sys.executable, "-c", _PROBE, str(report), *argv], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=120)
    result = json.loads(report.read_text())
    assert result["code"] == 0, out.stderr[-2000:]
    return out.stdout, set(result["modules"])


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []])
def test_help_and_version_import_no_command(tmp_path, argv):
    stdout, modules = _imports(tmp_path, *argv)
    assert "exl3tool" in stdout
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY or any(m.startswith(h + ".") or m == h
                                                                              for h in HEAVY))
    commands = sorted(m for m in modules if m.startswith("exl3tool.cli.commands.") and m != "exl3tool.cli.commands.group")
    assert not heavy and not commands, (heavy, commands)


# Every help page and every wrong command, each as a user types it; HELP_PROBE runs them in one interpreter.
HELP_ARGVS = [["cache", "--help"], ["cache", "warm", "--help"], ["cache", "check", "-h"], ["cache", "ls", "--help"],
              ["cache", "show", "-h"], ["cache", "verify", "--help"], ["cache", "prune", "--help"],
              ["cache", "export", "--help"], ["cache", "import", "--help"], ["encode", "--help"], ["verify", "-h"],
              ["identity", "--help"], ["synth", "--help"], ["encoder-source", "--help"], ["cache"],
              ["check", "--help"], ["cache", "warmm"], ["encdoe"], ["cache", "warm", "--tp-sizez", "2"]]
FORBIDDEN = ("torch", "numpy", "numba", "safetensors", "triton", "huggingface_hub", "rich.console", "rich.table",
             "rich.progress")
HELP_PROBE = """
import json, sys, time
from exl3tool.cli import main
codes, seconds = [], []
for argv in json.loads(sys.argv[2]):
    start = time.perf_counter()
    try:
        main(argv)
        codes.append(0)
    except SystemExit as exc:
        codes.append(exc.code or 0)
    seconds.append(time.perf_counter() - start)
with open(sys.argv[1], "w") as f:
    json.dump({"codes": codes, "seconds": seconds, "modules": sorted(sys.modules),
               "rss_mib": next(int(line.split()[1]) for line in open("/proc/self/status")  # peak since exec
                               if line.startswith("VmHWM:")) / 1024}, f)
"""


def test_no_help_page_nor_wrong_command_imports_torch_numpy_or_numba(tmp_path):
    """Each help page (and a mistyped command's error) imports no torch, numpy, numba, safetensors or the Hub, and
    answers with exit 0 (help) or 2 (usage) in well under 60 MiB, even with a knob set to a value it refuses."""
    report = tmp_path / "modules.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80", "EXL3TOOL_VITERBI_MODE": "9"}
    out = subprocess.run([sys.executable, "-c", HELP_PROBE, str(report), json.dumps(HELP_ARGVS)], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=120)
    result = json.loads(report.read_text())
    expected = [2 if argv[-1] in ("warmm", "encdoe", "2") or argv == ["check", "--help"] else 0 for argv in HELP_ARGVS]
    assert result["codes"] == expected, out.stderr[-3000:]
    assert "No such command 'warmm'" in out.stderr and "No such option: --tp-sizez" in out.stderr
    loaded = sorted(m for m in result["modules"] if m.split(".")[0] in FORBIDDEN or m in FORBIDDEN)
    assert not loaded, loaded
    assert result["rss_mib"] < 60, result["rss_mib"]
    commands = {m for m in result["modules"] if m.startswith("exl3tool.cli.commands.")}
    assert "exl3tool.cli.commands.cache" in commands  # the pages really were the commands' own


def _root():
    _register()
    return typer.main.get_command(app)


def test_the_lazy_list_is_the_commands_own_first_sentence_in_order():
    root = _root()
    listed = [name for name, command in root.commands.items() if not command.hidden]
    assert listed == [name for name, _ in COMMANDS]
    for name, summary in COMMANDS:
        assert root.commands[name].get_short_help_str(limit=10**6) == summary, name


def test_lazy_root_help_is_the_full_root_help():
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    run = [sys.executable, "-c", "import sys; from exl3tool.cli import _register, main; "
           "sys.argv[1:2] == ['full'] and _register(); main(['--help'])"]
    lazy, full = (subprocess.run(run + [mode], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
                  for mode in ("lazy", "full"))
    assert lazy.returncode == full.returncode == 0 and "Commands:" in lazy.stdout
    assert lazy.stdout == full.stdout


def _commands(group, path=()):
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield path + (name,), command
            yield from _commands(command, path + (name,))
        else:
            yield path + (name,), command


_register()
PAGES = [((), typer.main.get_command(app))] + list(_commands(typer.main.get_command(app)))


@pytest.mark.parametrize("columns", [60, 80, 120])
@pytest.mark.parametrize("path,command", PAGES, ids=[" ".join(p) or "root" for p, _ in PAGES])
def test_every_help_page_fits_and_names_every_option_whole(path, command, columns):
    # terminal_width: Typer's runner forces 80 columns otherwise (typer.testing sets FORCED_WIDTH)
    res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(columns)}, prog_name="exl3tool",
                             terminal_width=columns)
    assert res.exit_code == 0, res.output
    text = res.stdout
    assert "…" not in text
    too_long = [line for line in text.splitlines() if len(line) > columns]
    assert not too_long, too_long
    wide = CliRunner().invoke(app, [*path, "--help"], prog_name="exl3tool", terminal_width=100000).stdout
    split = set(re.findall(r"\S+", wide)) - set(re.findall(r"\S+", text))  # a word wrapped in two, or at a hyphen
    assert not split, split
    words = set(re.findall(r"(?<![\w-])-{1,2}[\w-]+", text))
    for param in command.params:
        for name in (*param.opts, *param.secondary_opts):
            if name in HIDDEN_ALIASES:  # an old spelling: accepted, never shown (its new one is)
                assert name not in words and HIDDEN_ALIASES[name] in words, (name, text)
            elif getattr(param, "hidden", False):  # an option that does nothing, accepted with a warning: never shown
                assert name not in words, (name, text)
            elif name.startswith("-"):
                assert name in words, (name, text)
