"""Each option declared once (issues 37 and 51): every command that builds a `ServerRequest` takes its request
options from the rows of `options.ROWS`, spelled and explained the same everywhere, and its body gets the request
they give (`command.Call`), with the set of fields its command line gave."""

from __future__ import annotations

import pytest
import typer
from helpers import CliRunner

from exl3tool.cli import _register, app
from exl3tool.cli.commands.options import ROWS

_register()
BUILDERS = (("identity",), ("encode",), ("verify",), ("cache", "warm"), ("cache", "check"), ("cache", "import"),
            ("hydrate",))


def _command(path: tuple[str, ...]):
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


class Stop(Exception):
    pass


@pytest.fixture
def requests(monkeypatch):
    """The (request, given fields) each command hands to the launch resolution (``exl3tool.launch.apply_launch``),
    which then stops the command."""
    seen = []

    def stop(request, given, *args, **kwargs):
        seen.append((request, given))
        raise Stop

    monkeypatch.setattr("exl3tool.launch.apply_launch", stop)
    return seen


def test_request_options_have_one_spelling_and_help_in_every_command():
    seen: dict[str, tuple] = {}
    for path in BUILDERS:
        for param in _command(path).params:
            if param.name not in ROWS:
                continue
            shape = (tuple(param.opts), getattr(param, "help", None), param.metavar, getattr(param, "is_flag", None))
            assert seen.setdefault(param.name, shape) == shape, f"{' '.join(path)} {param.opts}: {shape} != {seen[param.name]}"
    assert {"layers", "exclude", "device", "shared_experts", "tp_size", "tp_sizes"} <= set(seen)


def test_verify_takes_shared_experts_and_builds_its_request_like_encode(requests, tmp_path):
    """`verify --shared-experts` reaches the request, with the rest of verify's options, as `encode`'s do."""
    args = ["m", "--shared-experts", "--layers", "*.o_proj", "--exclude", "*.q_proj", "--tp-size", "2", "--tp-rank",
            "1", "--device", "cpu", "--bits", "5", "--dtype", "bfloat16", "--cache-dir", str(tmp_path)]
    for command in ("verify", "encode"):
        res = CliRunner().invoke(app, [command, *args])
        assert isinstance(res.exception, Stop), res.output
    (verify, verify_given), (encode, encode_given) = requests
    assert verify.shared_experts and verify.layers == ("*.o_proj",) and verify.exclude == ("*.q_proj",)
    assert (verify.tp_sizes, verify.tp_ranks, verify.device, verify.bits, verify.dtype) == ((2,), (1,), "cpu", 5, "bfloat16")
    assert verify.mode == "readonly" and encode.mode == "readwrite"
    from dataclasses import replace

    assert replace(verify, mode="readwrite") == encode
    assert verify_given == encode_given >= {"model", "shared_experts", "layers", "tp_sizes", "tp_ranks", "bits"}
    assert "encoder_root" not in verify_given  # not given: the launch may set it


@pytest.mark.parametrize("path", BUILDERS, ids=" ".join)
def test_every_request_option_of_a_command_is_a_row(path):
    """A command's options that set a request field are rows of the table (none is filled by hand)."""
    from exl3tool.plan import ServerRequest

    fields = set(ServerRequest.__dataclass_fields__)
    for param in _command(path).params:
        row = ROWS.get(param.name)
        assert row is None or row.field is None or row.field in fields
        assert param.name not in fields or row is not None, param.name


def test_every_body_reads_every_parameter_it_declares():
    """No command body declares a parameter it does not read (issue 51: 116 did, so that Typer built the options;
    the rows build them now): the project's own check, over the command modules' functions."""
    import ast
    from pathlib import Path

    unread, bodies = [], 0
    for path in sorted((Path(__file__).resolve().parents[2] / "exl3tool" / "cli" / "commands").glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            params = fn.args.args + fn.args.kwonlyargs if isinstance(fn, ast.FunctionDef) else []
            options = [p for p in params if p.annotation is not None and "Annotated" in ast.unparse(p.annotation)]
            if len(options) >= 2 or (params and params[0].arg in ("call", "out")):  # a command's body
                bodies += params[0].arg in ("call", "out")
                used = {x.id for x in ast.walk(fn) if isinstance(x, ast.Name)}
                unread += [f"{path.stem}.{fn.name}({p.arg})" for p in params if p.arg not in used]
    assert not unread, unread
    assert bodies >= 14  # every command's body was looked at


@pytest.mark.parametrize("given", [["--bits", "5"], ["--exact"], ["--dtype", "half"], ["--device", "cpu"],
                                   ["--revision", "main"], ["--layers", "*.q_proj"]])
def test_import_refuses_the_options_of_against_without_it(tmp_path, given):
    """`cache import`'s model, plan and encoder options only apply with `--against MODEL`: one rule on their groups
    (no hand list, which had let `--bits` through unread), a usage error naming the option, nothing imported."""
    res = CliRunner().invoke(app, ["cache", "import", str(tmp_path / "b.tar"), "--cache-dir", str(tmp_path / "c"),
                                   *given])
    assert res.exit_code == 2, res.output
    said = " ".join(res.output.split())  # one error line (tests/cli/test_modes.py), wrapped by the terminal's width
    assert f"{given[0]} does nothing without --against" in said and "give --against MODEL" in said
    assert not (tmp_path / "c").exists()


def test_import_against_builds_its_request_from_the_rows(monkeypatch, tmp_path):
    """`cache import --against M --bits 5 --server-release NAME`: the model is --against's, the cache the import's,
    and every row the import takes reaches the request (`--bits` and `--server-release` were left out before)."""
    seen = []

    def stop(request, exact=False, environ=None):
        seen.append((request, exact))
        assert environ is None  # no launch: this process's environment, as before
        raise Stop

    monkeypatch.setattr("exl3tool.operations.against.AgainstModel.from_request", stop)
    from exl3tool.releases import NEWEST

    res = CliRunner().invoke(app, ["cache", "import", str(tmp_path / "b.tar"), "--cache-dir", str(tmp_path / "c"),
                                   "--against", "m", "--exact", "--bits", "5", "--dtype", "half", "--server-release",
                                   NEWEST, "--file-mode", "0644"])
    assert isinstance(res.exception, Stop), res.output
    [(request, exact)] = seen
    assert (request.model, request.cache_dir, request.bits, request.dtype, exact) == ("m", str(tmp_path / "c"), 5,
                                                                                      "float16", True)
    # the request carries the resolved release (issue 49): the one named, not the default that happens to be the same
    assert (request.release_choice.name, request.release_choice.source) == (NEWEST, "--server-release")
    assert request.file_mode == 0o644


@pytest.mark.parametrize("spelling", ["--tp-size", "-tp", "--tp-sizes"])
@pytest.mark.parametrize("path", [("cache", "warm"), ("cache", "check"), ("encode",), ("verify",)], ids=" ".join)
def test_tp_size_has_one_spelling_and_the_old_one_still_works(requests, path, spelling):
    """`--tp-size` (and vLLM's `-tp`) in every command; `--tp-sizes`, the old spelling of warm/check, is a hidden
    alias for one release (CHANGELOG.md): the same request from each."""
    res = CliRunner().invoke(app, [*path, "m", spelling, "2", "--cache-dir", "/nonexistent"])
    if spelling == "--tp-sizes" and path in (("encode",), ("verify",)):  # never a spelling of theirs
        assert res.exit_code == 2 and "No such option: --tp-sizes" in res.output
        return
    assert isinstance(res.exception, Stop), res.output
    [(request, given)] = requests
    assert request.tp_sizes == (2,) and "tp_sizes" in given


def test_shell_completion_completes_commands_and_options(tmp_path):
    """`--install-completion`/`--show-completion` are there, and the completion itself answers (bash's protocol)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "_EXL3TOOL_COMPLETE": "complete_bash"}

    def complete(words: str) -> list[str]:
        cword = str(len(words.split()) - 1)
        out = subprocess.run([sys.executable, "-m", "exl3tool"], env={**env, "COMP_WORDS": words, "COMP_CWORD": cword},
                             capture_output=True, text=True, timeout=60, cwd=repo)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert complete("exl3tool enc") == ["encode", "encoder-source"]
    assert complete("exl3tool cache w") == ["warm"]
    assert "--tp-size" in complete("exl3tool cache warm --tp")
    # The shell named, not detected: detection reads the parent processes, which under nohup or a CI runner need not
    # be a shell ("Shell  not supported."); Typer's own switch for this makes --show-completion take the name.
    script = subprocess.run([sys.executable, "-m", "exl3tool", "--show-completion", "bash"], capture_output=True,
                            text=True, timeout=60, cwd=repo,
                            env={**os.environ, "PYTHONPATH": str(repo), "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert script.returncode == 0 and "_EXL3TOOL_COMPLETE=complete_bash" in script.stdout
