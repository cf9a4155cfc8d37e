"""Launch tests: the tiny checkpoints of tests/checkpoint, a clean server environment, and the CLI as users run it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "checkpoint"))  # test_checkpoint_plan

SERVER_VARS = ("VLLM_EXL3_ONLINE_TRELLIS_BITS", "VLLM_EXL3_ENCODER_SOURCE", "VLLM_EXL3_ENCODER_REVISION",
               "VLLM_EXL3_ONLINE_CACHE_DIR", "VLLM_EXL3_ONLINE_CACHE_MODE", "VLLM_CACHE_ROOT", "XDG_CACHE_HOME",
               "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_CACHE_DIR")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No server variable leaks in from the machine running the tests."""
    for name in SERVER_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture()
def cli(capsys):
    """Run ``exl3tool ARGS`` as the console script does: returns (exit code, stdout, stderr)."""
    from exl3tool.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        out, err = capsys.readouterr()
        return code, out, err

    return run
