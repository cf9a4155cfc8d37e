"""Precedence (exl3tool's flags, the launch's own environment, --env-file, the process environment, defaults), the
source recorded for every setting, what was defaulted, and the refusals (one line, exit 2, naming the flag)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.errors import ConfigError
from exl3tool.launch import Explicit, LaunchInput, apply_launch, load_launch, resolve_launch
from exl3tool.plan import ServerRequest
from helpers import BOTH, LINEAR as QC, TINY_1 as TINY



@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_llama_checkpoint(tmp_path_factory.mktemp("m") / "M", **TINY))


def resolved(text, *, env_files=(), environ=None, explicit=Explicit()):
    launch, layers = load_launch(text=text, env_files=env_files, environ=environ or {})
    return resolve_launch(launch, layers, explicit)


def test_each_layer_in_order(model, tmp_path):
    f1, f2 = tmp_path / "one.env", tmp_path / "two.env"
    f1.write_text("VLLM_EXL3_ONLINE_TRELLIS_BITS=3\nVLLM_EXL3_ENCODER_REVISION=from-file-1\nVLLM_EXL3_ENCODER_SOURCE=/f\n")
    f2.write_text("VLLM_EXL3_ENCODER_REVISION=from-file-2\n")
    process = {"VLLM_EXL3_ONLINE_TRELLIS_BITS": "8", "VLLM_EXL3_ENCODER_SOURCE": "/process",
               "VLLM_EXL3_ENCODER_REVISION": "from-process", "VLLM_EXL3_ONLINE_CACHE_DIR": str(tmp_path / "pc"),
               "VLLM_EXL3_ONLINE_CACHE_MODE": "readonly"}
    text = (f"env VLLM_EXL3_ONLINE_TRELLIS_BITS=5 vllm serve {model} -tp 2 --quantization-config '{QC}'")
    s = resolved(text, env_files=[str(f1), str(f2)], environ=process)
    got = {k: (v.value, v.source) for k, v in s.settings.items()}
    assert got["bits"] == (5, "launch env")  # the launch's own env beats the env files and the process
    assert got["encoder_revision"] == ("from-file-2", "env file")  # later --env-file wins over earlier
    assert got["encoder_root"] == ("/f", "env file")  # env file beats the process
    assert got["cache_dir"] == (str(tmp_path / "pc"), "process env")  # only the process names it
    assert got["cache_mode"] == ("readonly", "process env")
    assert got["tp_size"] == (2, "launch argument") and got["quantization_config"] == (QC, "launch argument")
    assert s.settings["encoder_revision"].detail.startswith(f"VLLM_EXL3_ENCODER_REVISION ({f2}:1")
    # exl3tool's own flags beat everything
    s = resolved(text, env_files=[str(f1)], environ=process,
                 explicit=Explicit(bits=6, encoder_root="/flag", encoder_revision="flag-rev", cache_dir="/x",
                                   quantization_config=BOTH))
    got = {k: (v.value, v.source) for k, v in s.settings.items()}
    assert got["bits"] == (6, "flag") and got["encoder_root"] == ("/flag", "flag")
    assert got["encoder_revision"] == ("flag-rev", "flag") and got["cache_dir_here"] == ("/x", "flag")
    assert s.quantization_config == BOTH


def test_defaulted_settings_say_so_and_how_to_pass_them(model):
    s = resolved(f"vllm serve {model}", environ={"VLLM_EXL3_ENCODER_SOURCE": "/e", "HOME": "/home/u"})
    assert s.settings["bits"].source == "default" and s.bits == 6
    assert s.settings["tp_size"].value == 1 and s.settings["tp_size"].source == "default"
    text = " ".join(s.defaulted)
    assert "VLLM_EXL3_ONLINE_TRELLIS_BITS was not given" in text and "--env-file" in text and "--pid" in text
    assert "VLLM_EXL3_ENCODER_REVISION was not given" in text
    assert s.cache_dir == "/home/u/.cache/vllm/exl3_online"
    # that launch makes no look-up at all, for two reasons, each enough alone
    assert not s.server_lookup and len(s.lookup_off) == 2
    assert "VLLM_EXL3_ONLINE_TRELLIS_BITS is not set" in s.lookup_off[1] and "no --quantization-config" in s.lookup_off[0]
    # a launch that encodes online needs the encoder: refused without it
    with pytest.raises(ConfigError, match="VLLM_EXL3_ENCODER_SOURCE was not given.*--env-file"):
        resolved(f"VLLM_EXL3_ONLINE_TRELLIS_BITS=6 vllm serve {model} --quantization-config '{QC}'",
                 environ={"HOME": "/h"})
    # one that does not only says so (the encoder error is a warning beside the reasons)
    s = resolved(f"vllm serve {model} --quantization-config '{QC}'", environ={"HOME": "/h"})
    assert s.lookup_off and s.encoder_root == "" and any("VLLM_EXL3_ENCODER_SOURCE" in w for w in s.warnings)


def test_cache_root_rules_of_the_server(model):
    base = {"VLLM_EXL3_ENCODER_SOURCE": "/e", "VLLM_EXL3_ENCODER_REVISION": "r", "HOME": "/h"}
    assert resolved(f"vllm serve {model}", environ={**base, "XDG_CACHE_HOME": "/x"}).cache_dir == "/x/vllm/exl3_online"
    assert resolved(f"vllm serve {model}", environ={**base, "VLLM_CACHE_ROOT": "/v",
                                                     "XDG_CACHE_HOME": "/x"}).cache_dir == "/v/exl3_online"
    assert resolved(f"VLLM_EXL3_ONLINE_CACHE_DIR='~/c' vllm serve {model}", environ=base).cache_dir == "/h/c"
    s = resolved(f"VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ONLINE_CACHE_MODE=off vllm serve {model} "
                 f"--quantization-config '{QC}'", environ=base)
    assert len(s.lookup_off) == 1 and "CACHE_MODE=off" in s.lookup_off[0] and "never reads the cache" in s.lookup_off[0]


def test_container_environment_and_paths(model, tmp_path):
    envfile = tmp_path / "image.env"
    envfile.write_text("VLLM_EXL3_ENCODER_SOURCE=/opt/exllamav3\nVLLM_EXL3_ENCODER_REVISION=v0.0.18\n")
    text = (f"docker run --gpus all -v {model}:/models/M:ro -v {tmp_path}/cache:/cache/exl3-online "
            f"-e VLLM_EXL3_ONLINE_CACHE_DIR=/cache/exl3-online -e VLLM_EXL3_ONLINE_TRELLIS_BITS=6 IMAGE "
            f"vllm serve /models/M --tensor-parallel-size 2 --quantization-config '{QC}' --dtype half")
    s = resolved(text, env_files=[str(envfile)], environ={"HOME": "/host-home"})
    assert (s.model, s.server_path, s.cache_dir, s.dtype, s.tp_size) == (
        model, "/models/M", f"{tmp_path}/cache", "float16", 2)
    assert s.settings["server_path"].source == "launch argument"
    assert s.settings["encoder_root"].source == "env file"
    # a cache root that no volume carries: entries written here would never reach the server
    with pytest.raises(ConfigError, match="not on a bind mount.*--cache-dir"):
        resolved(text.replace(f"-v {tmp_path}/cache:/cache/exl3-online ", ""), env_files=[str(envfile)])
    # the host's HOME is never the container's
    with pytest.raises(ConfigError, match="container's HOME"):
        resolved(text.replace("-e VLLM_EXL3_ONLINE_CACHE_DIR=/cache/exl3-online ", ""), env_files=[str(envfile)],
                 environ={"HOME": "/host-home"})
    # a model the container sees only inside the image: give a copy here
    with pytest.raises(ConfigError, match="not on a bind mount.*pass MODEL"):
        resolved(text.replace(f"-v {model}:/models/M:ro ", ""), env_files=[str(envfile)])
    s = resolved(text.replace(f"-v {model}:/models/M:ro ", ""), env_files=[str(envfile)],
                 explicit=Explicit(model=model))
    assert (s.model, s.server_path) == (model, "/models/M")


def test_files_mode_encoder_through_a_volume(model, tmp_path):
    enc = tmp_path / "enc"
    (enc / "modules").mkdir(parents=True)
    (enc / "modules" / "a.py").write_text("x = 1\n")
    text = (f"docker run -v {model}:/models/M -v {enc}:/opt/exllamav3 -v {tmp_path}/c:/c "
            "-e VLLM_EXL3_ENCODER_SOURCE=/opt/exllamav3 -e VLLM_EXL3_ONLINE_CACHE_DIR=/c "
            f"-e VLLM_EXL3_ONLINE_TRELLIS_BITS=6 IMAGE serve /models/M --quantization-config '{QC}'")
    s = resolved(text)
    assert (s.encoder_root, s.encoder_revision, s.encoder_source) == ("/opt/exllamav3", None, str(enc))
    with pytest.raises(ConfigError, match="inside the image.*--encoder-source"):
        resolved(text.replace(f"-v {enc}:/opt/exllamav3 ", "").replace("/opt/exllamav3", "/nonexistent/exl3"))


@pytest.mark.parametrize("flags, match", [
    ("--hf-config-path /elsewhere", "--hf-config-path is not supported"),
    ("--quantization-config '{\"linear\": '", "--quantization-config is not valid JSON"),
    ("--quantization-config '{\"linear\": \"fp8\"}'", "the launch's --quantization-config: "),
    ("--quantization fp8", "--quantization fp8"),
    ("-tp two", "-tp 'two' is not an integer"),
    ("--dtype int8", "--dtype 'int8'"),
    ("-pcp 2", "prefill context parallel"),
    ("--load-format runai_streamer", "--load-format runai_streamer"),
    ("--model-impl transformers", "--model-impl transformers"),
    ("--speculative-config '{bad'", "--speculative-config is not valid JSON"),
    ("-tp 2 -dp 2 --enable-expert-parallel", "sequence-parallel MoE"),
])
def test_refusals_name_the_flag(model, flags, match):
    env = {"VLLM_EXL3_ENCODER_SOURCE": "/e", "VLLM_EXL3_ENCODER_REVISION": "r", "HOME": "/h"}
    with pytest.raises(ConfigError, match=match):
        resolved(f"vllm serve {model} {flags}", environ=env)


def test_honoured_structure_flags(model):
    env = {"VLLM_EXL3_ENCODER_SOURCE": "/e", "VLLM_EXL3_ENCODER_REVISION": "r", "HOME": "/h"}
    s = resolved(f"vllm serve {model} -tp 2 -pp 2 -dcp 2 -dp 2 --speculative-config '{{\"method\": \"mtp\", "
                 "\"num_speculative_tokens\": 1}' --limit-mm-per-prompt '{\"image\": 0, \"video\": 0}'", environ=env)
    assert s.tp_size == 2 and s.language_model_only
    notes = " ".join(s.notes)
    assert "covers every stage" in notes and "no look-ups" in notes
    ignored = " ".join(s.launch.args.ignored)
    assert "-dcp 2" in ignored
    # EP with DP but an all2all backend that is not sequence-parallel: allowed
    resolved(f"vllm serve {model} -tp 2 -dp 2 -ep --all2all-backend pplx", environ=env)


def test_apply_launch_tp_sizes_and_flags(model):
    env = {"VLLM_EXL3_ENCODER_SOURCE": "/e", "VLLM_EXL3_ENCODER_REVISION": "r", "HOME": "/h"}
    li = LaunchInput(text=f"vllm serve {model} -tp 4")
    base = ServerRequest(model="", tp_sizes=(1, 2))
    req, _, _ = apply_launch(base, {"tp_sizes"}, li, add_tp_sizes=True, environ=env)
    assert req.tp_sizes == (4, 1, 2)  # cache warm: the launch's TP first, --tp-size adds
    req, _, _ = apply_launch(base, set(), li, add_tp_sizes=True, environ=env)
    assert req.tp_sizes == (4,)
    req, _, _ = apply_launch(ServerRequest(model="", tp_sizes=(2,)), {"tp_sizes"}, li, environ=env)
    assert req.tp_sizes == (2,)  # encode/verify: a given --tp-size wins
    with pytest.raises(ConfigError, match="--tp-rank 4"):
        apply_launch(ServerRequest(model="", tp_ranks=(4,)), set(), li, environ=env)
    # --env-file without a launch: the file's bits
    req, settings, environ = apply_launch(ServerRequest(model=model), set(), LaunchInput(env_files=()), environ=env)
    assert settings is None and environ is None


def test_settings_json_block(model):
    s = resolved(f"vllm serve {model} --port 1", environ={"VLLM_EXL3_ENCODER_SOURCE": "/e", "HOME": "/h"})
    data = json.loads(json.dumps(s.as_json()))
    assert data["form"] == "command" and data["settings"]["encoder_root"] == {
        "value": "/e", "source": "process env", "detail": "VLLM_EXL3_ENCODER_SOURCE"}
    assert data["ignored"] == ["--port 1"] and "unknown" not in data  # refused before: never a key
    assert data["server_lookup"] is False and len(data["lookup_off"]) == 2


@pytest.mark.parametrize("flags, match", [
    ("--tensor-paralel-size 2", "--tensor-paralel-size is not a flag of the server.*did you mean "
                                "--tensor-parallel-size"),
    ("--quantisation-config '{}'", "did you mean --quantization-config"),
    ("-tpp 2", "-tpp is not a flag.*did you mean -tp"),
    ("--tp 4", "--tp is not a flag.*did you mean -tp\\?"),  # argparse: -tp only as written, no --tp... flag
    ("-tensor-parallel-size 4", "did you mean --tensor-parallel-size"),
    ("--port 1 --max-modle-len 4096 --bogus", "--max-modle-len .*and 1 more: --bogus.*did you mean --max-model-len"),
])
def test_unknown_server_flags_are_refused_with_the_close_match(model, flags, match):
    """vLLM refuses a line with a flag its parser does not know: planning it at the defaults (TP 1) would advise a
    warm for a server that never starts."""
    env = {"VLLM_EXL3_ENCODER_SOURCE": "/e", "VLLM_EXL3_ENCODER_REVISION": "r", "HOME": "/h"}
    with pytest.raises(ConfigError, match=match):
        resolved(f"vllm serve {model} {flags}", environ=env)


@pytest.mark.parametrize("flags", ["--weird", "--kv-offload-tier host --enable-dspark-k5", "--b12x-moe-backend=fused"])
def test_unknown_flags_far_from_any_known_one_are_a_warning_naming_them(model, flags):
    """Before: every unknown flag refused the launch, so every fork release's new flags broke exl3tool. A flag more
    than 2 edits from every flag exl3tool knows is taken for a newer release's flag: a warning naming it."""
    env = {"VLLM_EXL3_ENCODER_SOURCE": "/e", "VLLM_EXL3_ENCODER_REVISION": "r", "HOME": "/h",
           "VLLM_EXL3_ONLINE_TRELLIS_BITS": "6"}
    s = resolved(f"vllm serve {model} --quantization-config '{QC}' {flags} --tensor-parallel-size 2", environ=env)
    assert s.tp_size == 2
    names = [w.partition("=")[0] for w in flags.split() if w.startswith("--")]
    assert any(all(n in w for n in names) and "flags exl3tool does not know" in w for w in s.warnings), s.warnings


def test_wrappers_that_clear_the_environment(model, tmp_path):
    env = {"VLLM_EXL3_ENCODER_SOURCE": "/e", "VLLM_EXL3_ENCODER_REVISION": "r", "HOME": "/h"}
    env["VLLM_EXL3_ONLINE_TRELLIS_BITS"] = "6"
    with pytest.raises(ConfigError, match="VLLM_EXL3_ENCODER_SOURCE was not given"):
        resolved(f"env -i HOME=/h VLLM_EXL3_ONLINE_TRELLIS_BITS=6 vllm serve {model} --quantization-config '{QC}'",
                 environ=env)
    # env -i also drops the bits: that server makes no look-up
    assert resolved(f"env -i HOME=/h vllm serve {model} --quantization-config '{QC}'", environ=env).lookup_off
    s = resolved(f"env -i HOME=/h VLLM_EXL3_ENCODER_SOURCE=/x vllm serve {model}", environ=env)
    assert s.encoder_root == "/x" and s.settings["encoder_revision"].source == "default"
    assert any("env -i" in n for n in s.notes)
    assert resolved(f"sudo -E vllm serve {model}", environ=env).encoder_root == "/e"
    with pytest.raises(ConfigError, match="VLLM_EXL3_ENCODER_SOURCE was not given"):
        resolved(f"sudo -u svc env VLLM_EXL3_ONLINE_TRELLIS_BITS=6 vllm serve {model} --quantization-config '{QC}'",
                 environ=env)


def test_relative_model_under_the_container_workdir(model, tmp_path):
    parent = str(Path(model).parent)
    s = resolved(f"docker run -v {parent}:/app -w /app -v {tmp_path}:/c -e VLLM_EXL3_ENCODER_SOURCE=/e "
                 "-e VLLM_EXL3_ENCODER_REVISION=r -e VLLM_EXL3_ONLINE_CACHE_DIR=/c IMAGE serve M")
    assert (s.model, s.server_path) == (model, "/app/M")
