"""Nothing written through a symlink below the cache root, and what killed writers leave (issue 38).

A symlinked ``v1/<model id>`` pointing outside the root: import, warm (and its dry run) write nothing through it and
say why; ``cache verify`` reports the link (exit 1); ``cache prune --invalid`` removes the link, never its target.
A writer killed with SIGKILL while it held an entry lock and had a temp file open: ``cache verify`` counts the temp
file and the stale lock; ``cache prune --temp`` removes them, and never the files a live writer holds.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ENC, TINY, CliRunner, fake_warm, tree

from exl3tool.cache import CacheStore, lock_path
from exl3tool.checkpoint.synthetic import write_llama_checkpoint
from exl3tool.cli import _register, app
from exl3tool.plan import ServerRequest, prepare
from seeds import fresh_seed

_register()
runner = CliRunner()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_llama_checkpoint(tmp_path_factory.mktemp("links") / "m", **TINY,
                                  seed=fresh_seed(), shards=1)


def _request(model, cache, **kw) -> ServerRequest:
    return ServerRequest(model=str(model), tp_sizes=(1,), cache_dir=str(cache), device="cpu", **ENC, **kw)


def _linked_cache(tmp_path: Path, model_id: str) -> tuple[Path, Path]:
    """A cache root whose ``v1/<model id[:20]>`` is a symlink to a folder outside the root."""
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    (root / "v1").mkdir(parents=True)
    (root / "v1" / model_id[:20]).symlink_to(outside, target_is_directory=True)
    return root, outside


def test_nothing_is_written_through_a_symlinked_model_folder(model, tmp_path, monkeypatch):
    source = tmp_path / "source"
    warmed = fake_warm(_request(model, source), monkeypatch)
    bundle = tmp_path / "b.tar"
    res = runner.invoke(app, ["cache", "export", str(bundle), "--cache-dir", str(source), "--json"])
    assert res.exit_code == 0, res.output
    root, outside = _linked_cache(tmp_path, warmed.model_identity)
    link = root / "v1" / warmed.model_identity[:20]

    res = runner.invoke(app, ["cache", "import", str(bundle), "--cache-dir", str(root), "--json"])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    assert doc["imported"] == 0 and doc["refused"] == len(warmed.entries) + 1  # and the record: no entry of its came in
    assert all("is a symlink" in e["reason"] and str(link) in e["reason"] for e in doc["entries"])
    assert tree(outside) == {}  # no entry, temp file, lock or folder through the link

    _, plan, _ = prepare(_request(model, root))  # the dry run
    assert {j.state for j in plan.jobs} == {"invalid"} and all("is a symlink" in j.reason for j in plan.jobs)
    summary = fake_warm(_request(model, root), monkeypatch)
    assert summary.counts["failed"] == len(summary.entries) and summary.counts["encoded"] == 0
    assert all("is a symlink" in e.error and "not encoded" not in e.error.split("symlink")[0] for e in summary.entries)
    assert tree(outside) == {}

    res = runner.invoke(app, ["cache", "verify", "--cache-dir", str(root), "--json"])
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert [i["path"] for i in doc["links"]] == [str(link)] and doc["links"][0]["status"] == "invalid"
    assert "symlinked folder" in str(res.exception)

    res = runner.invoke(app, ["cache", "prune", "--invalid", "--yes", "--cache-dir", str(root)])
    assert res.exit_code == 0, res.output
    assert not link.exists() and not link.is_symlink() and outside.is_dir()  # the link went, its target stays
    again = fake_warm(_request(model, root), monkeypatch)
    assert again.counts["encoded"] == len(again.entries) and tree(outside) == {}
    assert not (root / "v1" / warmed.model_identity[:20]).is_symlink()


def test_a_symlinked_records_folder_is_not_written_through(model, tmp_path, monkeypatch):
    from exl3tool.cache.records import RECORDS_DIR

    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    root.mkdir()
    (root / RECORDS_DIR).symlink_to(outside, target_is_directory=True)
    summary = fake_warm(_request(model, root), monkeypatch)
    assert summary.counts["encoded"] == len(summary.entries)  # entries are fine; the record is refused
    assert summary.record is None and "symlink" in summary.record_error
    assert tree(outside) == {}


_WRITER = textwrap.dedent("""
    import fcntl, os, sys, time
    entry = sys.argv[1]
    fd = os.open(entry + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    d, name = os.path.split(entry)
    with open(os.path.join(d, "." + name + ".k1ll3d.tmp"), "wb") as fh:
        fh.write(os.urandom(4096))
        fh.flush()
        print("writing", flush=True)
        time.sleep(600)
""")


def _writer(entry: Path) -> subprocess.Popen:
    """A writer as the server or a warm is one: entry lock held, temp file half written."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(entry)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    return proc


def test_verify_counts_what_a_kill_leaves_and_prune_temp_removes_only_that(tmp_path):
    root = tmp_path / "cache"
    folder = root / "v1" / ("3f" * 10) / "tp1-rank0"
    folder.mkdir(parents=True)
    rng = random.Random(fresh_seed())
    killed, live = (folder / f"{rng.randbytes(32).hex()}.safetensors" for _ in range(2))
    victim, holder = _writer(killed), _writer(live)
    try:
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        res = runner.invoke(app, ["cache", "verify", "--cache-dir", str(root), "--json"])
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        temps = {Path(t["path"]).name.split(".")[1]: t["held"] for t in doc["temp_files"]}
        assert temps == {killed.name.split(".")[0]: False, live.name.split(".")[0]: True}
        assert [Path(s["path"]) for s in doc["stale_locks"]] == [lock_path(killed)]
        assert len(doc["orphan_locks"]) == 2
        text = runner.invoke(app, ["cache", "verify", "--cache-dir", str(root)]).output
        assert "2 leftover temp files (1 held by a live writer)" in text and "1 stale" in text

        res = runner.invoke(app, ["cache", "prune", "--temp", "--yes", "--cache-dir", str(root), "--json"])
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        assert sorted(Path(p["path"]).name for p in doc["planned"]) == sorted(
            [f".{killed.name}.k1ll3d.tmp", lock_path(killed).name])
        assert {Path(p["path"]).name for p in doc["skipped"]} == {f".{live.name}.k1ll3d.tmp", lock_path(live).name}
        left = sorted(os.listdir(folder))
        assert left == sorted([f".{live.name}.k1ll3d.tmp", lock_path(live).name])  # the live writer's files stay
        assert CacheStore(root).lookup  # the cache stays usable
    finally:
        for proc in (victim, holder):
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
