"""A launch line read as the shell and the fork's parser read it: every launch form, every flag spelling."""

from __future__ import annotations

import json

import pytest

from exl3tool.errors import ConfigError
from exl3tool.launch import launch_from_words, load_launch
from exl3tool.launch.parse import find_server, parse_server_args, split_commands

OVERLAY = '{"linear": {"weight": "mxfp8"}, "ignore": ["lm_head"]}'


def serve(*args: str, **kw):
    return parse_server_args(list(args), entry="vllm serve", serve=True, **kw)


def test_split_commands_shell_rules():
    text = ("export A=1\ncd /srv && setsid ./launcher \\\n  vllm serve /m --quantization-config "
            f"'{OVERLAY}' # a comment\necho done")
    assert split_commands(text) == [["export", "A=1"], ["cd", "/srv"],
                                    ["setsid", "./launcher", "vllm", "serve", "/m", "--quantization-config", OVERLAY],
                                    ["echo", "done"]]
    with pytest.raises(ConfigError, match="shell rules"):
        split_commands("vllm serve '/m")


@pytest.mark.parametrize("words, kind, index, prefix", [
    (["vllm", "serve", "/m"], "vllm", 2, ()),
    (["/usr/local/bin/vllm", "serve", "/m"], "vllm", 2, ()),
    (["setsid", "./launcher", "vllm", "serve", "/m"], "vllm", 4, ("setsid", "./launcher")),
    (["env", "A=1", "B=2", "vllm", "serve", "/m"], "vllm", 5, ("env", "A=1", "B=2")),
    (["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"], "api_server", 3, ()),
    (["python3.12", "-u", "-m", "vllm.entrypoints.cli.main", "serve", "/m"], "vllm", 5, ()),
    (["/usr/bin/python3", "/usr/local/bin/vllm", "serve", "/m"], "vllm", 3, ()),  # a console script in /proc
    (["sudo", "docker", "run", "--rm", "img"], "docker", 3, ("sudo",)),
    (["podman", "--remote", "run", "img"], "podman", 3, ()),
])
def test_find_server_forms(words, kind, index, prefix):
    start = find_server(words)
    assert (start.kind, start.index, start.prefix) == (kind, index, prefix)


def test_find_server_inside_a_shell_string_and_none():
    start = find_server(["bash", "-lc", "cd /x && A=1 vllm serve /m -tp 2"])
    assert start is None or start.kind == "vllm"
    start = find_server(["bash", "-c", "cd / && A=1 vllm serve /m -tp 2"])  # run by bash: cd / must succeed
    assert start.kind == "vllm" and ("A", "1") in [(n, v) for n, v, _ in start.exports]
    assert find_server(["python3", "train.py", "--serve"]) is None


def test_model_positional_or_model_flag_and_values():
    args = serve("/models/M", "-tp", "2", "--dtype=bfloat16", "--revision", "abc", "--port", "8000")
    assert args.values["model"] == ("/models/M", "positional")
    assert args.values["tp_size"] == ("2", "-tp") and args.values["dtype"] == ("bfloat16", "--dtype")
    assert args.values["revision"] == ("abc", "--revision")
    assert args.ignored == ("--port 8000",)
    args = serve("--tensor-parallel-size", "4", "--model", "org/name")
    assert args.values["model"] == ("org/name", "--model") and args.values["tp_size"][0] == "4"
    with pytest.raises(ConfigError, match="model twice"):
        serve("/a", "--model", "/b")


def test_spellings_the_fork_accepts():
    # underscores, a unique prefix, --no-X of a boolean, -O3, the last value wins (argparse)
    args = serve("/m", "--tensor_parallel_size=2", "--tensor-parallel", "8", "--no-enable-prefix-caching", "-O3",
                 "--enforce-eager", "--dtype", "half", "--dtype", "float16")
    assert args.values["tp_size"] == ("8", "--tensor-parallel")
    assert args.values["dtype"] == ("float16", "--dtype")
    assert "--no-enable-prefix-caching" in args.ignored and "--enforce-eager" in args.ignored
    assert "--optimization-level 3" in args.ignored


def test_a_boolean_before_the_model_does_not_swallow_it():
    args = serve("--enforce-eager", "--trust-remote-code", "/models/M", "--language-model-only")
    assert args.values["model"][0] == "/models/M"
    assert args.values["language_model_only"] == ("true", "--language-model-only")
    assert any(i.startswith("--trust-remote-code") for i in args.ignored)


def test_dotted_flags_are_json_appended_last():
    args = serve("/m", "-cc.pass_config.fuse_allreduce_rms=True", "--quantization-config", OVERLAY,
                 "--quantization-config.linear.weight", "mxfp8", "--quantization-config.ignore+", "lm_head,re:.*x$")
    # the fork appends dotted dicts after every other flag: they replace the plain JSON wholesale
    assert json.loads(args.values["quantization_config"][0]) == {"linear": {"weight": "mxfp8"},
                                                                 "ignore": ["lm_head", "re:.*x$"]}
    assert any(i.startswith("--compilation-config.*") for i in args.ignored)


def test_speculative_and_parallel_flags_are_read():
    args = serve("/m", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}', "-pp", "2",
                 "-dcp", "2", "--data-parallel-size", "2", "--load-format", "instanttensor", "--trust-remote-code")
    assert json.loads(args.values["speculative_config"][0])["method"] == "mtp"
    assert args.values["pipeline_parallel_size"] == ("2", "-pp")
    assert args.values["load_format"] == ("instanttensor", "--load-format")
    assert any(i.startswith("-dcp 2 (decode context") for i in args.ignored)


def test_refused_and_unknown_flags_are_listed():
    args = serve("/m", "--hf-config-path", "/cfg", "--made-up-flag", "x", "--other")
    assert args.refused[0][0] == "--hf-config-path" and "config" in args.refused[0][1]
    assert args.unknown == ("--made-up-flag x", "--other")
    assert args.values["model"][0] == "/m"


def test_config_yaml_between_the_model_and_the_command_line(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: /from/yaml\ntensor-parallel-size: 4\ndtype: float16\nenforce-eager: true\n"
                   "quantization-config:\n  linear: mxfp8\n")
    args = serve("--config", str(cfg), "-tp", "2")  # the command line wins over the file
    assert args.values["tp_size"] == ("2", "-tp")
    assert args.values["model"][0] == "/from/yaml" and "--config" in args.values["model"][1]
    assert json.loads(args.values["quantization_config"][0]) == {"linear": "mxfp8"}
    args = serve("/positional", "--config", str(cfg))  # a positional model wins over the file's
    assert args.values["model"] == ("/positional", "positional")
    bad = tmp_path / "serve.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="yaml"):
        serve("/m", "--config", str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        serve("/m", "--config", str(tmp_path / "missing.yaml"))


def test_api_server_takes_model_flag_only():
    words = ["python", "-m", "vllm.entrypoints.openai.api_server", "/ignored", "--model", "/m", "-tp", "2"]
    launch = launch_from_words(words)
    assert launch.args.values["model"] == ("/m", "--model")
    assert any("/ignored" in i for i in launch.args.ignored)


def test_launch_text_with_exports_and_env():
    launch, layers = load_launch(text="export VLLM_EXL3_ONLINE_TRELLIS_BITS=5\nenv VLLM_EXL3_ENCODER_SOURCE=/e "
                                      "setsid ./run vllm serve /m", environ={})
    assert layers.get("VLLM_EXL3_ONLINE_TRELLIS_BITS").value == "5"
    assert layers.get("VLLM_EXL3_ENCODER_SOURCE").value == "/e"
    assert any("setsid ./run" in i for i in launch.ignored)
    with pytest.raises(ConfigError, match="no vllm server"):
        load_launch(text="echo hello", environ={})
    with pytest.raises(ConfigError, match="one launch"):
        load_launch(text="vllm serve /m", pid=1, environ={})
