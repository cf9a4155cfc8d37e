"""Key, digest, path, seeds, mode and root: the spec's worked example and tables, value for value."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from exl3tool.cache import CacheKey, cache_mode, cache_root, entry_path, layer_seed, lock_path
from exl3tool.errors import ConfigError
from exl3tool.releases import newest

from helpers import ENCODER_ID, MODEL_ID
from seeds import fresh_seed

EXAMPLE_JSON = (
    '{"apply_out_scales":true,"bits":6,"codebook":"mcg","encoder_identity":"fe5e6fead00d1b22502edfa1da021d26132cb231d96346f10e51ead3eedc8326",'
    '"input_size":4096,"model_identity":"c9ab4d59bf201df6de4427b12737f002314d556466aa257ac9767010c612fa95","output_size":3072,'
    '"prefix":"model.layers.0.self_attn.qkv_proj","schema":1,"seed":293502257,"tp_rank":1,"tp_world_size":2}'
)
EXAMPLE_DIGEST = "824fb1c1ed11b96a0b9fd31fd9509382a67227cf1e09657f951dd55bd2cb18c4"


def example_key() -> CacheKey:
    return CacheKey.for_layer(MODEL_ID, ENCODER_ID, "model.layers.0.self_attn.qkv_proj", 6, 2, 1, 4096, 3072)


def test_worked_example_digest_and_path():
    key = example_key()
    assert key.canonical_json() == EXAMPLE_JSON
    assert len(key.canonical_json().encode()) == 361
    assert key.digest() == EXAMPLE_DIGEST
    assert str(entry_path(key, "/cache/exl3")) == (
        "/cache/exl3/v1/c9ab4d59bf201df6de44/tp2-rank1/" + EXAMPLE_DIGEST + ".safetensors"
    )
    assert str(lock_path(entry_path(key, "/c"))).endswith(EXAMPLE_DIGEST + ".safetensors.lock")


@pytest.mark.parametrize(
    "prefix,crc,seed",
    [
        ("model.layers.0.self_attn.qkv_proj", 0x117E7D31, 293502257),
        ("model.layers.0.self_attn.o_proj", 0xDF360946, 1597376838),
        ("model.layers.0.mlp.gate_up_proj", 0xF78371B3, 2005103027),
        ("model.layers.0.mlp.down_proj", 0x49D94C48, 1238977608),
        ("model.layers.31.self_attn.qkv_proj", 0x522E4E3A, 1378766394),
        ("language_model.model.layers.0.self_attn.qkv_proj", 0x08779B9F, 142056351),
    ],
)
def test_seed_table(prefix, crc, seed):
    assert layer_seed(prefix) == crc & 0x7FFFFFFF == seed


def test_every_field_changes_the_digest():
    base = example_key()
    changes = dict(
        model_identity="0" * 64, encoder_identity="1" * 64, prefix="x", bits=5, seed=1, tp_world_size=4, tp_rank=0,
        input_size=128, output_size=128,
    )
    digests = {base.digest()}
    for name, value in changes.items():
        digests.add(CacheKey(**{**base.as_dict(), name: value}).digest())
    assert len(digests) == 10


def test_non_ascii_prefix_is_escaped_lowercase():
    key = CacheKey.for_layer("a", "b", "model.é\u00ff", 6, 1, 0, 128, 128)
    assert "\\u00e9\\u00ff" in key.canonical_json()
    assert hashlib.sha256(key.canonical_json().encode()).hexdigest() == key.digest()


@pytest.mark.parametrize("field,value", [("bits", 6.0), ("tp_rank", True), ("input_size", "4096")])
def test_json_integers_only(field, value):
    with pytest.raises(ValueError, match=field):
        CacheKey(**{**example_key().as_dict(), field: value})


def test_key_round_trips_and_rejects_extra_members():
    key = example_key()
    assert CacheKey.from_json(key.canonical_json()) == key
    with pytest.raises(ValueError, match="extra"):
        CacheKey.from_json(key.canonical_json()[:-1] + ',"x":1}')


@pytest.mark.parametrize(
    "raw,mode",
    [(None, "readwrite"), ("off", "off"), ("none", "off"), (" NONE ", "off"), ("readonly", "readonly"),
     ("read-only", "readonly"), ("readwrite", "readwrite"), ("rw", "readwrite"), ("RW\n", "readwrite")],
)
def test_mode_aliases(raw, mode):
    env = {} if raw is None else {"VLLM_EXL3_ONLINE_CACHE_MODE": raw}
    assert cache_mode(env) == mode


@pytest.mark.parametrize("raw,shown", [("sometimes", "'sometimes'"), ("", "''"), ("  Maybe ", "'maybe'")])
def test_mode_rejects_with_server_text(raw, shown):
    with pytest.raises(ConfigError) as exc:
        cache_mode({"VLLM_EXL3_ONLINE_CACHE_MODE": raw})
    assert str(exc.value) == f"VLLM_EXL3_ONLINE_CACHE_MODE must be off, readonly, or readwrite; got {shown}"


def test_cache_root_rules():
    home = Path("~").expanduser()
    assert cache_root({}, release=newest()) == home / ".cache/vllm/exl3_online"
    assert cache_root({"XDG_CACHE_HOME": "/x"}, release=newest()) == Path("/x/vllm/exl3_online")
    assert cache_root({"XDG_CACHE_HOME": "/x", "VLLM_CACHE_ROOT": "~/v"}, release=newest()) == home / "v/exl3_online"
    assert cache_root({"VLLM_EXL3_ONLINE_CACHE_DIR": "~/c", "VLLM_CACHE_ROOT": "/v"}, release=newest()) == home / "c"
    assert cache_root({"VLLM_EXL3_ONLINE_CACHE_DIR": "   ", "VLLM_CACHE_ROOT": "/v"}, release=newest()) == Path("/v/exl3_online")
    assert cache_root({"VLLM_EXL3_ONLINE_CACHE_DIR": "rel/dir"}, release=newest()) == Path("rel/dir")  # not resolved
    assert cache_root({"VLLM_EXL3_ONLINE_CACHE_DIR": " /c "}, release=newest()) == Path(" /c ")  # not stripped


def test_keys_the_server_builds_are_producible_and_altered_ones_are_not():
    import dataclasses
    import random

    rng = random.Random(fresh_seed())
    hexid = lambda: "".join(rng.choice("0123456789abcdef") for _ in range(64))  # noqa: E731
    for _ in range(50):
        world = rng.choice((1, 2, 4, 8))
        key = CacheKey.for_layer(hexid(), hexid(), f"model.layers.{rng.randrange(99)}.mlp.down_proj", rng.randrange(3, 9),
                                 world, rng.randrange(world), 128 * rng.randrange(1, 64), 128 * rng.randrange(1, 64))
        assert key.unproducible_reason() is None
        for change in (dict(seed=key.seed ^ 1), dict(tp_rank=world), dict(model_identity=key.model_identity.upper()),
                       dict(encoder_identity=key.encoder_identity[:63]), dict(input_size=key.input_size + 16),
                       dict(apply_out_scales=False), dict(bits=9)):
            assert dataclasses.replace(key, **change).unproducible_reason(), change
