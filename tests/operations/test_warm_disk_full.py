"""A full disk costs a second, not every layer's encode: the free space is checked against the bytes the plan
writes before the first encode (exit 2 with both figures), and the first ENOSPC during a warm stops encoding:
the jobs left fail at once with one message, and what was published stays."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exl3tool.cache import scan
from exl3tool.cache.entry import entry_bytes
from exl3tool.checkpoint.synthetic import write_llama_checkpoint
from exl3tool.cli import main
from exl3tool.plan import ServerRequest, prepare
from exl3tool.operations.warm import run_plan

from helpers import ENC, ENC_ARGS, TINY_1, fake_encode, refuse_encodes
from seeds import fresh_seed


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("disk") / "tiny"
    write_llama_checkpoint(path, **TINY_1,
                           seed=fresh_seed(), shards=1)
    return path


@pytest.fixture
def no_encode(monkeypatch):
    refuse_encodes(monkeypatch)


def run(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
        sys.exit(0)
    out, err = capsys.readouterr()
    return exited.value.code or 0, out, err


def _request(model, cache) -> ServerRequest:
    return ServerRequest(model=str(model), tp_sizes=(1, 2), cache_dir=str(cache), **ENC)


def _needed(model, cache) -> int:
    _, plan, _ = prepare(_request(model, cache))
    from exl3tool.encode.online import encoder_platform
    from exl3tool.plan.request import resolve_device

    platform = encoder_platform(resolve_device("auto"))  # each entry records where it was encoded
    return sum(entry_bytes(j.key, platform) for j in plan.todo)


def test_too_little_free_space_is_a_usage_error_before_any_encode(model, tmp_path, capsys, monkeypatch, no_encode):
    cache = tmp_path / "cache"
    needed = _needed(model, cache)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=needed - 1))
    code, out, err = run(["cache", "warm", str(model), "--tp-size", "1,2", "--cache-dir", str(cache), *ENC_ARGS], capsys)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: cache directory {cache}: ") and "free on its filesystem" in last
    assert f"{(needed - 1) / 2**20:.1f} MiB free" in last or f"{needed - 1} bytes free" in last
    assert (f"writes {needed} bytes" in last or f"writes {needed / 2**20:.1f} MiB" in last) and "(12 entries)" in last
    assert not list(cache.rglob("*.safetensors"))


def test_entry_bytes_are_the_published_sizes(model, tmp_path, monkeypatch):
    import exl3tool.operations.warm.run as req

    real = req.run_plan
    monkeypatch.setattr(req, "run_plan", lambda *a, **k: real(*a, **{**k, "encode": fake_encode}))
    from exl3tool.operations.warm import warm

    cache = tmp_path / "cache"
    _, plan, _ = prepare(_request(model, cache))
    summary = warm(_request(model, cache))
    assert summary.counts["encoded"] == 12
    for job in plan.todo:  # a bound that is exact but for the proxy error's text
        assert 0 <= entry_bytes(job.key) - job.path.stat().st_size < 32


def _check_stopped(results, encodes: list, published: set, cache: Path) -> None:
    by_status = {}
    for r in results:
        by_status.setdefault(r.status, []).append(r)
    failed = by_status.get("failed", [])
    enospc = [r for r in failed if "No space left on device" in r.error and "filesystem is full" not in r.error]
    full = [r for r in failed if "the cache's filesystem is full" in r.error]
    assert enospc and full and len(enospc) + len(full) == len(failed)
    assert len({r.error for r in full}) == 1  # one message for every job left
    assert len(encodes) <= len(by_status.get("encoded", [])) + len(enospc) + 1  # encoding stopped at the first ENOSPC
    entries = [i for i in scan(cache) if i.kind == "entry"]
    assert {Path(i.path).name for i in entries} == published  # what was published stays, valid
    assert all(i.status == "valid" for i in entries) and not [i for i in scan(cache) if i.kind == "temp"]


@pytest.mark.parametrize("overlap", [True, False])
def test_first_enospc_fails_the_jobs_left_at_once(model, tmp_path, monkeypatch, caplog, overlap):
    import exl3tool.cache.store as store_mod

    cache = tmp_path / "cache"
    checkpoint, plan, store = prepare(_request(model, cache))
    real_write, writes, encodes = store_mod.write_entry, [], []

    def write_entry(path, key, *a, **k):  # the disk fills after two entries
        writes.append(key)
        if len(writes) > 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, key, *a, **k)

    monkeypatch.setattr(store_mod, "write_entry", write_entry)

    def encode(*a, **k):
        encodes.append(a[2])
        return fake_encode(*a)

    results = run_plan(plan, checkpoint, store, device=torch.device("cpu"), encode=encode, overlap=overlap)
    assert len(results) == 12
    published = {f"{r.digest}.safetensors" for r in results if r.status == "encoded"}
    assert len(published) == 2
    _check_stopped(results, encodes, published, cache)
    notes = [r.getMessage() for r in caplog.records if "filesystem is full" in r.getMessage()]
    assert len(notes) == 1


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs (root only; skipped where mounting is not allowed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_real_full_filesystem_mid_warm(model, small_tmpfs, capsys):
    """Another writer fills the filesystem after the first entry: the warm stops there, keeps what it published."""
    cache = small_tmpfs / "cache"
    checkpoint, plan, store = prepare(_request(model, cache))
    encodes: list = []

    def encode(*a, **k):
        encodes.append(a[2])
        return fake_encode(*a)

    def on_done(job, result):
        if result.status == "encoded" and not (small_tmpfs / "ballast").exists():
            free = shutil.disk_usage(small_tmpfs).free
            with open(small_tmpfs / "ballast", "wb") as fh:
                fh.write(b"\0" * (free - 120_000))  # room for about one more entry

    results = run_plan(plan, checkpoint, store, device=torch.device("cpu"), encode=encode, on_done=on_done,
                       overlap=False)
    published = {f"{r.digest}.safetensors" for r in results if r.status == "encoded"}
    assert 1 <= len(published) < 12
    _check_stopped(results, encodes, published, cache)


def test_a_real_small_filesystem_fails_the_precheck(model, small_tmpfs, capsys, no_encode):
    cache = small_tmpfs / "cache"
    (small_tmpfs / "ballast").write_bytes(b"\0" * (shutil.disk_usage(small_tmpfs).free - 500_000))
    code, out, err = run(["cache", "warm", str(model), "--tp-size", "1,2", "--cache-dir", str(cache), "--json",
                          *ENC_ARGS], capsys)
    assert code == 2 and "free on its filesystem, but the plan writes" in out + err
