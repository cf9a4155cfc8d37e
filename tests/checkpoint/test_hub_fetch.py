"""A Hub download fetches only the shards holding tensors the plan reads (issue 11)."""

from __future__ import annotations

import json

import huggingface_hub

from exl3tool.plan import ServerRequest, prepare

from exl3tool.checkpoint.tiny import MLA, Builder, _experts, mla_attention, mla_config
from helpers import ENC

REPO = "test-org/tiny-mla-exl3"


def _write(hub, tmp):
    """BF16 dense tensors first, then 48 EXL3 routed experts: the last shards hold only experts."""
    cfg = mla_config()
    b = Builder()
    b.linear("lm_head", 64, MLA["hidden"])
    for i in range(2):
        mla_attention(b, f"model.layers.{i}", cfg)
    b.linear("model.layers.0.mlp.gate_proj", MLA["inter"], MLA["hidden"])
    b.linear("model.layers.0.mlp.up_proj", MLA["inter"], MLA["hidden"])
    b.linear("model.layers.0.mlp.down_proj", MLA["hidden"], MLA["inter"])
    _experts(b, "model.layers.1", 48, MLA["hidden"], MLA["moe_inter"])
    return b.write(tmp / "plain", {**cfg, "n_routed_experts": 48, "n_shared_experts": None}, shards=4,
                   hub_cache=hub, repo_id=REPO)


def test_only_planned_shards_are_fetched(tmp_path, monkeypatch):
    snap = _write(tmp_path / "hub", tmp_path)
    index = json.loads((snap / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    needed = {f for n, f in index["weight_map"].items() if n.endswith(".weight") and ".experts." not in n
              and "lm_head" not in n and "layernorm" not in n}
    assert len(files) == 4 and len(needed) < 4  # some shards hold only routed experts (and lm_head)
    calls = []
    real = huggingface_hub.snapshot_download

    def spy(*args, **kw):
        calls.append(list(kw.get("allow_patterns") or []))
        return real(*args, **kw)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    checkpoint, plan, _ = prepare(ServerRequest(model=REPO, tp_sizes=(2,), cache_dir=str(tmp_path / "c"), **ENC))
    assert {p for p in calls[-1] if p.endswith(".safetensors")} == needed  # the second call: only these shards
    assert set(plan.fetch.shards) == needed and plan.fetch.shards_total == 4
    total = index["metadata"]["total_size"]
    assert plan.fetch.index_total_bytes == total and 0 < plan.fetch.bytes_fetched < total
    assert len(plan.jobs) == 2 * 10 and checkpoint.index_names() == list(index["weight_map"])
