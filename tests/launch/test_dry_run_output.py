"""A launcher's ``DRY_RUN=1`` output (``KEY=%q`` lines, then ``Command: ...``) read as the server's environment.

The fork's launchers print ``printf 'KEY=%q\\n' "${KEY:-}"``: an empty value comes out as ``''`` (bash's quoting of
the empty string). The server reads ``VLLM_EXL3_ENCODER_REVISION`` as unset when it is blank after stripping, and
then hashes the encoder's ``.py`` files. Read literally (Docker's env-file rule), the two quote characters became the
revision: every entry was keyed with ``''`` and ``cache check`` said "all hit" while the server found none. Hit or
miss is decided here by the tests' independent server (``helpers.server_lookup``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import exl3tool.operations.warm.run as warm_request
from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.launch.env import read_env_file
from helpers import TINY, fake_encode, server_encoder_identity, server_lookup, server_model_identity
from seeds import fresh_bytes, fresh_seed

QC = '{"linear":{"weight":"mxfp8"},"ignore":["lm_head"]}'


def _percent_q(pairs: list[tuple[str, str]], command: list[str]) -> str:
    """What a launcher prints with DRY_RUN=1, made by the system's bash (``printf %q``), not by us."""
    script = "".join(f"printf '{name}=%q\\n' \"${{{i}}}\"\n" for i, (name, _) in enumerate(pairs, 1))
    n = len(pairs)
    script += f"printf 'Command:'; printf ' %q' \"${{@:{n + 1}}}\"; printf '\\n'\n"
    out = subprocess.run(["bash", "-c", script, "dry", *(v for _, v in pairs), *command], check=True,
                         capture_output=True, text=True).stdout
    return out


@pytest.fixture()
def setup(tmp_path, monkeypatch):
    model = write_llama_checkpoint(tmp_path / "M", **TINY, seed=fresh_seed(16))
    enc = tmp_path / "exllamav3"
    (enc / "modules").mkdir(parents=True)
    for rel in ("__init__.py", "modules/quant.py"):
        (enc / rel).write_text(f"TOKEN = {fresh_bytes(8).hex()!r}\n")
    cache = tmp_path / "cache"
    real = getattr(warm_request.run_plan, "__wrapped__", warm_request.run_plan)
    monkeypatch.setattr(warm_request, "run_plan", lambda *a, **k: real(*a, **{**k, "encode": fake_encode}))
    return model, enc, cache


def _dry_run_text(model: Path, enc: Path, cache: Path, revision: str = "") -> str:
    pairs = [("QUANTIZATION", "exl3"), ("ONLINE_QUANT", "exl3-b6"), ("QUANTIZATION_CONFIG_JSON", QC),
             ("VLLM_EXL3_ONLINE_TRELLIS_BITS", "6"), ("VLLM_EXL3_ENCODER_SOURCE", str(enc)),
             ("VLLM_EXL3_ENCODER_REVISION", revision), ("VLLM_EXL3_ONLINE_CACHE_DIR", str(cache)),
             ("VLLM_EXL3_ONLINE_CACHE_MODE", "readwrite"), ("VLLM_EXL3_PREFILL_BLOCK_M", "")]
    command = ["vllm", "serve", str(model), "--served-model-name", "tiny model", "--tensor-parallel-size", "2",
               "--quantization", "exl3", "--quantization-config", QC, "--max-model-len", "32768"]
    return _percent_q(pairs, command)


def _server_hits(model: Path, enc: Path, cache: Path, revision: str | None, doc: dict) -> list[bool]:
    mid = server_model_identity(str(model))
    eid = server_encoder_identity(str(enc), revision)
    return [server_lookup(cache, mid, eid, e["prefix"], 6, 2, e["tp_rank"], e["input_size"], e["output_size"])
            is not None for e in doc["entries"]]


@pytest.mark.parametrize("keep_command", [True, False], ids=["whole-output", "key-lines-only"])
def test_the_empty_revision_printed_as_two_quotes_is_unset_for_the_server(tmp_path, cli, setup, keep_command):
    """The issue's false all-hit: the DRY_RUN output (whole, or its KEY lines only) given as --env-file, the
    server's command after --."""
    model, enc, cache = setup
    text = _dry_run_text(model, enc, cache)
    assert "VLLM_EXL3_ENCODER_REVISION=''" in text.splitlines()  # bash's own %q of the empty value
    if not keep_command:
        text = "".join(line for line in text.splitlines(True) if not line.startswith("Command:"))
    dry = tmp_path / "dryrun.txt"
    dry.write_text(text)
    launch = ["--env-file", str(dry), "--", "vllm", "serve", str(model), "--tensor-parallel-size", "2",
              "--quantization-config", QC]
    code, out, err = cli("cache", "warm", "--json", *launch)
    assert code == 0, err
    code, out, err = cli("cache", "check", "--json", *launch)
    doc = json.loads(out)
    assert code == 0 and doc["lookups"] == len(doc["entries"]) > 0, err
    assert doc["settings"]["encoder_revision"]["value"] is None, doc["settings"]["encoder_revision"]
    assert all(_server_hits(model, enc, cache, None, doc))  # the server (revision unset: files hashed) hits
    assert not any(_server_hits(model, enc, cache, "''", doc))  # the old reading keyed another identity


def test_dry_run_values_read_as_bash_reads_them(tmp_path):
    """Backslash escapes, ``''`` and ``$'...'`` of printf %q are undone; an empty value is left out (unset)."""
    values = {"A": '{"linear":{"weight":"mxfp8"}}', "B": "two words", "C": "", "D": "tab\there", "E": "it's"}
    text = _percent_q(list(values.items()), ["vllm", "serve", "/m"])
    dry = tmp_path / "dry.txt"
    dry.write_text(text)
    got = {k: v.value for k, v in read_env_file(str(dry)).items()}
    assert got == {k: v for k, v in values.items() if v}, text


def test_docker_env_files_stay_literal_and_docker_run_env_files_too(tmp_path):
    """Without a ``Command:`` line or a value only ``%q`` prints, the form is Docker's (quotes kept); a ``docker run
    --env-file`` is always Docker's (docker passes ``''`` to the server as two characters)."""
    env = tmp_path / "server.env"
    env.write_text("VLLM_EXL3_ENCODER_SOURCE=/opt/exllamav3\nOTHER='x'\nJSON={\"a\": 1}\n")
    got = read_env_file(str(env))
    assert (got["OTHER"].value, got["JSON"].value) == ("'x'", '{"a": 1}')
    env.write_text("VLLM_EXL3_ENCODER_SOURCE=/opt/exllamav3\nVLLM_EXL3_ENCODER_REVISION=''\n")
    assert "VLLM_EXL3_ENCODER_REVISION" not in read_env_file(str(env))
    assert read_env_file(str(env), dry_run_form=False)["VLLM_EXL3_ENCODER_REVISION"].value == "''"


def test_dry_run_output_as_the_launch(tmp_path, cli, setup):
    """--launch-file of the whole DRY_RUN output: its Command: line is the server's command, its KEY lines the
    environment (the revision '' unset: the encoder's files are hashed, as the independent server does)."""
    model, enc, cache = setup
    dry = tmp_path / "dryrun.txt"
    dry.write_text(_dry_run_text(model, enc, cache))
    code, out, err = cli("cache", "warm", "--json", "--launch-file", dry)
    assert code == 0, err
    code, out, err = cli("cache", "check", "--json", "--launch-file", dry)
    doc = json.loads(out)
    assert code == 0 and doc["lookups"] == len(doc["entries"]) > 0, err
    assert doc["settings"]["tp_size"]["value"] == 2 and doc["settings"]["encoder_revision"]["value"] is None
    assert all(_server_hits(model, enc, cache, None, doc))
    # the KEY lines without their Command: line are no launch: one line saying what to give
    dry.write_text("".join(line for line in dry.read_text().splitlines(True) if not line.startswith("Command:"))
                   .replace("VLLM_EXL3_ENCODER_REVISION=''", "VLLM_EXL3_ENCODER_REVISION=$'r\\t1'"))
    code, _, err = cli("identity", "--launch-file", dry)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "without its Command: line" in lines[0], err
