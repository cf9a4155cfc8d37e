"""`--bits` and `--dtype` on every command that takes them (issue 14): one option type each, checked at parse time.

`--dtype` takes exactly vLLM's serving dtypes (auto, bfloat16, float16, float32); `--bits` is 3..8 and defaults to
the server's VLLM_EXL3_ONLINE_TRELLIS_BITS (then 6). Anything else is a usage error, exit 2, before any work.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from exl3tool.checkpoint.synthetic import write_llama_checkpoint
import exl3tool.cli as cli
from exl3tool.cli import main
from exl3tool.errors import ConfigError
from exl3tool.plan import ServerRequest, prepare

from helpers import ENC, ENC_ARGS, TINY_1

cli._register()
COMMANDS = (["encode"], ["cache", "warm"], ["verify"])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("opts") / "tiny"
    write_llama_checkpoint(path, **TINY_1, seed=2, shards=1)
    return path


@pytest.fixture
def env(monkeypatch, capfd):
    monkeypatch.delenv("VLLM_EXL3_ONLINE_TRELLIS_BITS", raising=False)
    monkeypatch.delenv("VLLM_EXL3_ENCODER_SOURCE", raising=False)
    _capture["fd"] = capfd
    monkeypatch.setattr(cli, "_register", lambda: None)  # main() registers on every call; once (below) is enough
    return monkeypatch


_capture: dict = {}


def invoke(args, **env):
    """``exl3tool ARGS`` in this process through the real entry point, with ``env`` set for the call."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with pytest.raises(SystemExit) as exited:
            main(list(args))
            sys.exit(0)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out, err = _capture["fd"].readouterr()
    code = exited.value.code
    return SimpleNamespace(exit_code=0 if code is None else code, stdout=out, output=out + err)


def plan_bits(model, cache, *extra, **env) -> int:
    res = invoke(["cache", "warm", str(model), "--cache-dir", str(cache), "--dry-run", "--json", *ENC_ARGS, *extra], **env)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["bits"]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("value", ["int8", "nonsense", "fp16", "float64", "bf16"])
def test_dtype_outside_the_serving_dtypes_is_a_usage_error(env, model, tmp_path, command, value):
    """Before: `--dtype int8` published zeros under the real key, `nonsense` failed late with AttributeError."""
    res = invoke([*command, str(model), "--dtype", value, "--cache-dir", str(tmp_path / "c"), "--dry-run", *ENC_ARGS]
                 if command != ["verify"] else
                 [*command, str(model), "--dtype", value, "--cache-dir", str(tmp_path / "c"), *ENC_ARGS])
    assert res.exit_code == 2, res.output
    assert "--dtype" in res.output and "auto, bfloat16, float16, half, float32, float" in res.output
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("spelling,name", [("half", "float16"), ("float", "float32"), ("BFloat16", "bfloat16")])
def test_dtype_spellings_the_server_takes_are_taken_by_every_command_and_the_launch(spelling, name, tmp_path):
    """Issue 44: `--dtype half` was refused by the commands and taken by a launch; one table now (vLLM's ModelDType
    spellings, any case, as the launch reads them)."""
    from exl3tool.cli.commands.options import _dtype
    from exl3tool.launch.load import load_launch
    from exl3tool.launch.resolve import Explicit, resolve_launch

    assert _dtype(spelling) == name
    server, layers = load_launch(argv=("vllm", "serve", str(tmp_path), "--dtype", spelling, "--quantization-config",
                                       '{"linear": "mxfp8"}'), environ={"VLLM_EXL3_ENCODER_SOURCE": "/e"})
    assert resolve_launch(server, layers, Explicit(), need_cache=False).dtype == name


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_names_the_dtypes_and_the_bits_default(env, command):
    res = invoke([*command, "--help"], COLUMNS="250")
    assert res.exit_code == 0
    assert "auto|bfloat16|float16|float32" in res.output
    assert "VLLM_EXL3_ONLINE_TRELLIS_BITS" in res.output and "3 to 8" in res.output


@pytest.mark.parametrize("value", ["auto", "bfloat16", "float16", "float32"])
def test_every_serving_dtype_plans(env, model, tmp_path, value):
    res = invoke(["encode", str(model), "--dtype", value, "--cache-dir", str(tmp_path), "--dry-run", *ENC_ARGS])
    assert res.exit_code == 0, res.output


def test_dtype_meaning_matches_vllm(model):
    """`auto` is the checkpoint's rule (float32 -> bfloat16, in checkpoint code); the others name the cast."""
    from exl3tool.plan import SERVING_DTYPES, serving_torch_dtype

    assert SERVING_DTYPES == ("auto", "bfloat16", "float16", "float32")
    assert serving_torch_dtype("auto") is None and serving_torch_dtype(None) is None
    assert serving_torch_dtype("float32") is torch.float32 and serving_torch_dtype("float16") is torch.float16
    assert serving_torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ConfigError, match="auto, bfloat16, float16, float32"):
        prepare(ServerRequest(model=str(model), dtype="int8", **ENC))


def test_bits_defaults_to_the_servers_variable(env, model, tmp_path):
    """Before: VLLM_EXL3_ONLINE_TRELLIS_BITS was ignored and every key had bits 6 (a silent miss for the server)."""
    assert plan_bits(model, tmp_path) == 6
    assert plan_bits(model, tmp_path, VLLM_EXL3_ONLINE_TRELLIS_BITS="4") == 4
    assert plan_bits(model, tmp_path, VLLM_EXL3_ONLINE_TRELLIS_BITS=" 5 ") == 5  # the server's int() takes spaces
    assert plan_bits(model, tmp_path, VLLM_EXL3_ONLINE_TRELLIS_BITS="  ") == 6  # blank counts as unset
    assert plan_bits(model, tmp_path, "--bits", "8", VLLM_EXL3_ONLINE_TRELLIS_BITS="4") == 8  # the option wins
    res = invoke(["encode", str(model), "--tp-size", "2", "--cache-dir", str(tmp_path), "--dry-run", "--json",
                  *ENC_ARGS], VLLM_EXL3_ONLINE_TRELLIS_BITS="3")
    assert res.exit_code == 0 and json.loads(res.stdout)["bits"] == 3


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("bits", ["2", "1", "9", "0", "-1"])
def test_bits_outside_3_to_8_is_a_usage_error(env, model, tmp_path, command, bits):
    """Before: `--bits 2` passed the option check (1..8) and failed later, or planned keys the server never uses."""
    extra = ["--dry-run"] if command != ["verify"] else []
    res = invoke([*command, str(model), "--bits", bits, "--cache-dir", str(tmp_path / "c"), *extra, *ENC_ARGS])
    assert res.exit_code == 2, res.output
    assert "--bits" in res.output and "3 to 8" in res.output
    assert "ValueError" not in res.output and not (tmp_path / "c").exists()


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("value", ["6.0", "six", "2", "9"])
def test_bad_bits_variable_is_a_usage_error_naming_it(env, model, tmp_path, command, value):
    extra = ["--dry-run"] if command != ["verify"] else []
    res = invoke([*command, str(model), "--cache-dir", str(tmp_path / "c"), *extra, *ENC_ARGS],
                 VLLM_EXL3_ONLINE_TRELLIS_BITS=value)
    assert res.exit_code == 2, res.output
    assert f"VLLM_EXL3_ONLINE_TRELLIS_BITS={value!r}" in res.output and "3 to 8" in res.output
    ok = invoke([*command, str(model), "--bits", "6", "--cache-dir", str(tmp_path / "c"), "--help"],
                VLLM_EXL3_ONLINE_TRELLIS_BITS=value)
    assert ok.exit_code == 0  # --help never trips on it


def test_library_checks_the_same_range(model):
    for bits in (2, 9):
        with pytest.raises(ConfigError, match="from 3 to 8"):
            prepare(ServerRequest(model=str(model), bits=bits, **ENC))
