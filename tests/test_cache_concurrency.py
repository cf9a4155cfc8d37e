"""Races and crashes: 8 processes on the same keys encode each key once; a SIGKILLed writer never leaves a
visible partial entry; leftovers are reported by ``cache verify`` and removed by ``cache prune --temp``."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from exl3tool.cache import CacheKey, CacheStore, entry_path, scan
from exl3tool.cli import _register, app

from _cache_util import ENCODER_ID, MODEL_ID, make_encoded, server_lookup

CTX = mp.get_context("fork")
K, N, BITS = 256, 256, 6


def keys(count: int, k: int = K, n: int = N) -> list[CacheKey]:
    return [CacheKey.for_layer(MODEL_ID, ENCODER_ID, f"model.layers.{i}.mlp.down_proj", BITS, 1, 0, k, n) for i in range(count)]


def expected(key: CacheKey):
    return make_encoded(key.input_size, key.output_size, BITS, seed=key.seed % 1000)


def _racer(root: str, counts: str, barrier, nolock: bool, errors) -> None:
    try:
        if nolock:
            import contextlib

            import exl3tool.cache.store as store_mod

            store_mod.FileLock = lambda *a, **k: contextlib.nullcontext()  # flock as a no-op (network filesystems)
        store = CacheStore(root)
        ks = keys(6)
        random.Random(os.getpid()).shuffle(ks)
        barrier.wait(30)
        for key in ks:
            def encode(key=key):
                fd = os.open(os.path.join(counts, f"{key.digest()}.{os.getpid()}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.close(fd)
                time.sleep(0.05)  # widen the race window
                return expected(key)

            res = store.load_or_encode(key, encode)
            want = expected(key).tensors()
            if not all(torch.equal(res.tensors[n], want[n]) for n in want):
                errors.put(f"{os.getpid()}: wrong tensors for {key.prefix}")
    except Exception as exc:  # reported to the parent
        errors.put(f"{os.getpid()}: {type(exc).__name__}: {exc}")


def _reader(root: str, stop, errors, seen) -> None:
    store = CacheStore(root, "readonly")
    ks = keys(6)
    hits = 0
    while not stop.is_set():
        for key in ks:
            status = store.lookup(key).status
            if status == "invalid":
                errors.put(f"reader saw an incomplete entry for {key.prefix}")
            hits += status == "hit"
    seen.put(hits)


@pytest.mark.parametrize("nolock", [False, True], ids=["flock", "no-op-lock"])
def test_eight_processes_race(tmp_path, nolock):
    root, counts = tmp_path / "cache", tmp_path / "counts"
    counts.mkdir()
    barrier, errors, stop, seen = CTX.Barrier(8), CTX.Queue(), CTX.Event(), CTX.Queue()
    readers = [CTX.Process(target=_reader, args=(str(root), stop, errors, seen)) for _ in range(2)]
    racers = [CTX.Process(target=_racer, args=(str(root), str(counts), barrier, nolock, errors)) for _ in range(8)]
    for p in readers + racers:
        p.start()
    for p in racers:
        p.join(60)
    stop.set()
    for p in readers:
        p.join(30)
    problems = []
    while not errors.empty():
        problems.append(errors.get())
    assert not problems, problems
    assert all(p.exitcode == 0 for p in racers + readers)
    per_key = {}
    for marker in os.listdir(counts):
        per_key.setdefault(marker.split(".")[0], []).append(marker)
    assert len(per_key) == 6
    if not nolock:
        assert all(len(v) == 1 for v in per_key.values()), per_key  # each key encoded exactly once
    print(f"\nrace ({'no-op lock' if nolock else 'flock'}): 8 writers + 2 readers, 6 keys, "
          f"encodes per key {sorted(len(v) for v in per_key.values())}")
    for key in keys(6):
        assert server_lookup(root, MODEL_ID, ENCODER_ID, key.prefix, BITS, 1, 0, K, N) is not None
    infos = scan(root)
    assert all(i.status == "valid" for i in infos if i.kind == "entry")
    assert not [i for i in infos if i.kind == "temp"]


def _writer(root: str, ks: list[CacheKey]) -> None:
    store = CacheStore(root)
    for key in ks:
        store.load_or_encode(key, lambda key=key: expected(key))


def test_sigkill_never_leaves_a_visible_partial_entry(tmp_path):
    root = tmp_path / "cache"
    ks = keys(24, 512, 512)
    rng = random.Random(1234)
    runs, temps_seen, published = 25, 0, []
    for run in range(runs):
        p = CTX.Process(target=_writer, args=(str(root), ks))
        p.start()
        time.sleep(rng.uniform(0.005, 0.25))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert p.exitcode == -signal.SIGKILL or p.exitcode == 0
        infos = scan(root)
        entries = [i for i in infos if i.kind == "entry"]
        assert all(i.status == "valid" for i in entries), [i.reason for i in entries if i.status != "valid"]
        for key in ks:
            if entry_path(key, root).exists():
                assert server_lookup(root, MODEL_ID, ENCODER_ID, key.prefix, BITS, 1, 0, 512, 512) is not None
        temps_seen = max(temps_seen, sum(i.kind == "temp" for i in infos))
        published.append(len(entries))
        if len(entries) == len(ks):  # start over so later kills land mid-run again
            for i in entries:
                i.path.unlink()
    leftovers = [i for i in scan(root) if i.kind == "temp"]
    print(f"\ncrash: {runs} SIGKILLs, entries visible after each {published}, temp files left {len(leftovers)} "
          f"(max at once {temps_seen}), partial entries seen 0")
    if not leftovers:  # make sure the reporting path is exercised even if no kill landed mid-write
        d = entry_path(ks[0], root).parent
        d.mkdir(parents=True, exist_ok=True)
        (d / f".{ks[0].digest()}.safetensors.zz9x_k2a.tmp").write_bytes(b"partial")
    _writer(str(root), ks)  # the next run completes
    for key in ks:
        assert CacheStore(root, "readonly").lookup(key).hit
    _register()
    runner = CliRunner()
    res = runner.invoke(app, ["cache", "verify", "--cache-dir", str(root), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["valid"] == len(ks) and report["temp_files"]
    res = runner.invoke(app, ["cache", "prune", "--temp", "--yes", "--cache-dir", str(root)])
    assert res.exit_code == 0, res.output
    assert not [i for i in scan(root) if i.kind == "temp"]
    assert all(i.status == "valid" for i in scan(root) if i.kind == "entry")
