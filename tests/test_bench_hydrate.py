"""benchmarks/bench_hydrate.py on the CPU with the models' tiny configs and a stand-in encoder: the plan's shapes and
counts, --per-shape's multiplication, the JSON document (the GPU run against the reference is the lead's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_hydrate  # noqa: E402
from helpers import fake_encode  # noqa: E402


def test_per_shape_times_once_and_counts_every_module(tmp_path, monkeypatch, capsys):
    calls = []

    def encode(w, *, bits, seed, device):
        calls.append(tuple(w.shape))
        return fake_encode(w, bits, seed, device)

    monkeypatch.setattr("exl3tool.encode.encode_linear", encode)
    bench_hydrate.main(["--device", "cpu", "--tiny", "--per-shape", "--json", str(tmp_path / "b.json")])
    doc = json.loads((tmp_path / "b.json").read_text())
    out = capsys.readouterr().out
    assert "(timed once, x count)" in out and "peak host RSS" in out
    for model, modules in (("qwen38-27b", 26), ("glm5", 42)):
        total = doc["models"][model]["total"]
        assert total["modules"] == modules and not total["partial"]
        assert sum(r["count"] for r in doc["models"][model]["rows"]) == modules
        assert all(r["timed"] == 1 for r in doc["models"][model]["rows"])
    assert (256, 1024) in calls and (512, 256) in calls  # each shape encoded (plus a warm-up slice)
