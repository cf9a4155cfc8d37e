"""One options-to-request builder (issue 37): every command that builds a `ServerRequest` takes its request options
from `options.REQUEST_OPTIONS`, spelled and explained the same everywhere, and fills the request and the set of
fields its command line gave through `options.request_from_options`."""

from __future__ import annotations

import pytest
import typer
from helpers import CliRunner

from exl3tool.cli import _register, app
from exl3tool.cli.commands.options import REQUEST_OPTIONS

_register()
BUILDERS = (("identity",), ("encode",), ("verify",), ("cache", "warm"), ("cache", "check"), ("cache", "import"))


def _command(path: tuple[str, ...]):
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


def test_request_options_have_one_spelling_and_help_in_every_command():
    seen: dict[str, tuple] = {}
    for path in BUILDERS:
        for param in _command(path).params:
            if param.name not in REQUEST_OPTIONS or param.name == "model":  # `cache import`'s MODEL is --against
                continue
            shape = (tuple(param.opts), getattr(param, "help", None), param.metavar, getattr(param, "is_flag", None))
            assert seen.setdefault(param.name, shape) == shape, f"{' '.join(path)} {param.opts}: {shape} != {seen[param.name]}"
    assert {"layers", "exclude", "device", "shared_experts", "tp_size", "tp_sizes"} <= set(seen)


def test_verify_takes_shared_experts_and_builds_its_request_like_encode(monkeypatch, tmp_path):
    """`verify --shared-experts` reaches the request, with the rest of verify's options, as `encode`'s do."""
    import exl3tool.cli.commands.warm as encode_cmd
    import exl3tool.cli.commands.verify as verify_cmd

    seen = []

    class Stop(Exception):
        pass

    def stop(ctx, out, request, launch, pid, env_files, given, **kwargs):
        seen.append((request, given))
        raise Stop

    monkeypatch.setattr(verify_cmd, "apply_options", stop)
    monkeypatch.setattr(encode_cmd, "apply_options", stop)
    args = ["m", "--shared-experts", "--layers", "*.o_proj", "--exclude", "*.q_proj", "--tp-size", "2", "--tp-rank",
            "1", "--device", "cpu", "--bits", "5", "--dtype", "bfloat16", "--cache-dir", str(tmp_path)]
    for command in ("verify", "encode"):
        res = CliRunner().invoke(app, [command, *args])
        assert isinstance(res.exception, Stop), res.output
    (verify, verify_given), (encode, encode_given) = seen
    assert verify.shared_experts and verify.layers == ("*.o_proj",) and verify.exclude == ("*.q_proj",)
    assert (verify.tp_sizes, verify.tp_ranks, verify.device, verify.bits, verify.dtype) == ((2,), (1,), "cpu", 5, "bfloat16")
    assert verify.mode == "readonly" and encode.mode == "readwrite"
    from dataclasses import replace

    assert replace(verify, mode="readwrite") == encode
    assert verify_given == encode_given >= {"model", "shared_experts", "layers", "tp_sizes", "tp_ranks", "bits"}
    assert "encoder_root" not in verify_given  # not given: the launch may set it


@pytest.mark.parametrize("path", BUILDERS, ids=" ".join)
def test_every_request_option_of_a_command_is_in_the_table(path):
    """A command's options that name a request field go through the table (none is filled by hand)."""
    from exl3tool.plan import ServerRequest

    fields = {f for f in ServerRequest.__dataclass_fields__}
    for param in _command(path).params:
        target = REQUEST_OPTIONS.get(param.name, (None,))[0]
        assert target is None or target in fields
        assert param.name not in fields or param.name in REQUEST_OPTIONS, param.name


@pytest.mark.parametrize("spelling", ["--tp-size", "-tp", "--tp-sizes"])
@pytest.mark.parametrize("path", [("cache", "warm"), ("cache", "check"), ("encode",), ("verify",)], ids=" ".join)
def test_tp_size_has_one_spelling_and_the_old_one_still_works(monkeypatch, path, spelling):
    """`--tp-size` (and vLLM's `-tp`) in every command; `--tp-sizes`, the old spelling of warm/check, is a hidden
    alias for one release (CHANGELOG.md): the same request from each."""
    seen = []

    class Stop(Exception):
        pass

    def stop(ctx, out, request, *args, **kwargs):
        seen.append(request)
        raise Stop

    for module in ("warm", "check", "verify"):
        monkeypatch.setattr(f"exl3tool.cli.commands.{module}.apply_options", stop)
    res = CliRunner().invoke(app, [*path, "m", spelling, "2", "--cache-dir", "/nonexistent"])
    if spelling == "--tp-sizes" and path in (("encode",), ("verify",)):  # never a spelling of theirs
        assert res.exit_code == 2 and "No such option: --tp-sizes" in res.output
        return
    assert isinstance(res.exception, Stop), res.output
    assert seen[0].tp_sizes == (2,)


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
