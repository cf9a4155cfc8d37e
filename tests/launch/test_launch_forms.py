"""The launch forms operators write, read as written: shell scripts with combined flags and variables, launch script
files, docker compose services, ``--hf-overrides`` and an image's ``ENV``.

Each form is modelled on public deployment material of the fork's users (model cards' ``docker run`` recipes, a
podman wrapper with ``--entrypoint /bin/bash IMAGE -lc``, a compose file with its entrypoint script, a GLM launcher
script); written here in our own words. The reference for every form is the plan exl3tool makes from the same
settings given as its own flags (no launch parsing involved): ``cache warm --dry-run --json`` must agree job for job,
and ``identity`` and ``cache check`` must take the form too.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
from pathlib import Path

import pytest

from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.launch import load_launch
from seeds import fresh_seed
from helpers import LAUNCH_ENC as ENC, TINY

# this file's own overlay: a long form with an ignore list, so every launch form must carry quotes and brackets
QC = '{"linear": {"weight": "mxfp8"}, "shared_experts": "mxfp8", "ignore": ["lm_head"]}'


@pytest.fixture()
def model(tmp_path) -> Path:
    return write_llama_checkpoint(tmp_path / "M", **TINY, seed=fresh_seed(16))


def _plan(cli, *args) -> tuple[int, dict, str]:
    code, out, err = cli("cache", "warm", "--dry-run", "--json", *args)
    doc = json.loads(out) if out.strip() else {}
    settings = doc.pop("settings", None)
    launch = doc.pop("launch", None)
    doc["_settings"], doc["_launch"] = settings, launch
    return code, doc, err


def _same(got: dict, want: dict) -> None:
    strip = ("_settings", "_launch")
    assert {k: v for k, v in got.items() if k not in strip} == {k: v for k, v in want.items() if k not in strip}


def _want(cli, model: Path, cache: Path, *, tp: int = 2, bits: int = 5, server_path: str | None = None,
          qc: str = QC) -> dict:
    """The plan from exl3tool's own flags: the independent reference for every launch form."""
    args = [str(model), "--tp-size", str(tp), "--bits", str(bits), "--quantization-config", qc,
            "--encoder-root", ENC[0], "--encoder-revision", ENC[1], "--cache-dir", str(cache)]
    if server_path:
        args += ["--server-path", server_path]
    code, doc, err = _plan(cli, *args)
    assert code == 0 and doc["jobs"], err
    return doc


def _runs_everywhere(cli, want: dict, *launch: str) -> None:
    """``identity`` and ``cache check`` take the same launch and compute the reference's identities; check exits 1
    with every look-up a miss (nothing is warmed yet)."""
    code, out, err = cli("identity", "--json", *launch)
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["model"]["identity"], doc["encoder"]["identity"]) == (want["model_identity"],
                                                                        want["encoder_identity"])
    code, out, err = cli("cache", "check", "--json", *launch)
    doc = json.loads(out)
    assert code == 1 and doc["lookups"] == doc["miss"] == len(want["jobs"]), err
    assert doc["model_identity"] == want["model_identity"]


# --- shells with combined flags and -c scripts, variables from the run line ---------------------------------------

@pytest.mark.parametrize("shell", ["bash -lc", "bash -ec", "bash -xc", "bash -lic", "sh -euc", "bash -e -c",
                                   "/bin/bash --login -c", "zsh -o pipefail -c", "dash -c"])
def test_docker_run_shell_script_with_variables_from_e(tmp_path, cli, model, shell):
    """A model card's recipe: the overlay and the TP size set with -e, used as "${VAR}" in the shell's script."""
    cache = tmp_path / "cache"
    want = _want(cli, model, cache, server_path="/models/M")
    script = ('cd /workspace && export VLLM_EXL3_ONLINE_TRELLIS_BITS=5; '
              'exec vllm serve /models/M --tensor-parallel-size "${TP:-1}" --quantization-config "${QUANT_CONFIG}" '
              '--max-model-len ${CTX:-32768} --port 8000 2>&1 | tee /logs/server.log')
    launch = (f"docker run --rm --gpus all --ipc=host -v {model}:/models/M:ro -v {cache}:/cache "
              f"-e QUANT_CONFIG={shlex.quote(QC)} -e TP=2 -e VLLM_EXL3_ONLINE_CACHE_DIR=/cache "
              f"-e VLLM_EXL3_ENCODER_SOURCE={ENC[0]} -e VLLM_EXL3_ENCODER_REVISION={ENC[1]} "
              f"my/vllm-exl3:latest {shell} {shlex.quote(script)}")
    code, got, err = _plan(cli, "--launch", launch)
    assert code == 0, err
    _same(got, want)
    assert got["_settings"]["bits"]["detail"].startswith("VLLM_EXL3_ONLINE_TRELLIS_BITS (set by the ")
    assert got["_settings"]["tp_size"]["value"] == 2


def test_podman_entrypoint_bash_and_env_file_of_the_run_line(tmp_path, cli, model):
    """A wrapper script's form: ``podman run --env-file server.env --entrypoint /bin/bash IMAGE -lc "..."``."""
    cache = tmp_path / "cache"
    want = _want(cli, model, cache, server_path="/srv/model")
    envfile = tmp_path / "server.env"
    envfile.write_text(f"QUANTIZATION_CONFIG={QC}\nVLLM_EXL3_ENCODER_SOURCE={ENC[0]}\n"
                       f"VLLM_EXL3_ENCODER_REVISION={ENC[1]}\nVLLM_EXL3_ONLINE_TRELLIS_BITS=5\n")
    launch = (f"podman run -d --name exl3 --device nvidia.com/gpu=all --env-file {envfile} "
              f"-v {model}:/srv/model:ro,z --mount type=bind,source={cache},target=/home/vllm/.cache/vllm/exl3_online "
              "-e HOME=/home/vllm --entrypoint /bin/bash quay.io/example/vllm:exl3 -lc "
              "\"vllm serve /srv/model -tp 2 --trust-remote-code "  # \$: kept for the container's shell
              "--quantization-config \\\"\\${QUANTIZATION_CONFIG}\\\"\"")
    code, got, err = _plan(cli, "--launch", launch)
    assert code == 0, err
    _same(got, want)
    assert got["_settings"]["quantization_config"]["value"] == QC
    _runs_everywhere(cli, want, "--launch", launch)


def _double_quoted(text: str) -> str:
    """``text`` as one double-quoted shell word (how a wrapper writes its ``-lc "..."`` script)."""
    return '"' + "".join("\\" + c if c in '\\"$`' else c for c in text) + '"'


WRAPPER = "; ".join([
    "set -euo pipefail", "cd /", "ln -sf /srv/model /tmp/model-link || true", "rm -f /tmp/vllm.ready",
    "mkdir -p /home/vllm/.cache/vllm", "nvidia-smi -L > /dev/null 2>&1 || true", "ulimit -n 65536",
    'NSYS=(); if [ "${PROFILE:-0}" = "1" ]; then NSYS=(nsys profile -o /tmp/trace --trace=cuda,nvtx); fi',
    'SPEC_ARGS=(); if [ -n "${SPEC_CONFIG:-}" ]; then SPEC_ARGS=(--speculative-config "${SPEC_CONFIG}"); fi',
    'LMO_ARGS=(); if [ "${LANGUAGE_MODEL_ONLY:-0}" = "1" ]; then LMO_ARGS=(--language-model-only); fi',
    'echo "starting: ${#SPEC_ARGS[@]} speculative words"',
    "exec \"${NSYS[@]}\" vllm serve '/srv/model' --quantization exl3 \"${LMO_ARGS[@]}\" "
    '--quantization-config "${QUANTIZATION_CONFIG}" -tp "${TP:-1}" --host 0.0.0.0 --port 8000 "${SPEC_ARGS[@]}"',
])


@pytest.mark.parametrize("spec, lmo, profile", [(None, None, None), ('{"method": "ngram", "num_speculative_tokens": '
                                                                      '3, "prompt_lookup_max": 4}', "1", "1"),
                                                 (None, "0", "1"), ('{"method": "mtp"}', None, "0")])
def test_podman_wrapper_with_arrays_and_ifs(tmp_path, cli, model, spec, lmo, profile):
    """A public podman wrapper's -lc script (in our own words): arrays of optional flags filled by ifs over the
    run line's -e values, then ``exec "${NSYS[@]}" vllm serve ... "${LMO_ARGS[@]}" ... "${SPEC_ARGS[@]}"``. The
    plan is the flags' plan in every branch; the branch taken shows in the settings."""
    cache = tmp_path / "cache"
    want = _want(cli, model, cache, server_path="/srv/model")
    optional = "".join(f"-e {name}={shlex.quote(value)} " for name, value in
                       (("SPEC_CONFIG", spec), ("LANGUAGE_MODEL_ONLY", lmo), ("PROFILE", profile)) if value)
    launch = (f"podman run -d --replace --name exl3 --device nvidia.com/gpu=all -v {model}:/srv/model:ro,z "
              f"-v {cache}:/cache -e QUANTIZATION_CONFIG={shlex.quote(QC)} -e TP=2 {optional}"
              f"-e VLLM_EXL3_ONLINE_CACHE_DIR=/cache -e VLLM_EXL3_ONLINE_TRELLIS_BITS=5 "
              f"-e VLLM_EXL3_ENCODER_SOURCE={ENC[0]} -e VLLM_EXL3_ENCODER_REVISION={ENC[1]} "
              f"--entrypoint /bin/bash quay.io/example/vllm:exl3 -lc {_double_quoted(WRAPPER)}")
    code, got, err = _plan(cli, "--launch", launch)
    assert code == 0, err
    _same(got, want)
    s = got["_settings"]
    assert s["quantization_config"]["value"] == QC and s["tp_size"]["value"] == 2
    if spec is None:
        assert "speculative_config" not in s
    else:
        assert s["speculative_config"]["value"] == json.loads(spec)
        assert s["speculative_config"]["detail"] == "--speculative-config"
    if lmo == "1":
        assert s["language_model_only"]["value"] is True
        assert s["language_model_only"]["detail"] == "--language-model-only"
    else:
        assert "language_model_only" not in s
    _runs_everywhere(cli, want, "--launch", launch)


def test_su_c_and_runuser(tmp_path, cli, model):
    cache = tmp_path / "c"
    want = _want(cli, model, cache)
    env = (f"VLLM_EXL3_ENCODER_SOURCE={ENC[0]} VLLM_EXL3_ENCODER_REVISION={ENC[1]} VLLM_EXL3_ONLINE_TRELLIS_BITS=5 "
           f"VLLM_EXL3_ONLINE_CACHE_DIR={cache}")
    for wrap in ("su vllm -c", "su -s /bin/bash vllm -c", "runuser -u vllm -- bash -c"):
        inner = f"env {env} vllm serve {model} -tp 2 --quantization-config {shlex.quote(QC)}"
        code, got, err = _plan(cli, "--launch", f"{wrap} {shlex.quote(inner)}")
        assert code == 0, (wrap, err)
        _same(got, want)


def test_host_command_expands_from_this_environment(tmp_path, cli, model, monkeypatch):
    """A plain host line sees exl3tool's environment where its shell would; single quotes do not expand."""
    cache = tmp_path / "c"
    want = _want(cli, model, cache)
    monkeypatch.setenv("MODEL_DIR", str(model))
    monkeypatch.setenv("QC_JSON", QC)
    base = (f"VLLM_EXL3_ENCODER_SOURCE={ENC[0]} VLLM_EXL3_ENCODER_REVISION={ENC[1]} VLLM_EXL3_ONLINE_TRELLIS_BITS=5 "
            f"VLLM_EXL3_ONLINE_CACHE_DIR={cache} ")
    code, got, err = _plan(cli, "--launch",
                           base + 'vllm serve "$MODEL_DIR" -tp ${TP:-2} --quantization-config "$QC_JSON"')
    assert code == 0, err
    _same(got, want)
    # the argv after -- is already expanded, but a -c script in it expands from this environment
    code, got, err = _plan(cli, "--", "bash", "-lc",
                           base + 'vllm serve "${MODEL_DIR}" -tp 2 --quantization-config "$QC_JSON"')
    assert code == 0, err
    _same(got, want)
    # single quotes keep $ literal: the overlay is then the text '$QC_JSON', which the server refuses too
    code, _, err = _plan(cli, "--launch", base + "vllm serve \"$MODEL_DIR\" --quantization-config '$QC_JSON'")
    assert code == 2 and "--quantization-config" in err


@pytest.mark.parametrize("launch, said", [
    ("vllm serve $MODEL_PATH -tp 2", "no model in the launch"),  # bash passes `vllm serve -tp 2`
    ("bash -c 'vllm serve ${M:?set the model}'", "M: set the model"),  # bash's own refusal, in one line
])
def test_unset_variable_is_refused_in_one_line(cli, launch, said):
    for command in (("cache", "warm", "--dry-run"), ("identity",), ("cache", "check")):
        code, _, err = cli(*command, "--launch", launch)
        lines = [x for x in err.splitlines() if x.strip()]
        assert code == 2 and len(lines) == 1 and said in lines[0], err


def test_container_variables_do_not_come_from_this_environment(monkeypatch):
    """The inner shell of a container sees the container's environment, not the host's."""
    monkeypatch.setenv("QUANT_CONFIG", QC)
    launch, _ = load_launch(text="docker run img bash -lc 'vllm serve /m --quantization-config \"$QUANT_CONFIG\"'")
    assert launch.args.values["quantization_config"][0] == ""  # bash in the container: unset there
    launch, layers = load_launch(text="docker run -e QUANT_CONFIG img bash -lc 'vllm serve /m --quantization-config "
                                      "\"$QUANT_CONFIG\"'")  # -e NAME: passed through from here
    assert launch.args.values["quantization_config"][0] == QC


# --- launch script files ------------------------------------------------------------------------------------------

def _script(tmp_path: Path, text: str, name: str = "run.sh") -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_launch_file_straight_line_script(tmp_path, cli, model, monkeypatch):
    """A launcher script as operators write them (GLM-style: a block of variables, exports, cd, exec, flags in an
    array-free variable, --hf-overrides on the line)."""
    cache = tmp_path / "c"
    (tmp_path / "srv").mkdir()
    os.symlink(model, tmp_path / "srv" / "model")
    want = _want(cli, tmp_path / "srv" / "model", cache)
    envsh = _script(tmp_path, f"export VLLM_EXL3_ENCODER_SOURCE={ENC[0]}\n"
                              f"export VLLM_EXL3_ENCODER_REVISION={ENC[1]}\n", "exl3.env.sh")
    run = _script(tmp_path, f"""#!/usr/bin/env bash
# start the EXL3 server (online Trellis)
set -euo pipefail

source {envsh}
MODEL=./model
TP="${{TP:-2}}"
QUANT='{QC}'
EXTRA_ARGS="--max-model-len 65536 --gpu-memory-utilization 0.92"
export VLLM_EXL3_ONLINE_TRELLIS_BITS=5 VLLM_EXL3_ONLINE_CACHE_DIR={cache}
echo "starting on $(hostname) at $(date)"
cd {tmp_path}/srv

exec vllm serve "$MODEL" \\
    --tensor-parallel-size "$TP" \\
    --quantization-config "$QUANT" \\
    --hf-overrides '{{"num_hidden_layers": 2}}' \\
    $EXTRA_ARGS "$@"
""")
    code, got, err = _plan(cli, "--launch-file", run)
    assert code == 0, err
    _same(got, want)
    s = got["_settings"]
    assert s["encoder_root"]["detail"] == f"VLLM_EXL3_ENCODER_SOURCE (set by {run} (run by bash))"
    assert s["model_here"]["value"] == os.path.realpath(tmp_path / "srv" / "model") and s["hf_overrides"]["value"] == {
        "num_hidden_layers": 2}
    _runs_everywhere(cli, want, "--launch-file", run)
    code, out, err = cli("encode", "--dry-run", "--json", "--launch-file", run)
    assert code == 0 and json.loads(out)["tp_sizes"] == [2], err


BODIES = [  # what the home-made reader refused (naming the line), as bash runs it: {M} the model, {S} the server's flags
    "case \"${{TP:-2}}\" in\n  2) vllm serve {M} -tp 2 {S} ;;\n  *) exit 3 ;;\nesac\n",
    "if [ -n \"${{TP:-}}\" ]; then\n  TP=4\nelse\n  TP=2\nfi\nvllm serve {M} -tp $TP {S}\n",
    "if [ -f /etc/exl3tool-no-such-file ]; then\n  TP=4\nfi\nvllm serve {M} -tp ${{TP:-2}} {S}\n",
    "ARGS=()\nfor f in --tensor-parallel-size 2; do ARGS+=(\"$f\"); done\nvllm serve {M} \"${{ARGS[@]}}\" {S}\n",
    "A=1\nwhile true; do\n  vllm serve {M} -tp 2 {S}\ndone\n",
    "start() {{\n  exec vllm serve \"$1\" -tp \"$2\" {S}\n}}\nstart {M} 2\n",
    "#!/bin/sh\nTP=$(echo 1 1 | wc -w)\nvllm serve {M} -tp \"$TP\" {S}\n",
    "eval 'TP=2'\nvllm serve {M} -tp $TP {S}\n",
    "cat <<EOF | tee /dev/null\nhi\nEOF\n(cd / && exec vllm serve {M} -tp 2 {S})\n",
]


@pytest.mark.parametrize("body", BODIES, ids=["case", "if-var", "if-file", "for-array", "while", "function",
                                              "command-substitution", "eval", "heredoc-subshell"])
def test_launch_file_constructs_bash_runs(tmp_path, cli, model, body):
    """Functions, case, loops, arrays, subshells, $(...), eval, here-documents: bash runs them, so exl3tool reads
    them (the home-made reader refused each naming the line); the plan is the flags' plan."""
    cache = tmp_path / "c"
    want = _want(cli, model, cache)
    env = (f"export VLLM_EXL3_ENCODER_SOURCE={ENC[0]} VLLM_EXL3_ENCODER_REVISION={ENC[1]} "
           f"VLLM_EXL3_ONLINE_TRELLIS_BITS=5 VLLM_EXL3_ONLINE_CACHE_DIR={cache}\n")
    text = body.format(M=model, S=f"--quantization-config {shlex.quote(QC)}")
    run = _script(tmp_path, (text.split("\n", 1)[0] + "\n" + env + text.split("\n", 1)[1]) if text.startswith("#!")
                  else env + text)
    code, got, err = _plan(cli, "--launch-file", run)
    assert code == 0, (text, err)
    _same(got, want)


def test_launch_file_failing_is_refused_with_its_own_error(tmp_path, cli):
    run = _script(tmp_path, "set -e\n. ./missing-env.sh\nvllm serve /m\n")
    code, _, err = cli("cache", "warm", "--dry-run", "--launch-file", run)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "missing-env.sh: No such file or directory" in lines[0], err


def test_launch_file_errors(tmp_path, cli):
    code, _, err = cli("identity", "--launch-file", tmp_path / "nope.sh")
    assert code == 2 and "--launch-file" in err and "nope.sh" in err
    empty = _script(tmp_path, "#!/bin/sh\n# nothing yet\n")
    code, _, err = cli("identity", "--launch-file", empty)
    assert code == 2 and "no vllm server" in err
    code, _, err = cli("identity", "--launch-file", empty, "--launch", "vllm serve /m")
    assert code == 2 and "give one launch" in err


def test_unexported_server_variable_is_noted(tmp_path, cli, model):
    run = _script(tmp_path, f"VLLM_EXL3_ONLINE_TRELLIS_BITS=4\nexport VLLM_EXL3_ENCODER_SOURCE={ENC[0]} "
                            f"VLLM_EXL3_ENCODER_REVISION={ENC[1]} VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}/c\n"
                            f"vllm serve {model} --quantization-config '{QC}'\n")
    code, got, err = cli("cache", "warm", "--dry-run", "--launch-file", run)
    # the server does not see the variable, so it encodes nothing online: the warm has nothing to do
    assert code == 2 and "makes no cache look-up" in err, err
    assert "sets VLLM_EXL3_ONLINE_TRELLIS_BITS but does not export it" in err


# --- docker compose ------------------------------------------------------------------------------------------------

def _compose_project(tmp_path: Path, model: Path, cache: Path, compose: str, dotenv: str = "") -> Path:
    proj = tmp_path / "deploy"
    proj.mkdir()
    (proj / "models").symlink_to(model.parent)
    (proj / "exl3.env").write_text(f'# encoder of the image\nVLLM_EXL3_ENCODER_SOURCE="{ENC[0]}"\n'
                                   f"VLLM_EXL3_ENCODER_REVISION={ENC[1]}  # pinned\n")
    (proj / ".env").write_text(dotenv or f"MODEL_NAME=M\nTP_SIZE=2\nCACHE_DIR={cache}\nBITS=4\n")
    path = proj / "docker-compose.yml"
    path.write_text(compose)
    return path


COMPOSE = """
name: exl3
services:
  webui:
    image: ghcr.io/example/webui:main
    ports: ["3000:8080"]
    environment:
      - OPENAI_API_BASE_URL=http://vllm:8000/v1
  vllm:
    image: "vllm/vllm-openai:${VLLM_TAG:-latest}"
    ipc: host
    entrypoint: ["/bin/bash", "-lc"]
    command:
      - >-
        exec vllm serve /models/${MODEL_NAME} --tensor-parallel-size ${TP_SIZE}
        --quantization-config "$$QUANT_CONFIG" --port 8000
    env_file:
      - ./exl3.env
    environment:
      VLLM_EXL3_ONLINE_TRELLIS_BITS: 5
      VLLM_EXL3_ONLINE_CACHE_DIR: /cache
      QUANT_CONFIG: '%s'
    volumes:
      - ./models:/models:ro
      - type: bind
        source: ${CACHE_DIR}
        target: /cache
    working_dir: /workspace
    deploy:
      resources:
        reservations:
          devices: [{driver: nvidia, count: all, capabilities: [gpu]}]
""" % QC


def test_compose_service(tmp_path, cli, model, monkeypatch):
    cache = tmp_path / "cache"
    path = _compose_project(tmp_path, model, cache, COMPOSE)
    want = _want(cli, path.parent / "models" / "M", cache, server_path="/models/M")
    monkeypatch.chdir(tmp_path)  # the project's .env is next to the file, not in the working directory
    code, got, err = _plan(cli, "--compose", path)
    assert code == 0, err
    _same(got, want)
    s = got["_settings"]
    assert s["bits"]["value"] == 5 and "environment of compose service vllm" in s["bits"]["detail"]
    assert s["encoder_root"]["value"] == ENC[0] and "env_file ./exl3.env" in s["encoder_root"]["detail"]
    # the shell's environment wins over .env in interpolation
    monkeypatch.setenv("TP_SIZE", "1")
    code, got, err = _plan(cli, "--compose", path, "--service", "vllm")
    assert code == 0 and got["tp_sizes"] == [1], err
    monkeypatch.delenv("TP_SIZE")
    _runs_everywhere(cli, want, "--compose", path)


def test_compose_entrypoint_script_and_short_syntax(tmp_path, cli, model):
    """A compose file whose service runs a mounted entrypoint script; command as a string; list environment."""
    cache = tmp_path / "cache"
    compose = f"""
services:
  llm:
    image: my/vllm-exl3:1
    entrypoint: /bin/bash /opt/start.sh
    command: --port 8000
    environment:
      - SERVED_MODEL=/models/M
      - VLLM_EXL3_ONLINE_CACHE_DIR=/cache
      - VLLM_EXL3_ONLINE_TRELLIS_BITS
    env_file: exl3.env
    volumes:
      - ./models:/models:ro
      - ./start.sh:/opt/start.sh:ro
      - {cache}:/cache
"""
    path = _compose_project(tmp_path, model, cache, compose)
    (path.parent / "start.sh").write_text(f"""#!/bin/bash
set -e
QC='{QC}'
exec vllm serve "$SERVED_MODEL" -tp 2 --quantization-config "$QC" "$@"
""")
    want = _want(cli, path.parent / "models" / "M", cache, server_path="/models/M")
    os.environ.pop("VLLM_EXL3_ONLINE_TRELLIS_BITS", None)
    code, got, err = cli("cache", "warm", "--dry-run", "--json", "--compose", path)  # named without a value, unset
    assert code == 2 and "VLLM_EXL3_ONLINE_TRELLIS_BITS is not set" in err, err  # (the image's ENV is not readable here)
    code, got, err = cli("cache", "warm", "--dry-run", "--json", "--compose", path, "--bits", "5")
    doc = json.loads(got)
    doc.pop("settings"), doc.pop("launch")
    assert code == 0
    _same(doc, want)


@pytest.mark.parametrize("compose, extra, match", [
    ("services:\n  a:\n    image: vllm/vllm-openai\n  b:\n    image: vllm/vllm-openai\n", [], "several services"),
    ("services:\n  a:\n    image: nginx\n", [], "no service runs vllm"),
    ("services:\n  a:\n    image: vllm/vllm-openai\n", ["--service", "b"], "no service 'b'"),
    ("services:\n  a:\n    image: vllm/vllm-openai\n    env_file: gone.env\n", [], "env_file gone.env"),
    ("services:\n  a:\n    image: vllm/${IMG:?set the image}\n", [], "${IMG} is required"),
    ("services: [\n", [], "not valid YAML"),
    # a long-syntax bind of a missing folder: the engine refuses it (the short syntax creates it)
    ("services:\n  a:\n    image: vllm/vllm-openai\n    volumes:\n      - {type: bind, source: ./gone, target: /c}\n",
     [], "./gone:/c names"),
])
def test_compose_errors(tmp_path, cli, compose, extra, match):
    path = tmp_path / "compose.yaml"
    path.write_text(compose)
    code, _, err = cli("cache", "warm", "--dry-run", "--compose", path, *extra)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and match in lines[0], err
    code, _, err = cli("identity", "--service", "a")
    assert code == 2 and "--compose" in err


# --- --hf-overrides --------------------------------------------------------------------------------------------------

def _jobs(doc: dict) -> list[tuple]:
    return sorted((j["prefix"], j["tp_rank"], j["input_size"], j["output_size"], j["state"]) for j in doc["jobs"])


def _baked(src: Path, dst: Path, **fields) -> Path:
    """A copy of ``src`` whose config.json already holds ``fields``: what the server builds with the override."""
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("spelling", ["json", "dotted"])
def test_hf_overrides_change_the_plan_as_the_server_builds(tmp_path, cli, model, spelling):
    cache = tmp_path / "c"
    env = (f"VLLM_EXL3_ENCODER_SOURCE={ENC[0]} VLLM_EXL3_ENCODER_REVISION={ENC[1]} VLLM_EXL3_ONLINE_TRELLIS_BITS=5 "
           f"VLLM_EXL3_ONLINE_CACHE_DIR={cache}")
    override = ("--hf-overrides '{\"num_hidden_layers\": 1}'" if spelling == "json"
                else "--hf-overrides.num_hidden_layers 1")
    code, got, err = _plan(cli, "--launch", f"{env} vllm serve {model} -tp 2 --quantization-config '{QC}' {override}")
    assert code == 0, err
    want = _want(cli, _baked(model, tmp_path / "baked", num_hidden_layers=1), cache)
    assert _jobs(got) == _jobs(want)
    assert {j["prefix"].split(".")[2] for j in got["jobs"]} == {"0"}  # the second layer is not built
    full = _want(cli, model, cache)
    assert {j["prefix"].split(".")[2] for j in full["jobs"]} == {"0", "1"}


def test_hf_overrides_fix_a_config_the_weights_disagree_with(tmp_path, cli, model):
    """config.json says 1 KV head, the weights hold 2: the server runs only with the override, and the q/k/v split
    (and so each rank's share) is the override's."""
    cache = tmp_path / "c"
    wrong = _baked(model, tmp_path / "wrong", num_key_value_heads=1)
    env = (f"VLLM_EXL3_ENCODER_SOURCE={ENC[0]} VLLM_EXL3_ENCODER_REVISION={ENC[1]} VLLM_EXL3_ONLINE_TRELLIS_BITS=5 "
           f"VLLM_EXL3_ONLINE_CACHE_DIR={cache}")
    line = f"{env} vllm serve {wrong} -tp 2 --quantization-config '{QC}'"
    code, _, err = _plan(cli, "--launch", line)
    assert code == 2 and "KV heads" in err
    code, got, err = _plan(cli, "--launch", line + " --hf-overrides.num_key_value_heads 2")
    assert code == 0, err
    assert _jobs(got) == _jobs(_want(cli, model, cache))


@pytest.mark.parametrize("value, match", [("'[1, 2]'", "must be a JSON object"), ("'{oops'", "not valid JSON")])
def test_hf_overrides_bad_json(cli, model, value, match):
    code, _, err = cli("cache", "warm", "--dry-run", "--launch", f"vllm serve {model} --hf-overrides {value}",
                       "--encoder-root", ENC[0], "--encoder-revision", ENC[1], "--cache-dir", str(model.parent / "c"))
    assert code == 2 and "--hf-overrides" in err and match in err


def test_hf_overrides_merge_rules():
    """The fork's rules: flat keys set; a dict merges into a sub-config recursively; other dicts replace whole."""
    from exl3tool.checkpoint.overrides import apply_hf_overrides

    config = {"num_hidden_layers": 4, "rope_scaling": {"type": "yarn", "factor": 4.0},
              "text_config": {"model_type": "qwen3_5_text", "hidden_size": 64, "rope_parameters": {"theta": 1e6}},
              "vision_config": {"depth": 2}}
    got = apply_hf_overrides(config, {"num_hidden_layers": 2, "rope_scaling": {"factor": 2.0},
                                      "text_config": {"num_hidden_layers": 3, "rope_parameters": {"partial": 0.5}},
                                      "vision_config": {"depth": 1}})
    assert got == {"num_hidden_layers": 2, "rope_scaling": {"factor": 2.0},
                   "text_config": {"model_type": "qwen3_5_text", "hidden_size": 64, "num_hidden_layers": 3,
                                   "rope_parameters": {"theta": 1e6, "partial": 0.5}},
                   "vision_config": {"depth": 1}}
    assert config["num_hidden_layers"] == 4  # the input is not changed


# --- the image's ENV ----------------------------------------------------------------------------------------------

def _fake_docker(tmp_path: Path, images: dict[str, list[str]]) -> Path:
    """A ``docker`` on PATH answering ``image inspect --format '{{json .Config.Env}}' IMAGE`` (no engine here)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    cases = "".join(f"  {shlex.quote(img)}) printf '%s\\n' {shlex.quote(json.dumps(env))} ;;\n"
                    for img, env in images.items())
    script = bindir / "docker"
    script.write_text("#!/bin/sh\n"
                      "[ \"$1 $2 $3\" = \"image inspect --format\" ] || { echo \"unexpected: $*\" >&2; exit 3; }\n"
                      f"case \"$5\" in\n{cases}  *) echo \"Error: No such image: $5\" >&2; exit 1 ;;\nesac\n")
    script.chmod(0o755)
    return bindir


def test_image_env_is_the_lowest_layer(tmp_path, cli, model, monkeypatch):
    cache = tmp_path / "c"
    bindir = _fake_docker(tmp_path, {"my/vllm-exl3:1": [
        "PATH=/usr/local/bin:/usr/bin", f"VLLM_EXL3_ENCODER_SOURCE={ENC[0]}", f"VLLM_EXL3_ENCODER_REVISION={ENC[1]}",
        "VLLM_EXL3_ONLINE_TRELLIS_BITS=3"]})
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    want = _want(cli, model, cache, server_path="/models/M")
    launch = (f"docker run --gpus all -v {model}:/models/M -v {cache}:/cache -e VLLM_EXL3_ONLINE_CACHE_DIR=/cache "
              f"-e VLLM_EXL3_ONLINE_TRELLIS_BITS=5 my/vllm-exl3:1 serve /models/M -tp 2 "
              f"--quantization-config '{QC}'")
    code, got, err = _plan(cli, "--launch", launch)
    assert code == 0, err
    _same(got, want)  # -e BITS=5 wins over the image's 3
    s = got["_settings"]
    assert s["encoder_root"]["value"] == ENC[0] and "ENV of the image my/vllm-exl3:1" in s["encoder_root"]["detail"]
    # an image that is not present: one line naming the variable and --env-file
    code, _, err = _plan(cli, "--launch", launch.replace("my/vllm-exl3:1", "other/image:2"))
    lines = [x for x in err.splitlines() if x.startswith("error")]
    assert code == 2 and len(lines) == 1, err
    assert "VLLM_EXL3_ENCODER_SOURCE" in lines[0] and "--env-file" in lines[0] and "No such image" in lines[0]
    # no docker or podman on PATH at all
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, _, err = _plan(cli, "--launch", launch)
    assert code == 2 and "neither docker nor podman is on PATH" in err and "VLLM_EXL3_ENCODER_SOURCE" in err


def test_a_host_script_run_by_the_launch(tmp_path, cli, model):
    """``--launch "./prepare.sh; ./serve.sh"``: a script that starts no server is passed over, the one that does is
    read (its #! line may carry options)."""
    cache = tmp_path / "c"
    want = _want(cli, model, cache)
    _script(tmp_path, "#!/bin/sh\nmkdir -p /tmp/x\n", "prepare.sh")
    _script(tmp_path, f"#!/bin/bash -e\nexport VLLM_EXL3_ENCODER_SOURCE={ENC[0]} VLLM_EXL3_ENCODER_REVISION={ENC[1]}\n"
                      f"export VLLM_EXL3_ONLINE_TRELLIS_BITS=5 VLLM_EXL3_ONLINE_CACHE_DIR={cache}\n"
                      f"exec vllm serve {model} -tp 2 --quantization-config '{QC}'\n", "serve.sh")
    for launch in (f"cd {tmp_path} && ./prepare.sh && ./serve.sh", f"bash {tmp_path}/serve.sh --port 1"):
        code, got, err = _plan(cli, "--launch", launch)
        assert code == 0, err
        _same(got, want)


def test_hf_overrides_choose_the_hub_shards_too(tmp_path, cli, monkeypatch):
    """A Hub model: the shards fetched are those the overridden config's layers need (the selection sees the
    override, not config.json as stored)."""
    repo = "test-org/tiny-override"
    write_llama_checkpoint(tmp_path / "plain", **{**TINY, "layers": 4}, shards=4, hub_cache=tmp_path / "hub",
                           repo_id=repo, seed=fresh_seed(16))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    line = (f"VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ENCODER_SOURCE={ENC[0]} VLLM_EXL3_ENCODER_REVISION={ENC[1]} "
            f"VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}/c vllm serve {repo} --quantization-config '{QC}'")
    code, full, err = _plan(cli, repo, "--launch", line)
    assert code == 0, err
    code, cut, err = _plan(cli, repo, "--launch", line + " --hf-overrides.num_hidden_layers 1")
    assert code == 0, err
    assert {j["prefix"].split(".")[2] for j in cut["jobs"]} == {"0"}
    assert len(cut["fetch"]["shards"]) < len(full["fetch"]["shards"]), (cut["fetch"], full["fetch"])
