"""A warm from the server's launch plans exactly what the equivalent flags plan, for every architecture of every
family the fork serves (``exl3tool/checkpoint/families.py``), as a plain launch line, a wrapped one, the argv after
``--`` and a docker start with volumes; and the commands' launch options end to end (JSON, errors, exit codes)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.checkpoint.families import FAMILIES

from exl3tool.checkpoint.tiny import QWEN38_OVERLAY, write_glm4_moe, write_glm5, write_glm53, write_mla, write_qwen3_next, write_qwen35
from test_checkpoint_plan import _write_moe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # helpers

from helpers import BOTH, LAUNCH_ENC as ENC, TINY  # noqa: E402


def _retarget(path: Path, arch: str) -> Path:
    """The same checkpoint declared as another architecture of its family."""
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = [arch]
    (path / "config.json").write_text(json.dumps(config))
    return path


def _glm53_text(path: Path) -> Path:
    """GLM-5.3 as ``Glm5NextForCausalLM``: the text config at the top, the text tensors under ``model.``."""
    from safetensors.torch import load_file, save_file

    src = write_glm53(path.with_name(path.name + "-vl"))
    path.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    text = {**config.pop("text_config"), "architectures": ["Glm5NextForCausalLM"],
            "torch_dtype": config["torch_dtype"], "quantization_config": config["quantization_config"]}
    (path / "config.json").write_text(json.dumps(text))

    def rename(name: str) -> str:
        return name.replace("model.language_model.", "model.", 1)

    tensors = {rename(k): v for k, v in load_file(src / "model.safetensors").items() if "visual" not in k}
    save_file(tensors, path / "model.safetensors")
    quant = json.loads((src / "quantization_config.json").read_text())
    quant["tensor_storage"] = {rename(k): v for k, v in quant.get("tensor_storage", {}).items()}
    (path / "quantization_config.json").write_text(json.dumps(quant))
    return path


def _write(arch: str, path: Path) -> Path:
    if arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return _retarget(write_llama_checkpoint(path, **TINY), arch)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return Path(_write_moe(path, arch, shared=True))
    if arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):
        return write_mla(path, arch=arch)
    if arch in ("GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM"):
        return _retarget(write_glm5(path), arch)
    if arch == "Glm5NextForCausalLM":
        return _glm53_text(path)
    if arch.startswith("Glm5Next"):
        return write_glm53(path)
    if arch.startswith("Qwen3_5"):
        return _retarget(write_qwen35(path), arch)
    if arch == "Qwen3NextForCausalLM":
        return write_qwen3_next(path)
    if arch == "Glm4MoeForCausalLM":
        return write_glm4_moe(path)
    raise AssertionError(f"no tiny checkpoint for {arch}: add one when a family is added")


ARCHS = [(f.name, a) for f in FAMILIES for a in f.architectures]


def _plan(cli, *args) -> tuple[int, dict, str]:
    code, out, err = cli("cache", "warm", "--dry-run", "--json", *args)
    doc = json.loads(out)
    doc.pop("settings", None)
    doc.pop("launch", None)
    return code, doc, err


@pytest.mark.parametrize("family, arch", ARCHS, ids=[a for _, a in ARCHS])
def test_launch_plans_what_the_flags_plan(tmp_path, cli, family, arch):
    model = str(_write(arch, tmp_path / "M"))
    cache = tmp_path / "cache"
    overlay = QWEN38_OVERLAY if arch.startswith("Qwen3_5") else BOTH
    flags = ["--tp-size", "2", "--bits", "5", "--dtype", "bfloat16", "--quantization-config", overlay,
             "--encoder-root", ENC[0], "--encoder-revision", ENC[1]]
    want_code, want, _ = _plan(cli, model, *flags, "--cache-dir", cache)
    env = (f"VLLM_EXL3_ENCODER_SOURCE={ENC[0]} VLLM_EXL3_ENCODER_REVISION={ENC[1]} "
           f"VLLM_EXL3_ONLINE_TRELLIS_BITS=5 VLLM_EXL3_ONLINE_CACHE_DIR={cache}")
    serve = f"--tensor-parallel-size 2 --dtype bfloat16 --quantization-config {shlex.quote(overlay)}"
    # a plain launch line, wrapped, with the server's own environment before it
    code, got, err = _plan(cli, "--launch", f"setsid ./run.sh env {env} vllm serve {model} {serve} --port 8000")
    assert (code, got) == (want_code, want), err
    # the argv after --
    code, got, err = _plan(cli, "--", "env", *shlex.split(env), "vllm", "serve", model, *shlex.split(serve))
    assert (code, got) == (want_code, want), err
    # a container: the model and the cache through volumes, the identity with the container's path
    want_code, want_docker, _ = _plan(cli, model, *flags, "--cache-dir", cache, "--server-path", "/models/M")
    docker = (f"docker run --rm --gpus all -v {model}:/models/M:ro -v {cache}:/cache/exl3-online "
              f"-e VLLM_EXL3_ENCODER_SOURCE={ENC[0]} -e VLLM_EXL3_ENCODER_REVISION={ENC[1]} "
              "-e VLLM_EXL3_ONLINE_TRELLIS_BITS=5 -e VLLM_EXL3_ONLINE_CACHE_DIR=/cache/exl3-online "
              f"IMAGE serve /models/M {serve}")
    code, got, err = _plan(cli, "--launch", docker)
    assert (code, got) == (want_code, want_docker), err
    if want_code == 0:
        assert got["jobs"] and got["model_identity"] != want["model_identity"]  # the container's path counts


def test_every_family_plans_from_its_launch(tmp_path, cli):
    """At least one architecture of each family gives a non-empty plan (the comparisons above are not all refusals)."""
    planned = set()
    for family, arch in ARCHS:
        if family in planned:
            continue
        model = str(_write(arch, tmp_path / arch))
        overlay = QWEN38_OVERLAY if arch.startswith("Qwen3_5") else BOTH
        code, doc, err = _plan(cli, "--launch", f"VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ENCODER_SOURCE=/e VLLM_EXL3_ENCODER_REVISION=r "
                               f"VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}/c vllm serve {model} -tp 2 "
                               f"--quantization-config {shlex.quote(overlay)}")
        if code == 0 and doc["jobs"]:
            planned.add(family)
    assert planned == {f.name for f in FAMILIES}


def test_warm_uses_the_launch_tp_and_adds_tp_sizes(tmp_path, tiny_llama, cli):
    model = str(tiny_llama)  # read only
    launch = (f"VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ENCODER_SOURCE=/e VLLM_EXL3_ENCODER_REVISION=r VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}/c "
              f"vllm serve {model} -tp 2 --quantization-config '{BOTH}'")
    code, doc, _ = _plan(cli, "--launch", launch)
    assert code == 0 and doc["tp_sizes"] == [2]
    code, doc, _ = _plan(cli, "--launch", launch, "--tp-size", "1,2,4")
    assert code == 0 and doc["tp_sizes"] == [1, 2, 4]
    # encode and verify: a given --tp-size wins, else the launch's
    code, out, _ = cli("encode", "--dry-run", "--json", "--launch", launch)
    assert code == 0 and json.loads(out)["tp_sizes"] == [2]
    code, out, _ = cli("encode", "--dry-run", "--json", "--launch", launch, "--tp-size", "4", "--tp-rank", "3")
    assert code == 0 and json.loads(out)["tp_sizes"] == [4]


def test_json_and_stderr_say_where_settings_came_from(tmp_path, tiny_llama, cli):
    model = str(tiny_llama)  # read only
    envfile = tmp_path / "server.env"
    envfile.write_text("VLLM_EXL3_ENCODER_SOURCE=/opt/exllamav3\nVLLM_EXL3_ENCODER_REVISION=v1\n")
    code, out, err = cli("cache", "warm", "--dry-run", "--json", "--env-file", envfile, "--bits", "4", "--launch",
                         f"VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}/c vllm serve {model} -tp 2 --port 80 "
                         f"--quantization-config '{BOTH}'")
    assert code == 0, err
    doc = json.loads(out)
    s = doc["settings"]
    assert s["bits"] == {"value": 4, "source": "flag", "detail": "--bits"} and doc["bits"] == 4
    assert s["encoder_root"]["source"] == "env file" and str(envfile) in s["encoder_root"]["detail"]
    assert s["tp_size"]["source"] == "launch argument" and s["cache_dir"]["source"] == "launch env"
    assert doc["launch"]["ignored"] == ["--port 80"] and "unknown" not in doc["launch"]
    assert doc["launch"]["server_lookup"] is True and doc["launch"]["lookup_off"] == []
    assert "tp_size = 2 (launch argument: -tp)" in err
    # identity takes the same options and says the same
    code, out, err = cli("identity", "--json", "--env-file", envfile, "--launch", f"vllm serve {model}")
    doc = json.loads(out)
    assert code == 0 and doc["settings"]["encoder_revision"]["value"] == "v1"
    assert doc["encoder"]["root"] == "/opt/exllamav3"
    assert "VLLM_EXL3_ONLINE_TRELLIS_BITS was not given" in err
    assert doc["launch"]["server_lookup"] is False and "no look-up: VLLM_EXL3_ONLINE_TRELLIS_BITS is not set" in err


def test_language_model_only_drops_the_vision_tower(tmp_path, cli):
    model = str(write_qwen35(tmp_path / "Q"))
    base = (f"VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ENCODER_SOURCE=/e VLLM_EXL3_ENCODER_REVISION=r VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}/c "
            f"vllm serve {model} -tp 2 --quantization-config '{BOTH}'")
    code, doc, _ = _plan(cli, "--launch", base)
    assert code == 0 and any(e["prefix"] == "visual.*" for e in doc["not_planned"])
    code, doc2, err = _plan(cli, "--launch", base + " --language-model-only")
    assert code == 0 and not any(e["prefix"] == "visual.*" for e in doc2["not_planned"])
    assert doc2["jobs"] == doc["jobs"] and "vision tower is not built" in err


@pytest.mark.parametrize("args, match", [
    (["--launch", "vllm serve --port 8000"], "no model in the launch"),
    (["--launch", "python -m vllm.entrypoints.openai.api_server --port 1"], "takes --model"),
    (["--launch", "vllm serve /m --hf-config-path /cfg"], "--hf-config-path is not supported"),
    (["--launch", "vllm serve org/m --quantization-config '{oops'"], "--quantization-config is not valid JSON"),
    (["--launch", "echo hi"], "no vllm server in the launch"),
    (["--env-file", "/nonexistent/server.env", "--launch", "vllm serve org/m"], "--env-file /nonexistent/server.env"),
    (["--pid", "999999999"], "--pid 999999999: no such process"),
    (["--launch", "docker run --weird x IMAGE serve /m"], "--weird"),
])
def test_errors_are_one_line_exit_2(cli, args, match):
    code, out, err = cli("cache", "warm", "--dry-run", *args)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], err
    code, out, err = cli("identity", "--json", *args)
    assert code == 2 and json.loads(out)["exit_code"] == 2


def test_model_or_launch_required(cli):
    code, _, err = cli("cache", "warm", "--dry-run")
    assert code == 2 and "--launch" in err
    code, _, err = cli("cache", "warm", "--dry-run", "--")
    assert code == 2 and "nothing after" in err


def test_verify_reads_the_launch(tmp_path, tiny_llama, cli):
    model = str(tiny_llama)  # read only
    launch = (f"VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ENCODER_SOURCE=/e VLLM_EXL3_ENCODER_REVISION=r VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}/c "
              f"vllm serve {model} -tp 2 --quantization-config '{BOTH}'")
    code, _, err = cli("verify", "--launch", launch, "--device", "cpu")
    assert code == 2 and f"{tmp_path}/c does not exist" in err  # the launch's cache root, not the default one
    (tmp_path / "c").mkdir()
    code, out, err = cli("verify", "--json", "--launch", launch, "--device", "cpu")
    doc = json.loads(out)
    assert code == 1 and doc["tp_size"] == 2 and doc["settings"]["tp_size"]["value"] == 2
    assert doc["counts"]["fail"] == len(doc["layers"]) > 0  # nothing warmed yet: every entry missing


def test_env_file_without_a_launch(tmp_path, tiny_llama, cli):
    model = str(tiny_llama)  # read only
    envfile = tmp_path / "server.env"
    envfile.write_text(f"VLLM_EXL3_ENCODER_SOURCE=/e\nVLLM_EXL3_ENCODER_REVISION=r\nVLLM_EXL3_ONLINE_TRELLIS_BITS=3\n"
                       f"VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}/c\n")
    code, out, err = cli("cache", "warm", model, "--dry-run", "--json", "--env-file", envfile)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["bits"] == 3 and doc["cache_root"] == f"{tmp_path}/c" and "settings" not in doc
    code, out, _ = cli("cache", "warm", model, "--dry-run", "--json", "--bits", "6", "--encoder-root", "/e",
                       "--encoder-revision", "r", "--cache-dir", f"{tmp_path}/c")
    assert json.loads(out)["encoder_identity"] == doc["encoder_identity"]


def test_identity_needs_no_cache_volume_and_hub_launches_keep_their_kind(tmp_path, tiny_llama, cli):
    model = str(tiny_llama)  # read only
    code, out, err = cli("identity", "--json", "--launch",
                         f"docker run -v {model}:/models/M -e VLLM_EXL3_ENCODER_SOURCE=/e "
                         "-e VLLM_EXL3_ENCODER_REVISION=r IMAGE serve /models/M")
    assert code == 0, err
    doc = json.loads(out)
    assert json.loads(doc["model"]["payload"])["path"] == "/models/M"
    assert any("container's HOME" in w for w in doc["launch"]["warnings"])
    code, _, err = cli("identity", model, "--launch", "VLLM_EXL3_ENCODER_SOURCE=/e vllm serve org/name")
    assert code == 2 and "Hub repo org/name" in err


def test_a_warm_from_the_launch_writes_and_reports_its_settings(tmp_path, tiny_llama, cli, monkeypatch):
    import exl3tool.operations.warm.run as req
    from helpers import fake_encode

    real = req.run_plan
    monkeypatch.setattr(req, "run_plan", lambda *a, **k: real(*a, **{**k, "encode": fake_encode}))
    model = str(tiny_llama)  # read only
    launch = (f"docker run -v {model}:/models/M:ro -v {tmp_path}/cache:/cache/exl3-online "
              "-e VLLM_EXL3_ENCODER_SOURCE=/e -e VLLM_EXL3_ENCODER_REVISION=r -e VLLM_EXL3_ONLINE_TRELLIS_BITS=3 "
              f"-e VLLM_EXL3_ONLINE_CACHE_DIR=/cache/exl3-online IMAGE serve /models/M -tp 2 "
              f"--quantization-config '{BOTH}'")
    code, out, err = cli("cache", "warm", "--json", "--device", "cpu", "--launch", launch)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["counts"]["encoded"] == len(doc["entries"]) > 0 and doc["bits"] == 3
    assert all(e["path"].startswith(f"{tmp_path}/cache/v1/") for e in doc["entries"])
    assert doc["settings"]["cache_dir"]["value"] == "/cache/exl3-online"
    code, out, _ = cli("cache", "warm", "--json", "--device", "cpu", "--launch", launch)
    assert code == 0 and json.loads(out)["counts"]["hit"] == len(doc["entries"])


def test_cache_check_takes_the_launch(tmp_path, tiny_llama, cli, monkeypatch):
    import exl3tool.operations.warm.run as req
    from helpers import fake_encode

    real = req.run_plan
    monkeypatch.setattr(req, "run_plan", lambda *a, **k: real(*a, **{**k, "encode": fake_encode}))
    model = str(tiny_llama)  # read only
    launch = (f"docker run -v {model}:/models/M:ro -v {tmp_path}/cache:/cache/exl3-online "
              "-e VLLM_EXL3_ENCODER_SOURCE=/e -e VLLM_EXL3_ENCODER_REVISION=r -e VLLM_EXL3_ONLINE_TRELLIS_BITS=6 "
              f"-e VLLM_EXL3_ONLINE_CACHE_DIR=/cache/exl3-online IMAGE serve /models/M -tp 2 "
              f"--quantization-config '{BOTH}'")
    code, out, err = cli("cache", "check", "--json", "--launch", launch)
    doc = json.loads(out)
    assert code == 1 and doc["miss"] == doc["lookups"] > 0 and doc["settings"]["tp_size"]["value"] == 2
    assert cli("cache", "warm", "--json", "--device", "cpu", "--launch", launch)[0] == 0
    code, out, err = cli("cache", "check", "--json", "--", *shlex.split(launch))
    doc = json.loads(out)
    assert code == 0 and doc["hit"] == doc["lookups"] and doc["tp_sizes"] == [2], err
    # the same look-ups as the flags plan them
    code, out, _ = cli("cache", "check", "--json", model, "--server-path", "/models/M", "--tp-size", "2", "--bits", "6",
                       "--encoder-root", "/e", "--encoder-revision", "r", "--cache-dir", f"{tmp_path}/cache",
                       "--quantization-config", BOTH)
    flags = json.loads(out)
    assert code == 0 and [e["digest"] for e in flags["entries"]] == [e["digest"] for e in doc["entries"]]
