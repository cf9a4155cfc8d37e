"""The synthetic checkpoint writer: valid safetensors, layout-independent values, a real Hub-cache layout."""

from __future__ import annotations

import hashlib
import json

import torch
from safetensors.torch import load_file

from exl3tool.checkpoint import write_llama_checkpoint


def _all(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_values_do_not_depend_on_sharding(tmp_path, seed):
    one = _all(write_llama_checkpoint(tmp_path / "a", seed=seed, shards=1, layers=1))
    three = _all(write_llama_checkpoint(tmp_path / "b", seed=seed, shards=3, layers=1))
    other = _all(write_llama_checkpoint(tmp_path / "c", seed=seed + 1, shards=1, layers=1))
    assert one.keys() == three.keys()
    assert all(torch.equal(one[k], three[k]) for k in one)
    assert not torch.equal(one["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])
    w = one["model.layers.0.mlp.up_proj.weight"].float()
    assert 0.015 < w.std().item() < 0.025 and one["model.norm.weight"].eq(1).all()
    assert not torch.equal(one["model.layers.0.mlp.up_proj.weight"], one["model.layers.0.mlp.gate_proj.weight"])


def test_index_and_config(tiny_hub):
    plain = tiny_hub[2]
    index = json.loads((plain / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    tensors = _all(plain)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    config = json.loads((plain / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 64
    assert config["torch_dtype"] == "bfloat16"
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(tensors)
    # an EXL3 checkpoint as the fork serves them: lm_head stored as EXL3, every decoder linear BF16
    assert config["quantization_config"]["quant_method"] == "exl3" and "lm_head.weight" not in tensors
    assert tensors["lm_head.trellis"].dtype == torch.int16 and tuple(tensors["lm_head.trellis"].shape) == (16, 32, 96)
    storage = json.loads((plain / "quantization_config.json").read_text())["tensor_storage"]
    assert storage["lm_head"]["quant_format"] == "exl3"
    assert set(storage["lm_head"]["stored_tensors"]) == {f"lm_head.{x}" for x in ("trellis", "suh", "svh", "mcg")}


def test_hub_cache_layout(tiny_hub):
    hub, snap, _ = tiny_hub
    repo = hub / "models--test-org--tiny-llama"
    assert snap.parent == repo / "snapshots"
    for ref in ("main", "v1.0"):
        assert (repo / "refs" / ref).read_text() == snap.name  # no trailing newline
    for link in snap.iterdir():
        assert link.is_symlink()
        blob = link.resolve()
        assert blob.parent == (repo / "blobs").resolve()
        assert blob.name == hashlib.sha256(blob.read_bytes()).hexdigest()


def test_header_only_selection_writes_holes_for_the_chosen_tensors(tmp_path, seed):
    """A callable header_only: the tensors it picks are zeros (sparse holes), the others exactly a full write's."""
    from exl3tool.checkpoint import write_checkpoint
    from exl3tool.checkpoint.synthetic import llama_tensor_shapes

    config = {"architectures": ["LlamaForCausalLM"]}
    tensors = llama_tensor_shapes(hidden=256, heads=4, kv_heads=2, intermediate=512, layers=2, vocab=64)
    full = _all(write_checkpoint(tmp_path / "full", config, tensors, seed=seed, shards=2))
    holes = lambda name: ".layers.1." in name  # noqa: E731
    part = _all(write_checkpoint(tmp_path / "part", config, tensors, seed=seed, shards=2, header_only=holes))
    assert part.keys() == full.keys()
    for name in full:
        if holes(name):
            assert part[name].eq(0).all(), name
        else:
            assert torch.equal(part[name], full[name]), name
    assert any(holes(n) for n in full) and any(not holes(n) for n in full)
