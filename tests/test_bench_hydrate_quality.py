"""benchmarks/hydrate_quality.py with a stand-in encoder: which layers it measures (each fused kind once), that the
online matrix is the sources side by side in order with the fused prefix's seed, and the JSON document (the real
figures, minutes of CPU encodes, are in docs/hydrate.md)."""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import hydrate_quality  # noqa: E402
from helpers import fake_encode  # noqa: E402


def test_fused_kinds_once_each_sources_then_the_fused_matrix(tmp_path, monkeypatch, capsys):
    calls = []

    def encode(w, *, bits, seed, device, name):
        calls.append((name, tuple(w.shape), bits, seed))
        return fake_encode(w, bits, seed, device)

    monkeypatch.setattr("exl3tool.encode.encode_linear", encode)
    hydrate_quality.main(["--families", "qwen3.5", "--bits", "6", "--json", str(tmp_path / "q.json")])
    rows = json.loads((tmp_path / "q.json").read_text())["rows"]
    assert [r["layer"].rsplit(".", 2)[-2:] for r in rows] == [["mlp", "gate_up_proj"], ["linear_attn", "in_proj_qkvz"],
                                                             ["self_attn", "qkv_proj"]]
    assert "K6: mean relative error over 3 fused layers" in capsys.readouterr().out
    at = 0
    for r in rows:  # its sources one by one (their own seeds), then the fused matrix with the layer's seed
        *sources, fused = calls[at: at + r["sources"] + 1]
        at += r["sources"] + 1
        assert fused[0] == r["layer"] and fused[3] == zlib.crc32(r["layer"].encode()) & 0x7FFFFFFF
        assert fused[1] == (sources[0][1][0], sum(s[1][1] for s in sources)) == tuple(r["shape"])
        assert all(s[3] != fused[3] for s in sources) and len({s[0] for s in sources}) == len(sources)
    assert at == len(calls)
