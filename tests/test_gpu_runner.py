"""benchmarks/gpu.sh, the one runner for GPU jobs, checked on the CPU: its presets expand to known parts, lanes go
to their GPUs, every script it calls exists, and an unknown part is refused (DRY_RUN prints, runs nothing)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "benchmarks" / "gpu.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def gpu_sh(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path)}
    return subprocess.run(["bash", str(RUNNER), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("preset", ["check", "final", "confirm", "diagnose", "gemm-speed"])
def test_every_preset_expands_to_commands_that_exist(preset, tmp_path):
    done = gpu_sh(preset, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    parts = re.findall(r"^== (\S+) \(GPU (\S+)\)", done.stdout, re.M)
    assert parts and parts[0][0] == "env"
    for script in re.findall(r"python3 (benchmarks/\S+\.py)", done.stdout):
        assert (REPO / script).is_file(), script
    if "/" in subprocess.run(["bash", "-c", f"grep -E '^  \\[{preset}\\]' {RUNNER}"], capture_output=True,
                             text=True).stdout:
        assert {gpu for _, gpu in parts} >= {"0", "1"}  # lanes: GPU 0 and GPU 1


def test_lanes_then_and_unknown_parts(tmp_path):
    done = gpu_sh("encode", "/", "gemm", "then", "warm-torchrun", tmp_path=tmp_path)
    assert re.findall(r"^== (\S+) \(GPU (\S+)\)", done.stdout, re.M) == [("encode", "0"), ("gemm", "1"),
                                                                          ("warm-torchrun", "all")]
    bad = gpu_sh("tests", "benchmark-everything", tmp_path=tmp_path)
    assert bad.returncode == 2 and "unknown part or preset 'benchmark-everything'" in bad.stderr
    assert "== tests" not in bad.stdout  # refused before running anything


def test_every_listed_part_has_a_command():
    text = RUNNER.read_text()
    listed = re.findall(r"^\s+\[([a-z-]+)\]=\"", text.split("PARTS=(")[0], re.M)
    cases = set(re.findall(r"^\s{4}([a-z-]+)\)$", text, re.M))
    assert listed and set(listed) == cases
