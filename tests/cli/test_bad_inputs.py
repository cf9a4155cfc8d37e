"""Every bad input of tests/data/bad_inputs.json, run as a user runs the console script (a fresh interpreter, its
real stdin/stdout/stderr): the documented exit code, one line naming the fix and no traceback, nothing partial left
behind. A new bad input is one line of that file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ENC_ARGS

REPO = Path(__file__).resolve().parents[2]
CASES = json.loads((REPO / "tests" / "data" / "bad_inputs.json").read_text())["cases"]

# Runs main() as the console script does; a case's "fault" is applied first (tests only: the package has no hook).
PROBE = """
import errno, sys
fault, argv = sys.argv[1], sys.argv[2:]
if fault == "enospc":  # the disk fills while the first shard is half written
    import exl3tool.checkpoint.synthetic as synthetic

    def full(path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    synthetic._write_safetensors = full
from exl3tool.cli import main
main(argv)
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from exl3tool.checkpoint.tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("bad-inputs") / "tiny-llama", "llama")


def _truncate_shard(model: Path, tmp: Path) -> Path:
    import shutil

    copy = tmp / "cut-model"
    shutil.copytree(model, copy)
    shard = copy / "model.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    return copy


SETUPS = {"truncate_shard": _truncate_shard}


def _argv(case: dict, places: dict[str, str]) -> list[str]:
    out = []
    for word in case["argv"]:
        if word == "@ENC":
            out += ENC_ARGS
        else:
            out.append(word.format(**places))
    return out


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_bad_input(case, tiny_model, tmp_path):
    work = tmp_path / "case"
    work.mkdir()
    model = SETUPS[case["setup"]](tiny_model, tmp_path) if "setup" in case else tiny_model
    cache = tmp_path / "cache"
    cache.mkdir()
    plain = tmp_path / "a-file"
    plain.write_text("not a folder\n")
    places = {"model": str(model), "cache": str(cache), "file": str(plain), "tmp": str(work)}
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80", **case.get("env", {})}
    cmd = [sys.executable, "-c", PROBE, case.get("fault", ""), *_argv(case, places)]
    stdout_to = open(case["stdout_to"], "w") if "stdout_to" in case else subprocess.PIPE
    try:
        proc = subprocess.Popen(cmd, stdout=stdout_to, stderr=subprocess.PIPE if not case.get("stderr_closed") else None,
                                text=True, env=env, cwd=tmp_path,
                                preexec_fn=(lambda: os.close(2)) if case.get("stderr_closed") else None)
        if case.get("stdout_closed"):  # the reader goes away before the command writes (`| head -0`)
            proc.stdout.close()
            _, err = proc.communicate(timeout=120)
            out = ""
        else:
            out, err = proc.communicate(timeout=120)
    finally:
        if stdout_to is not subprocess.PIPE:
            stdout_to.close()
    out, err = out or "", err or ""
    assert proc.returncode == case["exit"], (proc.returncode, out[-2000:], err[-2000:])
    assert "Traceback" not in err and "Traceback" not in out, err
    for part in case.get("stderr", []):
        assert part in err, (part, err)
    if proc.returncode and case.get("stderr"):  # one line naming the fix (Click's usage block for usage errors)
        assert err.strip().splitlines()[-1].startswith(("error:", "Error:")), err
    if case.get("stdout") == "json":
        json.loads(out)  # one document, nothing else (no progress, no notes)
    elif "stdout" in case:
        assert case["stdout"] in out, out
    if case.get("stderr") == []:
        assert err == "", err
    if "left" in case:
        assert sorted(p.name for p in work.iterdir()) == case["left"]
