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
from helpers import ENCODER_ID, MODEL_ID, CliRunner, make_encoded, server_lookup

from exl3tool.cache import CacheKey, CacheStore, entry_path, scan
from exl3tool.cli import _register, app


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


def _writer(root: str, ks: list[CacheKey], encodes: dict | None = None, kill_point: str | None = None, seed: int = 0) -> None:
    """Publish ``ks`` in order; ``kill_point`` fsync|replace: SIGKILL ourselves right before that call;
    ``save``: die halfway through writing a file (the file keeps half its bytes, as after a crash mid-write)."""
    if kill_point == "save":
        import exl3tool.cache.entry as entry_mod

        rng = random.Random(seed)
        real_atomic_write = entry_mod.atomic_write

        def write_half_and_die(path, write, **kwargs):
            def write_then_maybe_die(fh):
                write(fh)
                if rng.random() < 0.3:
                    fh.flush()
                    os.truncate(fh.name, fh.tell() // 2)
                    os.kill(os.getpid(), signal.SIGKILL)

            return real_atomic_write(path, write_then_maybe_die, **kwargs)

        entry_mod.atomic_write = write_half_and_die  # write_entry looks it up in the module at each call
    elif kill_point:
        rng = random.Random(seed)
        real = getattr(os, kill_point)

        def maybe_die(*args, **kwargs):
            if rng.random() < 0.3:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        setattr(os, kill_point, maybe_die)
    store = CacheStore(root)
    for key in ks:
        store.load_or_encode(key, lambda key=key: encodes[key.digest()] if encodes else expected(key))


def _check_after_kill(root: Path, ks: list[CacheKey], size: int) -> list:
    infos = scan(root)
    entries = [i for i in infos if i.kind == "entry"]
    assert all(i.status == "valid" for i in entries), [i.reason for i in entries if i.status != "valid"]
    for key in ks:
        if entry_path(key, root).exists():
            assert server_lookup(root, MODEL_ID, ENCODER_ID, key.prefix, BITS, 1, 0, size, size) is not None
    return infos


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_sigkill_never_leaves_a_visible_partial_entry(tmp_path):
    root = tmp_path / "cache"
    size = 512
    ks = keys(16, size, size)
    encodes = {key.digest(): expected(key) for key in ks}  # so the writer's time goes to I/O, where kills matter
    rng = random.Random(1234)
    runs, temps_seen, published, kinds, by_point = 0, 0, [], [], {}
    while sum(code == -signal.SIGKILL for code in kinds) < 24 and runs < 80:
        run, runs = runs, runs + 1
        kill_point = [None, "save", "fsync", "replace"][run % 4]
        p = CTX.Process(target=_writer, args=(str(root), ks, encodes, kill_point, run))
        p.start()
        if kill_point is None:
            time.sleep(rng.uniform(0.002, 0.12))
            os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        kinds.append(p.exitcode)
        if p.exitcode == -signal.SIGKILL:
            by_point[kill_point or "timed"] = by_point.get(kill_point or "timed", 0) + 1
        infos = _check_after_kill(root, ks, size)
        entries = [i for i in infos if i.kind == "entry"]
        temps_seen = max(temps_seen, sum(i.kind == "temp" for i in infos))
        published.append(len(entries))
        if len(entries) == len(ks):  # start over so later kills land mid-run again
            for i in entries:
                i.path.unlink()
    killed = sum(code == -signal.SIGKILL for code in kinds)
    leftovers = [i for i in scan(root) if i.kind == "temp"]
    print(f"\ncrash: {runs} runs, {killed} SIGKILLed {by_point}, entries visible after each "
          f"{published}, temp files left {len(leftovers)} (max at once {temps_seen}), partial entries seen 0")
    assert killed >= 24 and by_point.get("save", 0) > 0, by_point  # every kill point fired, mid-write included
    assert temps_seen > 0  # some kill left its temp file behind: the kills landed mid-publish
    _writer(str(root), ks, encodes)  # the next run completes; under each lock it takes it removes that entry's temps
    for key in ks:
        assert CacheStore(root, "readonly").lookup(key).hit
    stale = entry_path(ks[0], root).parent / f".{ks[0].digest()}.safetensors.killed01.tmp"
    stale.write_bytes(b"half an entry")  # a temp next to a valid entry: no writer takes that lock again
    _register()
    runner = CliRunner()
    res = runner.invoke(app, ["cache", "verify", "--cache-dir", str(root), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["valid"] == len(ks) and str(stale) in {t["path"] for t in report["temp_files"]}
    res = runner.invoke(app, ["cache", "prune", "--temp", "--yes", "--cache-dir", str(root)])
    assert res.exit_code == 0, res.output
    assert not [i for i in scan(root) if i.kind == "temp"]
    assert all(i.status == "valid" for i in scan(root) if i.kind == "entry")
