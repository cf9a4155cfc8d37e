"""README's "whole flow on your machine", run as written (bash), with the warm narrowed to one layer to stay quick;
the opening command's overlay is the one `exl3tool synth --family qwen3.5` prints; the hydrate sizes it states are
the sizes a hydrate writes."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from exl3tool.checkpoint.tiny import TINY_FAMILIES

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
ONE_LAYER = "language_model.model.layers.3.self_attn.o_proj"


def _flow_block() -> list[str]:
    section = README.split("### The whole flow on your machine", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.slow
def test_the_flow_runs_as_written(tmp_path):
    lines = _flow_block()
    script = ["set -euo pipefail", f"exl3tool() {{ {shlex.quote(sys.executable)} -m exl3tool \"$@\"; }}"]
    for n, line in enumerate(lines):
        if line.startswith("exl3tool"):
            script.append(f"echo '### {n}'; echo '### {n}' >&2")
        script.append(line)
        if "--dry-run" in line:  # the real warms and the verify: one layer (2 rank jobs) instead of 6
            script.append(f"SERVER+=(--layers {ONE_LAYER})")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(["bash", "-c", "\n".join(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    outs = {int(k): v for k, v in re.findall(r"### (\d+)\n(.*?)(?=### \d+\n|\Z)", done.stdout, re.S)}

    def out_of(start: str) -> str:
        return next(outs[n] for n in sorted(outs) if lines[n].startswith(start))

    assert "wrote a tiny qwen3.5 EXL3 checkpoint" in out_of("exl3tool synth")
    warms = [outs[n] for n in sorted(outs) if lines[n].startswith("exl3tool cache warm")]
    assert re.search(r"^12 jobs: 0 hit, 12 miss, 0 invalid, 0 skipped; 13 modules", warms[0], re.M), warms[0]
    assert "0 hit, 2 encoded, 0 skipped, 0 failed" in warms[1] and "2 hit, 0 encoded" in warms[2]
    assert "2 pass, 0 fail" in out_of("exl3tool verify")
    assert re.search(r"^2 look-ups: 2 hit .*0 miss, 0 invalid", out_of("exl3tool cache check"), re.M)
    assert "2 entries: 2 valid, 0 unchecked, 0 invalid" in out_of("exl3tool cache verify")
    rows = re.findall(r"^[0-9a-f]{20}\s+2\s+0-1\s+2\s", out_of("exl3tool cache ls"), re.M)
    assert len(rows) == 1, out_of("exl3tool cache ls")  # one model at TP 2, ranks 0 and 1, 2 entries


def test_the_opening_command_uses_the_overlay_synth_prints():
    opening = next(line for line in README.splitlines() if line.startswith("pip install") and "synth" in line)
    words = shlex.split(opening)
    overlay = words[words.index("--quantization-config") + 1]
    flow = next(line for line in _flow_block() if line.startswith("OVERLAY="))
    assert json.loads(overlay) == json.loads(shlex.split(flow.removeprefix("OVERLAY="))[0])
    assert json.loads(overlay) == json.loads(TINY_FAMILIES["qwen3.5"].overlay)
    assert "--family qwen3.5" in opening and "--tp-size 2" in opening


@pytest.mark.parametrize("family", ["qwen3.5", "llama"])
def test_the_hydrate_sizes_are_what_a_hydrate_writes(tmp_path, family):
    """README's "Sizes": `exl3tool synth`'s tiny checkpoint (its default seed) and what `hydrate --tp-size 1` makes of
    it, in bytes, as the run's report counts them (a stand-in encoder: the bytes depend on the shapes alone)."""
    from exl3tool.checkpoint.tiny import write_tiny
    from exl3tool.operations.hydrate import hydrate, plan_hydrate
    from exl3tool.plan import ServerRequest
    from helpers import fake_encode

    name = {"qwen3.5": "Qwen3.5", "llama": "Llama"}[family]
    found = re.search(rf"{name}'s ([\d,]+) (?:bytes )?become ([\d,]+)", README)
    assert found, f"README states no hydrate size for the tiny {name}"
    before, after = (int(v.replace(",", "")) for v in found.groups())
    src = write_tiny(tmp_path / "src", family, seed=0)
    request = ServerRequest(model=str(src), tp_sizes=(1,), quantization_config=TINY_FAMILIES[family].overlay)
    report = hydrate(plan_hydrate(request, tmp_path / "out"), device="cpu", encode=fake_encode)
    assert (report.plan.bytes_before, report.bytes_after) == (before, after)
