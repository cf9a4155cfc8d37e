"""Shared fixtures: where the golden vectors live, and the GPU marker's skip rule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def golden_dir() -> Path:
    """The golden vectors: $EXL3TOOL_GOLDEN, else ./golden (carried to the GPU machine), else ../shared/golden."""
    env = os.environ.get("EXL3TOOL_GOLDEN")
    candidates = [Path(env)] if env else []
    candidates += [REPO / "golden", REPO.parent / "shared" / "golden"]
    for path in candidates:
        if (path / "tiles_golden.safetensors").is_file():
            return path
    pytest.skip("golden vectors not found: they are the outputs of the exllamav3 1.6.5 reference's CUDA kernels "
                "(tiles_golden.safetensors etc., provenance in their README.md), kept in the project's shared/golden "
                "folder; run these tests with EXL3TOOL_GOLDEN=/path/to/golden python -m pytest, or put the folder at "
                "./golden or ../shared/golden")


@pytest.fixture(scope="session")
def golden() -> Path:
    return golden_dir()


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
