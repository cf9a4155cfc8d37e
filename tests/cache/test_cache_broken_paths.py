"""Broken entry paths that no warm can repair, and a killed writer's temp files (issue 14).

A directory at an entry path, or a directory or symlink at its ``.lock`` path, used to make every warm fail that
layer with "publishing failed (lock timeout or OS error)" after a wasted encode, the cause only on stderr, and
``cache verify`` said nothing about a lock path. Now the warm names the cause and the fix without encoding,
``cache verify`` reports it and ``cache prune --invalid`` removes it, never following a link out of the cache.
A FIFO at an entry path is replaced by the publish. A warm that holds an entry's lock removes that entry's
stale temp files.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import ENC, ENCODER_ID, MODEL_ID, TINY, CliRunner, fake_warm, make_encoded

from exl3tool.cache import CacheKey, CacheStore, lock_path, scan
from exl3tool.checkpoint.synthetic import write_llama_checkpoint
from exl3tool.cli import _register, app
from exl3tool.plan import ServerRequest, prepare
from seeds import fresh_bytes


_register()
BROKEN = ("directory at entry", "directory at lock", "symlink at lock", "dangling symlink at lock")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_llama_checkpoint(tmp_path_factory.mktemp("broken") / "m", **TINY, seed=12, shards=1)


def _request(model, cache) -> ServerRequest:
    return ServerRequest(model=str(model), tp_sizes=(2,), layers=("*.o_proj",), cache_dir=str(cache), device="cpu", **ENC)


def _break(path, kind: str, outside) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = lock_path(path)
    if kind == "directory at entry":
        path.mkdir()
        (path / "inside").write_text("x")
    elif kind == "directory at lock":
        lock.mkdir()
    elif kind == "symlink at lock":
        lock.symlink_to(outside)
    elif kind == "dangling symlink at lock":
        lock.symlink_to(outside.parent / "nowhere")
    elif kind == "fifo at entry":
        os.mkfifo(path)


def cli(*args):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("overlap", [True, False])
def test_unrepairable_entries_name_the_cause_and_the_fix(model, tmp_path, monkeypatch, overlap):
    """o_proj of both layers at TP 2 (4 jobs): each of the 4 breaks on one job; no encode is wasted on them."""
    cache, outside = tmp_path / "cache", tmp_path / "outside.txt"
    outside.write_text("not the cache's")
    _, plan, _ = prepare(_request(model, cache))
    broken = dict(zip((j.digest for j in plan.jobs), BROKEN))
    for j in plan.jobs:
        _break(j.path, broken[j.digest], outside)

    _, plan, _ = prepare(_request(model, cache))  # the dry-run's plan says so before any encode
    assert {j.state for j in plan.jobs} == {"invalid"}
    assert all("cache prune --invalid" in j.reason for j in plan.jobs)

    calls: list = []
    summary = fake_warm(ServerRequest(**{**_request(model, cache).__dict__, "overlap": overlap}), monkeypatch, calls)
    assert summary.counts["failed"] == 4 and calls == []  # nothing encoded for nothing
    for e in summary.entries:
        kind = broken[e.digest]
        assert "publishing failed (lock timeout or OS error" not in e.error
        assert "exl3tool cache prune --invalid" in e.error, e.error
        where = "the entry's lock path" if "lock" in kind else "where the entry file should be"
        what = "a symlink" if "symlink" in kind else "a directory"
        assert where in e.error and what in e.error, (kind, e.error)

    res = cli("cache", "verify", "--cache-dir", str(cache), "--json")
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert len(doc["broken_locks"]) == 3 and len(doc["invalid"]) == 1
    assert {b["reason"].split(";")[0] for b in doc["broken_locks"]} >= {"the lock path is a directory"}
    assert "cache prune --invalid" in str(res.exception)  # FindingsError, exit 1 through main()

    res = cli("cache", "prune", "--invalid", "--yes", "--cache-dir", str(cache))
    assert res.exit_code == 0, res.output
    assert outside.read_text() == "not the cache's"  # the link went, never its target
    assert not (outside.parent / "nowhere").exists()
    assert not [i for i in scan(cache) if i.status == "invalid"]

    summary = fake_warm(_request(model, cache), monkeypatch)
    assert summary.counts == {"hit": 0, "encoded": 4, "skipped": 0, "failed": 0}


def test_a_valid_entry_next_to_a_broken_lock_stays_a_hit(model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    assert fake_warm(_request(model, cache), monkeypatch).counts["encoded"] == 4
    _, plan, _ = prepare(_request(model, cache))
    lock = lock_path(plan.jobs[0].path)
    lock.unlink(missing_ok=True)
    lock.mkdir()
    assert fake_warm(_request(model, cache), monkeypatch).counts == {"hit": 4, "encoded": 0, "skipped": 0, "failed": 0}
    res = cli("cache", "verify", "--cache-dir", str(cache), "--json")
    assert res.exit_code == 1 and len(json.loads(res.stdout)["broken_locks"]) == 1


def test_fifo_at_the_entry_path_is_replaced(model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    _, plan, _ = prepare(_request(model, cache))
    _break(plan.jobs[0].path, "fifo at entry", tmp_path)
    res = cli("cache", "verify", "--cache-dir", str(cache), "--json")
    assert res.exit_code == 1 and json.loads(res.stdout)["invalid"][0]["reason"] == "not a regular file"
    assert fake_warm(_request(model, cache), monkeypatch).counts["encoded"] == 4
    assert plan.jobs[0].path.is_file()


def test_symlinked_directory_is_never_entered_by_prune(tmp_path):
    """A symlinked model directory pointing outside the cache: listed as stray, its files untouched by prune."""
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    key = CacheKey.for_layer(MODEL_ID, ENCODER_ID, "model.layers.0.mlp.down_proj", 6, 1, 0, 128, 256)
    other = CacheStore(elsewhere)
    path = other.publish(key, make_encoded())
    path.write_bytes(b"junk")  # invalid, and not ours to delete
    (cache / "v1").mkdir(parents=True)
    (cache / "v1" / MODEL_ID[:20]).symlink_to(elsewhere / "v1" / MODEL_ID[:20])
    infos = scan(cache)
    assert [(i.kind, i.is_symlink) for i in infos] == [("stray", True)]
    res = cli("cache", "prune", "--invalid", "--temp", "--yes", "--cache-dir", str(cache))
    assert res.exit_code == 0 and path.read_bytes() == b"junk"


def test_warm_holding_the_lock_removes_that_entrys_stale_temps(model, tmp_path, monkeypatch):
    """Temps of a killed writer (its entry missing) go once a warm holds the entry lock; others' temps stay."""
    cache = tmp_path / "cache"
    _, plan, _ = prepare(_request(model, cache))
    job, other = plan.jobs[0], plan.jobs[1]
    job.path.parent.mkdir(parents=True, exist_ok=True)
    stale = [job.path.parent / f".{job.digest}.safetensors.{r}.tmp" for r in ("k1ll3d_", "x9abcdef")]
    for t in stale:
        t.write_bytes(b"half an entry")
    unrelated = job.path.parent / f".{'0' * 64}.safetensors.abcd1234.tmp"
    unrelated.write_bytes(b"someone else's")
    summary = fake_warm(ServerRequest(**{**_request(model, cache).__dict__, "layers": (job.prefix,)}), monkeypatch)
    assert summary.counts["encoded"] == 2
    assert not any(t.exists() for t in stale)
    assert unrelated.exists()  # not this warm's lock: may belong to a live writer
    assert other.path.exists()


def test_store_removes_stale_temps_under_the_lock_only(tmp_path):
    store = CacheStore(tmp_path)
    key = CacheKey.for_layer(MODEL_ID, ENCODER_ID, "model.layers.0.mlp.down_proj", 6, 1, 0, 128, 256)
    path = store.path(key)
    path.parent.mkdir(parents=True)
    temp = path.parent / f".{path.name}.abc123.tmp"
    temp.write_bytes(b"x")
    assert store.lookup(key).status == "miss" and temp.exists()  # look-ups take no lock: they leave it
    store.load_or_encode(key, make_encoded)
    assert not temp.exists() and store.lookup(key).hit


def test_dry_run_names_a_broken_lock_path_when_the_entry_is_also_invalid(model, tmp_path, monkeypatch):
    """An invalid entry beside a directory at its lock path: the plan shows the lock path (what the warm fails
    the job on), not a plain re-encode."""
    cache = tmp_path / "cache"
    _, plan, _ = prepare(_request(model, cache))
    job = plan.jobs[0]
    job.path.parent.mkdir(parents=True, exist_ok=True)
    job.path.write_bytes(fresh_bytes(64))  # an invalid entry
    lock_path(job.path).mkdir()
    res = cli("cache", "warm", str(model), "--tp-size", "2", "--layers", "*.o_proj", "--cache-dir", str(cache),
              "--encoder-root", ENC["encoder_root"], "--encoder-revision", ENC["encoder_revision"], "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    row = next(j for j in json.loads(res.stdout)["jobs"] if j["digest"] == job.digest)
    assert row["state"] == "invalid"
    assert f"{lock_path(job.path)} (the entry's lock path) is a directory" in row["reason"]
    assert "also invalid" in row["reason"] and "cache prune --invalid" in row["reason"]
    summary = fake_warm(_request(model, cache), monkeypatch)
    failed = next(e for e in summary.entries if e.digest == job.digest)
    assert failed.status == "failed" and row["reason"].split(" (the entry is also")[0] in failed.error
