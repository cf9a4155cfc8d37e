"""CacheStore.claim / publish_claimed: the locked half of load_or_encode, usable across threads."""

from __future__ import annotations

import threading

import pytest
from filelock import FileLock

from exl3tool.cache import CacheKey, CacheStore, Claim, lock_path

from helpers import ENCODER_ID, MODEL_ID, make_encoded, server_lookup


def key_for(prefix="model.layers.0.mlp.down_proj") -> CacheKey:
    return CacheKey.for_layer(MODEL_ID, ENCODER_ID, prefix, 6, 1, 0, 128, 256)


def lock_is_free(store: CacheStore, key: CacheKey) -> bool:
    try:
        with FileLock(str(lock_path(store.path(key))), timeout=0):
            return True
    except TimeoutError:
        return False


def test_claim_then_publish_from_another_thread_releases_the_lock(tmp_path):
    store, key = CacheStore(tmp_path), key_for()
    claimed = store.claim(key, cross_thread=True)
    assert isinstance(claimed, Claim) and claimed.held and not lock_is_free(store, key)
    box = {}
    t = threading.Thread(target=lambda: box.update(res=store.publish_claimed(claimed, make_encoded())))
    t.start()
    t.join(30)
    res = box["res"]
    assert not res.hit and res.path == store.path(key) and not claimed.held and lock_is_free(store, key)
    assert server_lookup(tmp_path, MODEL_ID, ENCODER_ID, key.prefix, 6, 1, 0, 128, 256) is not None
    again = store.claim(key)  # published meanwhile: a hit, lock released
    assert not isinstance(again, Claim) and again.hit and lock_is_free(store, key)


def test_failed_publish_releases_and_returns_the_encode(tmp_path, monkeypatch):
    import exl3tool.cache.store as store_mod

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(store_mod, "write_entry", boom)
    store, key = CacheStore(tmp_path), key_for()
    claimed = store.claim(key)
    res = store.publish_claimed(claimed, make_encoded())
    assert res.path is None and res.encoded is not None and lock_is_free(store, key)
    with pytest.raises(ValueError, match="already released"):
        store.publish_claimed(claimed, make_encoded())
    claimed.release()  # idempotent


def test_claim_needs_readwrite(tmp_path):
    with pytest.raises(ValueError, match="readwrite"):
        CacheStore(tmp_path, "readonly").claim(key_for())
