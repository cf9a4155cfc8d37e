"""CacheStore: round trip, the independent server look-up, per-mode semantics, bad entries, publish failures."""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from exl3tool.cache import CacheKey, CacheStore, Exl3OnlineNonFiniteError, entry_path, lock_path, scan
from exl3tool.cache.entry import write_entry
from exl3tool.cache.scan import execute_prune, plan_prune

from helpers import ENCODER_ID, MODEL_ID, make_encoded, server_lookup, tree

K, N, BITS = 128, 256, 6


def key_for(prefix="model.layers.0.mlp.down_proj", world=2, rank=1, k=K, n=N, bits=BITS) -> CacheKey:
    return CacheKey.for_layer(MODEL_ID, ENCODER_ID, prefix, bits, world, rank, k, n)


class Counter:
    """An encode_fn that counts its calls."""

    def __init__(self, enc=None):
        self.calls = 0
        self.enc = enc or make_encoded(K, N, BITS)

    def __call__(self):
        self.calls += 1
        return self.enc


def test_round_trip_and_server_finds_every_entry(tmp_path):
    store = CacheStore(tmp_path, "readwrite")
    layers = [("model.layers.0.self_attn.qkv_proj", 256, 384), ("model.layers.0.self_attn.o_proj", 128, 256),
              ("language_model.model.layers.3.mlp.gate_up_proj", 128, 512)]
    for i, (prefix, k, n) in enumerate(layers):
        for world in (1, 2):
            for rank in range(world):
                key = CacheKey.for_layer(MODEL_ID, ENCODER_ID, prefix, BITS, world, rank, k, n)
                enc = make_encoded(k, n, BITS, seed=i * 10 + rank, proxy_error=[0.125, 1e-05, 3.0][i])
                count = Counter(enc)
                first = store.load_or_encode(key, count)
                assert not first.hit and first.path == entry_path(key, tmp_path) and first.encoded is enc
                second = store.load_or_encode(key, count)
                assert second.hit and count.calls == 1 and second.proxy_error == enc.proxy_error
                for name, t in enc.tensors().items():
                    assert torch.equal(second.tensors[name], t)
                found = server_lookup(tmp_path, MODEL_ID, ENCODER_ID, prefix, BITS, world, rank, k, n)
                assert found is not None, prefix
                tensors, proxy_error = found
                assert proxy_error == enc.proxy_error
                assert (tensors["trellis"] == enc.trellis.numpy()).all()
                meta_pe = __import__("safetensors").safe_open(str(first.path), "np").metadata()["proxy_error"]
                assert meta_pe == repr(enc.proxy_error)
                assert stat.S_IMODE(os.stat(first.path).st_mode) == 0o600
                assert lock_path(first.path).exists()
    infos = scan(tmp_path)
    assert all(i.status == "valid" and i.sha256_ok for i in infos if i.kind == "entry")
    assert sum(i.kind == "entry" for i in infos) == 9


def test_file_mode_for_another_user(tmp_path):
    store = CacheStore(tmp_path, "readwrite", file_mode=0o644)
    path = store.publish(key_for(), make_encoded())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    with pytest.raises(ValueError, match="world-writable"):
        CacheStore(tmp_path, file_mode=0o666)


@pytest.mark.parametrize("where", ["suh", "svh", "proxy_error"])
@pytest.mark.parametrize("mode", ["off", "readonly", "readwrite"])
def test_non_finite_encode_raises_and_publishes_nothing(tmp_path, where, mode):
    enc = make_encoded()
    if where == "proxy_error":
        enc = type(enc)(**{**enc.__dict__, "proxy_error": math.nan})
    else:
        bad = getattr(enc, where).clone()
        bad[3] = math.inf if where == "svh" else math.nan
        enc = type(enc)(**{**enc.__dict__, where: bad})
    store = CacheStore(tmp_path, mode)
    with pytest.raises(Exl3OnlineNonFiniteError, match="non-finite"):
        store.load_or_encode(key_for(), lambda: enc)
    with pytest.raises(Exl3OnlineNonFiniteError):
        store.publish(key_for(), enc)
    assert not any(p.is_file() and p.suffix == ".safetensors" for p in tmp_path.rglob("*"))
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("results,calls,ok", [(["nan", "good"], 2, True), (["nan", "nan"], 2, False)])
def test_retry_once_after_non_finite(tmp_path, results, calls, ok):
    good = make_encoded()
    bad = type(good)(**{**good.__dict__, "proxy_error": math.nan})
    seq = iter([good if r == "good" else bad for r in results])
    count = {"n": 0}

    def encode():
        count["n"] += 1
        return next(seq)

    store = CacheStore(tmp_path)
    if ok:
        res = store.load_or_encode_with_retry(key_for(), encode)
        assert res.proxy_error == 0.125 and res.path is not None
    else:
        with pytest.raises(Exl3OnlineNonFiniteError):
            store.load_or_encode_with_retry(key_for(), encode)
        assert not list(tmp_path.rglob("*.safetensors"))
    assert count["n"] == calls


def test_wrong_encode_shape_is_a_plain_value_error(tmp_path):
    with pytest.raises(ValueError, match="trellis int16\\[16, 16, 96\\], expected int16\\[8, 16, 96\\]") as exc:
        CacheStore(tmp_path).load_or_encode(key_for(), lambda: make_encoded(k=256))
    assert not isinstance(exc.value, Exl3OnlineNonFiniteError)


def test_readonly_never_changes_the_tree(tmp_path):
    rw = CacheStore(tmp_path, "readwrite")
    good, bad, missing = key_for("a"), key_for("b"), key_for("c")
    rw.publish(good, make_encoded())
    bad_path = entry_path(bad, tmp_path)
    bad_path.write_bytes(b"garbage")
    before = tree(tmp_path)
    ro = CacheStore(tmp_path, "readonly")
    assert ro.load_or_encode(good, Counter()).hit
    for key in (bad, missing):
        count = Counter()
        res = ro.load_or_encode(key, count)
        assert not res.hit and res.path is None and count.calls == 1
    assert ro.lookup(bad).status == "invalid" and ro.lookup(missing).status == "miss"
    assert tree(tmp_path) == before
    # readonly on a root that does not exist creates nothing
    ro2 = CacheStore(tmp_path / "nope", "readonly")
    ro2.load_or_encode(missing, Counter())
    assert not (tmp_path / "nope").exists()


def test_off_never_touches_the_cache(tmp_path, monkeypatch):
    key = key_for()
    path = entry_path(key, tmp_path)
    CacheStore(tmp_path).publish(key, make_encoded())
    before = tree(tmp_path)
    import exl3tool.cache.store as store_mod

    monkeypatch.setattr(store_mod, "judge_entry", lambda *a, **k: pytest.fail("off mode read an entry"))
    count = Counter()
    res = CacheStore(tmp_path, "off").load_or_encode(key, count)
    assert not res.hit and res.path is None and count.calls == 1
    assert CacheStore(tmp_path, "off").lookup(key).status == "miss"
    assert tree(tmp_path) == before and path.is_file()
    CacheStore(tmp_path / "absent", "off").load_or_encode(key, Counter())
    assert not (tmp_path / "absent").exists()


def test_unwritable_root_falls_back_uncached(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    count = Counter()
    res = CacheStore(blocker / "cache", "readwrite").load_or_encode(key_for(), count)
    assert not res.hit and res.path is None and count.calls == 1


def _unsearchable_outcome(root: Path, key: CacheKey, mode: str) -> str:
    """Run a look-up where a directory on the path is not searchable; as root, drop to 'nobody' in a child."""
    d = root / "v1"
    d.chmod(0o700 if os.geteuid() == 0 else 0)
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        if os.geteuid() == 0:
            os.setgid(65534)
            os.setuid(65534)
        try:
            CacheStore(root, mode).load_or_encode(key, Counter())
            q.put("no error")
        except Exception as exc:
            q.put(type(exc).__name__)

    p = ctx.Process(target=child)
    p.start()
    p.join(30)
    d.chmod(0o755)
    return q.get(timeout=5)


@pytest.mark.parametrize("mode", ["readonly", "readwrite"])
def test_unsearchable_directory_propagates(tmp_path, mode):
    """docs/cache-format.md §1.5: the first is_file() is unprotected; EACCES aborts loading instead of becoming a miss."""
    root = tmp_path / "cache"
    root.mkdir()
    tmp_path.chmod(0o755)
    key = key_for()
    CacheStore(root).publish(key, make_encoded())
    assert _unsearchable_outcome(root, key, mode) == "PermissionError"


def test_publish_failure_returns_the_encode(tmp_path, monkeypatch):
    import exl3tool.cache.store as store_mod

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(store_mod, "write_entry", boom)
    res = CacheStore(tmp_path).load_or_encode(key_for(), Counter())
    assert not res.hit and res.path is None and res.proxy_error == 0.125 and res.encoded is not None


def test_lock_timeout_encodes_uncached(tmp_path):
    from filelock import FileLock

    key = key_for()
    path = entry_path(key, tmp_path)
    path.parent.mkdir(parents=True)
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()

    def hold():
        with FileLock(str(lock_path(path))):
            ready.set()
            done.wait(10)

    p = ctx.Process(target=hold)
    p.start()
    try:
        assert ready.wait(10)
        count = Counter()
        res = CacheStore(tmp_path, lock_timeout=0.2).load_or_encode(key, count)
        assert not res.hit and res.path is None and count.calls == 1 and not path.exists()
    finally:
        done.set()
        p.join(10)


def test_lock_is_taken_with_600_s_timeout(tmp_path, monkeypatch):
    import exl3tool.cache.store as store_mod

    seen = {}
    real = store_mod.FileLock

    def spy(path, timeout, mode):
        seen.update(path=path, timeout=timeout, mode=mode)
        return real(path, timeout=timeout, mode=mode)

    monkeypatch.setattr(store_mod, "FileLock", spy)
    res = CacheStore(tmp_path).load_or_encode(key_for(), Counter())
    assert seen["timeout"] == 600.0 and seen["path"] == f"{res.path}.lock"
    assert stat.S_IMODE(os.stat(seen["path"]).st_mode) & 0o022 == 0  # never group/world-writable


# ---- bad entries ---------------------------------------------------------------------------------------------


def _write_raw(path: Path, tensors: dict, key_json: str, proxy_error: str = "0.5") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"cache_key": key_json, "proxy_error": proxy_error})


def _good(k=K, n=N):
    return make_encoded(k, n).tensors()


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt(kind: str, path: Path, key: CacheKey, tmp_path: Path) -> None:
    kj = key.canonical_json()
    t = _good()
    if kind == "truncated":
        write_entry(path, key, t, 0.5)
        path.write_bytes(path.read_bytes()[:-100])
    elif kind == "header_flip":
        write_entry(path, key, t, 0.5)
        _flip(path, 8 + 20)  # inside the JSON header
    elif kind == "data_flip":
        write_entry(path, key, t, 0.5)
        (hlen,) = struct.unpack("<Q", path.read_bytes()[:8])
        _flip(path, path.stat().st_size - 7)  # last bytes: trellis data (server would still load it)
    elif kind == "wrong_key":
        _write_raw(path, t, key_for(prefix="other").canonical_json())
    elif kind == "pretty_key":
        _write_raw(path, t, json.dumps(key.as_dict(), sort_keys=True))
    elif kind == "wrong_shape":
        _write_raw(path, {**t, "trellis": t["trellis"].transpose(0, 1).contiguous()}, kj)
    elif kind == "wrong_dtype_suh":
        _write_raw(path, {**t, "suh": t["suh"].float()}, kj)
    elif kind == "u16_trellis":
        _write_raw(path, {**t, "trellis": t["trellis"].view(torch.uint16)}, kj)
    elif kind == "extra_tensor":
        _write_raw(path, {**t, "mcg": torch.zeros(1)}, kj)
    elif kind == "missing_tensor":
        _write_raw(path, {n: v for n, v in t.items() if n != "svh"}, kj)
    elif kind in ("nan_suh", "inf_svh"):
        name = "suh" if kind == "nan_suh" else "svh"
        bad = t[name].clone()
        bad[0] = math.nan if name == "suh" else -math.inf
        write_entry(path, key, {**t, name: bad}, 0.5)
    elif kind == "nan_proxy":
        _write_raw(path, t, kj, proxy_error="nan")
    elif kind == "text_proxy":
        _write_raw(path, t, kj, proxy_error="abc")
    elif kind == "not_safetensors":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not a safetensors file at all")
    else:
        raise AssertionError(kind)


BAD_KINDS = ["truncated", "header_flip", "data_flip", "wrong_key", "pretty_key", "wrong_shape", "wrong_dtype_suh",
             "u16_trellis", "extra_tensor", "missing_tensor", "nan_suh", "inf_svh", "nan_proxy", "text_proxy",
             "not_safetensors"]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_entry_never_hits_is_reported_and_replaced(tmp_path, kind):
    key = key_for()
    path = entry_path(key, tmp_path)
    _corrupt(kind, path, key, tmp_path)
    assert CacheStore(tmp_path, "readonly").lookup(key).status == "invalid"
    infos = [i for i in scan(tmp_path) if i.kind == "entry"]
    assert len(infos) == 1 and infos[0].status == "invalid" and infos[0].reason
    count = Counter()
    res = CacheStore(tmp_path, "readwrite").load_or_encode(key, count)
    assert not res.hit and res.path == path and count.calls == 1
    assert CacheStore(tmp_path, "readonly").load_or_encode(key, count).hit and count.calls == 1
    assert server_lookup(tmp_path, MODEL_ID, ENCODER_ID, key.prefix, BITS, 2, 1, K, N) is not None


def test_symlinked_entries(tmp_path):
    """Decision (docs/cache-format.md §5.3 follows symlinks): a link to a valid file is a hit, as on the server; verify warns.

    A dangling link is a miss; readwrite publishes over the link itself (os.replace replaces the link).
    """
    key = key_for()
    path = entry_path(key, tmp_path)
    elsewhere = tmp_path / "elsewhere.safetensors"
    write_entry(elsewhere, key, _good(), 0.5)
    path.parent.mkdir(parents=True)
    os.symlink(elsewhere, path)
    assert CacheStore(tmp_path, "readonly").lookup(key).hit
    info = [i for i in scan(tmp_path) if i.kind == "entry"][0]
    assert info.status == "valid" and info.is_symlink
    path.unlink()
    os.symlink(tmp_path / "gone", path)
    assert CacheStore(tmp_path, "readonly").lookup(key).status == "miss"
    assert [i for i in scan(tmp_path) if i.kind == "entry"][0].status == "invalid"
    res = CacheStore(tmp_path).load_or_encode(key, Counter())
    assert res.path == path and path.is_file() and not path.is_symlink()


def test_directory_at_entry_path(tmp_path):
    """Like the server: a directory is a miss, publishing over it fails (uncached); verify reports, prune removes."""
    key = key_for()
    path = entry_path(key, tmp_path)
    (path / "inner").mkdir(parents=True)
    assert CacheStore(tmp_path, "readonly").lookup(key).status == "miss"
    res = CacheStore(tmp_path).load_or_encode(key, Counter())
    assert not res.hit and res.path is None
    assert not list(path.parent.glob(".*.tmp"))
    infos = scan(tmp_path)
    entry = [i for i in infos if i.kind == "entry"][0]
    assert entry.status == "invalid" and "directory" in entry.reason
    execute_prune(plan_prune(infos, invalid=True))
    assert not path.exists()
    assert CacheStore(tmp_path).load_or_encode(key, Counter()).path == path


def test_checksum_is_stricter_than_the_server(tmp_path):
    key = key_for()
    path = entry_path(key, tmp_path)
    _corrupt("data_flip", path, key, tmp_path)
    assert server_lookup(tmp_path, MODEL_ID, ENCODER_ID, key.prefix, BITS, 2, 1, K, N) is not None  # the server loads it
    assert CacheStore(tmp_path, "readonly").lookup(key).status == "invalid"
    assert CacheStore(tmp_path, "readonly", verify_checksum=False).lookup(key).hit


@pytest.mark.parametrize("text,value", [("", None), (" 1e-3 ", 1e-3), (None, None)])
def test_proxy_error_forms_that_hit(tmp_path, text, value):
    key = key_for()
    path = entry_path(key, tmp_path)
    meta = {"cache_key": key.canonical_json(), "other": "x"}
    if text is not None:
        meta["proxy_error"] = text
    path.parent.mkdir(parents=True)
    save_file(_good(), str(path), metadata=meta)
    found = CacheStore(tmp_path, "readonly").lookup(key)
    assert found.hit and found.proxy_error == value


def test_prune_plan_keeps_live_locks(tmp_path):
    store = CacheStore(tmp_path)
    good, bad = key_for("good"), key_for("bad")
    store.load_or_encode(good, Counter())
    store.load_or_encode(bad, Counter())
    entry_path(bad, tmp_path).write_bytes(b"junk")
    (entry_path(good, tmp_path).parent / f".{good.digest()}.safetensors.abc123.tmp").write_bytes(b"x" * 10)
    (entry_path(good, tmp_path).parent / f"{'e' * 64}.safetensors.lock").touch()
    plan = plan_prune(scan(tmp_path), invalid=True, temp=True)
    names = sorted(i.path.name for i, _ in plan.items)
    assert entry_path(bad, tmp_path).name in names and lock_path(entry_path(bad, tmp_path)).name in names
    assert f"{'e' * 64}.safetensors.lock" in names and any(n.endswith(".tmp") for n in names)
    assert lock_path(entry_path(good, tmp_path)).name not in names
    assert entry_path(good, tmp_path).name not in names
    execute_prune(plan)
    assert lock_path(entry_path(good, tmp_path)).exists() and entry_path(good, tmp_path).exists()
    assert not entry_path(bad, tmp_path).exists()


def test_a_fifo_lock_path_is_a_usable_lock_for_scan_store_and_prune(tmp_path):
    """filelock locks a FIFO like a file: scan must not call it invalid, the store publishes through it."""
    key = key_for("fifo")
    path = entry_path(key, tmp_path)
    path.parent.mkdir(parents=True)
    os.mkfifo(lock_path(path))
    res = CacheStore(tmp_path).load_or_encode(key, Counter())
    assert res.path == path and stat.S_ISFIFO(os.lstat(lock_path(path)).st_mode)
    lock = [i for i in scan(tmp_path) if i.kind == "lock"][0]
    assert lock.status != "invalid" and not lock.reason
    assert not plan_prune(scan(tmp_path), invalid=True, temp=True).items


def test_prune_keeps_an_entry_republished_after_the_plan(tmp_path):
    """Plan: the entry is invalid. Before the deletion a writer publishes a valid one: it stays."""
    store = CacheStore(tmp_path)
    key = key_for("republished")
    store.load_or_encode(key, Counter())
    path = entry_path(key, tmp_path)
    path.write_bytes(b"junk")
    plan = plan_prune(scan(tmp_path), invalid=True)
    assert [i.path for i, _ in plan.items if i.kind == "entry"] == [path]
    store.load_or_encode(key, Counter())  # invalid -> re-encoded and published over it
    done = execute_prune(plan)
    assert done.freed == 0 and not done.errors and len(done.kept) == 2  # the entry and its lock
    assert "changed since the plan" in done.kept[0]
    assert CacheStore(tmp_path, "readonly").lookup(key).hit


def test_prune_keeps_a_lock_taken_after_the_plan(tmp_path):
    from filelock import FileLock

    orphan = entry_path(key_for("orphan"), tmp_path)
    orphan.parent.mkdir(parents=True)
    lock_path(orphan).touch()
    plan = plan_prune(scan(tmp_path), temp=True)
    assert [i.path for i, _ in plan.items] == [lock_path(orphan)]
    with FileLock(str(lock_path(orphan)), timeout=0):
        done = execute_prune(plan)
    assert done.kept and "held" in done.kept[0] and lock_path(orphan).exists()
    assert execute_prune(plan).freed == 0 and not lock_path(orphan).exists()  # free again: removed


@pytest.mark.parametrize("failure", [MemoryError(), OSError(5, "Input/output error")])
def test_claim_keeps_an_entry_it_could_not_read(tmp_path, monkeypatch, failure):
    """Out of memory or EIO while re-checking under the lock says nothing about the file: it stays."""
    store = CacheStore(tmp_path)
    key = key_for("unreadable-now")
    store.load_or_encode(key, Counter())
    path = entry_path(key, tmp_path)
    before = path.read_bytes()

    def broken(*a, **k):
        raise failure

    monkeypatch.setattr(store, "_load", broken)
    with pytest.raises(type(failure)):
        store.claim(key)
    assert path.read_bytes() == before
    monkeypatch.undo()
    assert CacheStore(tmp_path, "readonly").lookup(key).hit
    _assert_lock_free(path)


def _assert_lock_free(path: Path) -> None:
    from filelock import FileLock

    with FileLock(str(lock_path(path)), timeout=0):
        pass
