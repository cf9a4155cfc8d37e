"""Shared fixtures: where the golden vectors live, and the GPU marker's skip rule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Under `pytest -n N` (pytest-xdist) each worker gets its share of the cores for torch's and numba's pools, and so
# do the processes its tests start: N workers each running pools as wide as the machine spin against each other
# (two encodes at once on 2 cores took 35 % longer with 2 threads each than with 1). Set before torch is imported;
# an explicit setting is kept, and tests that are about thread counts set their own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    for _name in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(_name, str(_share))


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
    # Files holding a `slow` test first (order otherwise kept): under `-n 2 --dist loadfile --no-loadscope-reorder`
    # the long files start at once and the many short ones fill in, so the two workers finish together.
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
