"""Opening checkpoints: Hub cache (offline) by repo id / tag / hash, local dirs and files, bad inputs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from exl3tool.checkpoint import open_checkpoint, plan_layers, write_llama_checkpoint
from exl3tool.errors import InputError
from exl3tool.releases import newest


@pytest.mark.parametrize("revision", [None, "main", "v1.0", "HASH"])
def test_open_by_repo_id_offline(offline_hub, tiny_hub, tiny_tensors, revision):
    _, snap, _ = tiny_hub
    rev = snap.name if revision == "HASH" else revision
    ckpt = open_checkpoint("test-org/tiny-llama", revision=rev)
    assert ckpt.model == "test-org/tiny-llama"
    assert ckpt.root == snap
    assert ckpt.commit_hash == snap.name and len(snap.name) == 40
    assert ckpt.dtype == torch.bfloat16
    assert ckpt.config["architectures"] == ["LlamaForCausalLM"]
    assert sorted(ckpt.tensor_names()) == sorted(tiny_tensors)
    name = "model.layers.1.mlp.down_proj.weight"
    assert ckpt.tensor_shape(name) == (256, 512)
    assert torch.equal(ckpt.get_tensor(name), tiny_tensors[name])


def test_local_snapshot_dir_and_plain_dir(tiny_hub, tiny_tensors):
    _, snap, plain = tiny_hub
    assert open_checkpoint(str(snap)).commit_hash == snap.name
    local = open_checkpoint(str(plain))
    assert local.commit_hash is None and local.root == plain
    block = local.read("model.layers.0.self_attn.q_proj.weight", rows=(64, 128), cols=(3, 40))
    assert torch.equal(block, tiny_tensors["model.layers.0.self_attn.q_proj.weight"][64:128, 3:40])


def test_single_file_and_file_path(tmp_path, seed):
    d = write_llama_checkpoint(tmp_path / "one", seed=seed, shards=1, dtype=torch.float32)
    assert not (d / "model.safetensors.index.json").exists()
    for model in (str(d), str(d / "model.safetensors")):
        ckpt = open_checkpoint(model)
        assert ckpt.config_dtype == torch.float32
        assert ckpt.dtype == torch.bfloat16  # vLLM's --dtype auto downcasts float32 models
        assert "lm_head.trellis" in ckpt.tensor_names()  # lm_head is stored as EXL3
        assert ckpt.get_tensor("model.norm.weight").dtype == torch.float32


def test_offline_uncached_repo_is_input_error(offline_hub):
    with pytest.raises(InputError) as e:
        open_checkpoint("other-org/not-cached")
    msg = str(e.value)
    assert "other-org/not-cached" in msg and "HF_HUB_OFFLINE" in msg and "\n" not in msg


def test_offline_unknown_tag_is_input_error(offline_hub):
    with pytest.raises(InputError, match="'v9'"):
        open_checkpoint("test-org/tiny-llama", revision="v9")


def test_local_files_only_argument_never_downloads(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(InputError, match="not in the Hub cache"):
        open_checkpoint("some-org/some-model", local_files_only=True)


def test_invalid_name_is_input_error(tmp_path):
    with pytest.raises(InputError, match="no such local path"):
        open_checkpoint(str(tmp_path / "does" / "not" / "exist"))


def _copy(plain, dst):
    shutil.copytree(plain, dst)
    return dst


def test_missing_shard_named_in_index(tiny_hub, tmp_path):
    d = _copy(tiny_hub[2], tmp_path / "ck")
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(InputError) as e:
        open_checkpoint(str(d))
    assert "model-00002-of-00002.safetensors" in str(e.value) and "missing" in str(e.value)


def test_corrupt_safetensors_header(tiny_hub, tmp_path):
    d = _copy(tiny_hub[2], tmp_path / "ck")
    shard = d / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\x00garbag"  # breaks the JSON header, keeps the length
    shard.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"model-00001-of-00002\.safetensors: corrupt safetensors header"):
        open_checkpoint(str(d))
    shard.write_bytes(b"\xff" * 8 + b"{}")  # header length far past the end of the file
    with pytest.raises(InputError, match="corrupt safetensors header"):
        open_checkpoint(str(d))


def _rewrite_header(shard, edit) -> None:
    """Apply ``edit`` to the shard's header dict and write it back, padded to its old length (data unmoved)."""
    import struct

    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit({k: v for k, v in header.items() if k != "__metadata__"})
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    shard.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])


@pytest.mark.parametrize("fault, words", [
    ("dtype", "span"),  # a BF16 tensor relabelled F32: twice the bytes its offsets hold
    ("shape", "span"),  # one row more than its bytes
    ("overlap", "overlap"),  # two tensors over the same bytes
    ("negative", "not a list of sizes"),
])
def test_header_records_must_match_their_bytes(tiny_hub, tmp_path, fault, words):
    """Every tensor's bytes are its shape times its dtype's size, within the file and apart from the others: a
    corrupt header is refused naming the file and the tensor, before any weight is read."""
    d = _copy(tiny_hub[2], tmp_path / "ck")
    shard = d / "model-00001-of-00002.safetensors"
    edited = []

    def edit(header):
        name, rec = next((k, r) for k, r in header.items() if r["dtype"] == "BF16" and len(r["shape"]) == 2)
        edited.append(name)
        if fault == "dtype":
            rec["dtype"] = "F32"
        elif fault == "shape":
            rec["shape"][0] += 1
        elif fault == "negative":
            rec["shape"][0] = -rec["shape"][0]
        else:
            other = next(r for k, r in header.items() if k != name and r["data_offsets"][1] > r["data_offsets"][0])
            rec["data_offsets"] = list(other["data_offsets"])
            rec["shape"], rec["dtype"] = list(other["shape"]), other["dtype"]

    _rewrite_header(shard, edit)
    with pytest.raises(InputError, match=r"model-00001-of-00002\.safetensors: corrupt safetensors header") as err:
        open_checkpoint(str(d))
    assert words in str(err.value) and "tensor" in str(err.value), err.value
    if fault in ("dtype", "shape", "negative"):  # a hydrate copying the tensor refuses it by the same check
        from exl3tool.checkpoint.hydrated import write_shard

        with pytest.raises(InputError) as copied:
            write_shard(tmp_path / "copy.safetensors", shard, [(edited[0], None)], None)
        why = str(err.value).split("corrupt safetensors header (", 1)[1].rsplit("); ", 1)[0]
        assert str(copied.value) == f"{shard}: {why}; the file is corrupt: download it again"
        assert not (tmp_path / "copy.safetensors").exists()


def test_index_points_at_tensor_not_in_shard(tiny_hub, tmp_path):
    d = _copy(tiny_hub[2], tmp_path / "ck")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.extra.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InputError, match="model.layers.0.extra.weight"):
        open_checkpoint(str(d))


def test_config_missing_or_incomplete(tiny_hub, tmp_path):
    d = _copy(tiny_hub[2], tmp_path / "ck")
    config = json.loads((d / "config.json").read_text())
    del config["num_attention_heads"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"config\.json: missing field 'num_attention_heads'"):
        plan_layers(open_checkpoint(str(d)), release=newest())
    (d / "config.json").unlink()
    with pytest.raises(InputError, match="config.json not found"):
        open_checkpoint(str(d))


def test_serving_dtype_follows_vllm_auto(tiny_hub, tmp_path):
    d = _copy(tiny_hub[2], tmp_path / "ck")
    for declared, served in (("float16", torch.float16), ("bfloat16", torch.bfloat16), ("float32", torch.bfloat16),
                             (None, torch.bfloat16)):
        config = json.loads((d / "config.json").read_text())
        config["torch_dtype"] = declared
        (d / "config.json").write_text(json.dumps(config))
        assert open_checkpoint(str(d)).dtype == served, declared


def test_bad_dtype_in_config(tiny_hub, tmp_path):
    d = _copy(tiny_hub[2], tmp_path / "ck")
    config = json.loads((d / "config.json").read_text())
    config["torch_dtype"] = "int8"
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="torch_dtype 'int8'"):
        open_checkpoint(str(d))


def test_hf_home_locates_the_cache(monkeypatch, tiny_hub):
    hub, snap, _ = tiny_hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hub.parent))  # the cache is $HF_HOME/hub
    assert open_checkpoint("test-org/tiny-llama").commit_hash == snap.name


@pytest.mark.parametrize("offline_env, local_files_only, expect_offline", [
    ("1", None, True), ("", None, False), ("", True, True), ("0", False, False)])
def test_download_call(monkeypatch, tiny_hub, tmp_path, offline_env, local_files_only, expect_offline):
    """The Hub call: only our files, the token passed through, offline honoured, cache from the environment."""
    import huggingface_hub

    calls = []

    def fake_snapshot_download(**kwargs):
        calls.append(kwargs)
        return str(tiny_hub[1])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setenv("HF_HUB_OFFLINE", offline_env)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    ckpt = open_checkpoint("test-org/tiny-llama", revision="v1.0", token="hf_x", local_files_only=local_files_only)
    assert ckpt.commit_hash == tiny_hub[1].name
    first, second = calls  # small files first (pins the commit), then exactly the indexed shards
    assert first["revision"] == "v1.0" and second["revision"] == tiny_hub[1].name
    small = ["config.json", "model.safetensors.index.json", "quantization_config.json"]
    assert sorted(first["allow_patterns"]) == small
    assert sorted(second["allow_patterns"]) == sorted(
        [*small, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    for call in calls:
        assert call["repo_id"] == "test-org/tiny-llama" and call["token"] == "hf_x"
        assert call["local_files_only"] is expect_offline and call["cache_dir"] == str(tmp_path)


def test_revision_with_local_path_is_kept(tiny_hub):
    """vLLM accepts --revision with a local path and its directory identity records it (docs/cache-format.md §2.4)."""
    ckpt = open_checkpoint(str(tiny_hub[2]), revision="abc")
    assert ckpt.revision == "abc" and ckpt.commit_hash is None
    assert open_checkpoint(str(tiny_hub[2])).revision is None


def test_single_file_repo_offline(monkeypatch, tmp_path, seed):
    snap = write_llama_checkpoint(tmp_path / "plain", seed=seed, shards=1, hub_cache=tmp_path / "hub",
                                  repo_id="test-org/one-file")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    ckpt = open_checkpoint("test-org/one-file")
    assert ckpt.commit_hash == snap.name and "model.norm.weight" in ckpt.tensor_names()
