"""The quick lookup a warm plans with: every check the server can fail plus our checksum, hashed from the file
without loading the trellis; ``checksum=False`` is the server's check alone (no trellis bytes read)."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from exl3tool.cache import CacheKey, CacheStore
from helpers import ENCODER_ID, MODEL_ID, make_encoded


def _key(k=128, n=256):
    return CacheKey.for_layer(model_identity=MODEL_ID, encoder_identity=ENCODER_ID, prefix="model.layers.0.mlp.down_proj",
                              bits=6, tp_world_size=1, tp_rank=0, input_size=k, output_size=n)


def test_quick_lookup_agrees_with_full_lookup_except_on_trellis_bytes(tmp_path):
    store = CacheStore(tmp_path, "readwrite")
    key = _key()
    path = store.publish(key, make_encoded(seed=int(torch.randint(0, 2**30, ()))))
    assert store.lookup(key, quick=True).status == "hit" and store.lookup(key).status == "hit"
    assert set(store.lookup(key, quick=True).tensors) == {"suh", "svh"}

    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # last byte of the data section: trellis is the last tensor in the file
    path.write_bytes(bytes(data))
    assert store.lookup(key).status == "invalid"  # our checksum catches it
    assert store.lookup(key, quick=True).status == "invalid"  # hashed from the file: a warm never keeps it
    assert store.lookup(key, quick=True, checksum=False).status == "hit"  # as the server would: int16 data is not checked

    path.write_bytes(bytes(data[:-10]))  # truncated: the header no longer fits the file
    assert store.lookup(key, quick=True).status == "invalid"

    bad = make_encoded(seed=3).tensors()
    bad["suh"][5] = float("nan")
    save_file(bad, path, metadata={"cache_key": key.canonical_json(), "proxy_error": "0.1"})
    assert store.lookup(key, quick=True).status == "invalid"

    wrong = make_encoded(k=256, seed=4).tensors()
    save_file(wrong, path, metadata={"cache_key": key.canonical_json(), "proxy_error": "0.1"})
    assert "expected" in store.lookup(key, quick=True).reason


def test_file_checksum_equals_the_tensor_checksum(tmp_path):
    from exl3tool.cache.entry import file_tensor_sha256, read_entry, tensor_sha256

    store = CacheStore(tmp_path, "readwrite")
    for k, n in ((128, 256), (384, 128)):
        path = store.publish(_key(k, n), make_encoded(k, n, seed=k))
        assert file_tensor_sha256(path) == tensor_sha256(read_entry(path).tensors) == read_entry(path).metadata["exl3tool_sha256"]
