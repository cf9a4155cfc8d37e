"""docs/deploy.md's launch runbook, run as printed: its launch line and image env file, with the CI commands' options,
plan what the equivalent flags plan."""

from __future__ import annotations

import json
import re
from pathlib import Path

from exl3tool.checkpoint import write_llama_checkpoint
from helpers import TINY_1 as TINY

DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"


def _blocks() -> dict[str, str]:
    pattern = re.compile(r"<!-- launch: (\S+) -->\n```[a-z]*\n(.*?)```", re.S)
    return {m.group(1): m.group(2) for m in pattern.finditer(DOC.read_text())}


def test_the_runbook_launch_warms_what_the_flags_warm(tmp_path, cli):
    blocks = _blocks()
    assert set(blocks) == {"deploy/server-launch.txt", "deploy/image.env"}
    assert 'LAUNCH=$(cat deploy/server-launch.txt)' in DOC.read_text()
    launch = blocks["deploy/server-launch.txt"]
    envfile = tmp_path / "image.env"
    envfile.write_text(blocks["deploy/image.env"])
    model = str(write_llama_checkpoint(tmp_path / "data" / "NAME", **TINY))  # CI's copy of /models/NAME
    cache = tmp_path / "exl3-cache"
    code, out, err = cli("cache", "warm", model, "--launch", launch, "--env-file", envfile, "--cache-dir", cache,
                         "--tp-size", "4", "--file-mode", "0644", "--dry-run", "--json")
    assert code == 0, err
    doc = json.loads(out)
    settings, meta = doc.pop("settings"), doc.pop("launch")
    assert doc["tp_sizes"] == [2, 4] and doc["bits"] == 6
    assert settings["server_path"]["value"] == "/models/NAME" and settings["model_here"]["source"] == "flag"
    assert settings["encoder_revision"] == {"value": "v0.0.18", "source": "env file",
                                            "detail": f"VLLM_EXL3_ENCODER_REVISION ({envfile}:2)"}
    assert settings["bits"]["source"] == "launch env" and settings["dtype"]["value"] == "bfloat16"
    assert meta["form"] == "docker" and meta["defaulted"] == []
    assert "--max-model-len 32768" in meta["ignored"] and any(i.startswith("-p 8000:8000") for i in meta["ignored"])
    code, out, err = cli("cache", "warm", model, "--server-path", "/models/NAME", "--cache-dir", cache,
                         "--tp-size", "2,4", "--bits", "6", "--dtype", "bfloat16", "--encoder-root", "/opt/exllamav3",
                         "--encoder-revision", "v0.0.18", "--file-mode", "0644", "--dry-run", "--json",
                         "--quantization-config",
                         '{"linear":{"weight":"mxfp8"},"shared_experts":{"weight":"mxfp8"}}')
    assert code == 0, err
    assert json.loads(out) == doc
