"""Several warms on one cache, and a warm beside a process holding an entry lock the way the server does
(``flock`` on ``<entry>.lock``): a held entry is never encoded here, the other jobs run meanwhile, the entry
counts as a hit once published, and the warm gives up only on a stuck holder or past ``--lock-timeout``."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from exl3tool.cache import CacheStore, lock_path, scan
from exl3tool.cache.locks import Holder, one_line
from exl3tool.checkpoint.synthetic import write_llama_checkpoint
from exl3tool.cli import main
from exl3tool.plan import ServerRequest, prepare
from exl3tool.operations.warm import run_plan
from exl3tool.operations.warm.lockwait import LockWaits

from helpers import ENC, ENC_ARGS, TINY, fake_encode
from seeds import fresh_seed

CTX = mp.get_context("forkserver")  # a fork after torch started its thread pools can hang the child
CTX.set_forkserver_preload(["torch", "exl3tool.operations.warm", "exl3tool.checkpoint"])  # each warm starts without imports
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("locks") / "tiny"
    write_llama_checkpoint(path, **TINY,
                           seed=fresh_seed(), shards=1)
    return path


def _request(model: Path, cache: Path, **kw) -> ServerRequest:
    return ServerRequest(model=str(model), tp_sizes=(1, 2), cache_dir=str(cache), **ENC, **kw)


def _marking_encode(marks: Path, delay: float = 0.0):
    """``fake_encode`` that leaves one marker file per (digest, pid) it encodes: O_EXCL, so a second encode of
    the same entry by the same process fails loudly, and markers of two processes show a double encode."""
    def encode(weight, bits, seed, device, progress=None):
        k, n = weight.shape
        rank_weight = hashlib.sha1(weight.contiguous().numpy().tobytes()).hexdigest()[:16]  # ranks share a seed
        fd = os.open(marks / f"{seed}-{k}x{n}-{rank_weight}.{os.getpid()}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.close(fd)
        time.sleep(delay)
        return fake_encode(weight, bits, seed, device)
    return encode


def _holder(entry: Path, go: Path, publish: bool, job_key_json: str | None = None) -> subprocess.Popen:
    """A process that takes the entry lock as the server does, says "held", waits for ``go`` to exist, then
    (``publish``) writes the entry as an encode would, and releases the lock by exiting. Its command line
    holds newlines (a ``-c`` script), as a real holder's may."""
    script = textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({str(lock_path(entry))!r}, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.05)
        if {publish!r}:
            sys.path[:0] = [{str(REPO_ROOT)!r}, {str(REPO_ROOT / 'tests')!r}]
            from exl3tool.cache import CacheKey, write_entry
            from helpers import fake_encode
            key = CacheKey.from_json({job_key_json!r})
            import torch
            enc = fake_encode(torch.zeros(key.input_size, key.output_size), key.bits, key.seed, "cpu")
            write_entry({str(entry)!r}, key, enc.tensors(), enc.proxy_error)
        print("done", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    proc.wait(10)


# --- the rules, with a clock we drive ----------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def _job(model, tmp_path):
    _, plan, _ = prepare(_request(model, tmp_path / "c"))
    return plan.todo[0]


def _waits(clock, holders, states, stamps=None, **kw):
    stamp = iter(stamps) if stamps is not None else None
    return LockWaits(clock=clock, sleep=clock.sleep, holders=lambda lock: holders, state=lambda pid: states.get(pid),
                     stamp=(lambda lock: next(stamp)) if stamp else (lambda lock: 0), **kw)


def test_a_live_holder_is_waited_for_without_bound(model, tmp_path):
    clock, job = _Clock(), _job(model, tmp_path)
    waits = _waits(clock, [Holder(4242, "vllm serve m")], {4242: "S"}, poll_s=1.0)
    notice = waits.defer(job, Path("/c/x.lock"))
    assert "pid 4242 (vllm serve m)" in notice and "\n" not in notice
    for _ in range(5000):  # 5000 s held by a live holder: still waiting
        clock.sleep(1.0)
        assert waits.due() == [job]
        assert waits.held_again(job) is None
    assert job in waits


def test_lock_timeout_bounds_the_wait_and_names_the_holder_on_one_line(model, tmp_path):
    clock, job = _Clock(), _job(model, tmp_path)
    command = one_line("python\0-c\0import fcntl\nfcntl.flock(3)\n" + "x" * 300)
    waits = _waits(clock, [Holder(77, command)], {77: "S"}, lock_timeout=30)
    waits.defer(job, Path("/c/x.lock"))
    clock.sleep(29)
    assert waits.held_again(job) is None
    clock.sleep(1)
    reason = waits.held_again(job)
    assert reason is not None and job not in waits
    assert "--lock-timeout 30 s" in reason and "pid 77 (python -c import fcntl fcntl.flock(3) xxx" in reason
    assert "\n" not in reason and "\0" not in reason and len(command) <= 100


def test_a_stopped_holder_is_stuck(model, tmp_path):
    clock, job = _Clock(), _job(model, tmp_path)
    states = {5: "T"}
    waits = _waits(clock, [Holder(5, "exl3tool cache warm m")], states, stuck_after_s=60)
    waits.defer(job, Path("/c/x.lock"))
    clock.sleep(50)
    states[5] = "R"  # it ran again: the stopped time starts over
    assert waits.held_again(job) is None
    states[5] = "T"
    clock.sleep(10)
    assert waits.held_again(job) is None
    clock.sleep(59)
    assert waits.held_again(job) is None
    clock.sleep(1)
    assert "stopped" in waits.held_again(job)


def test_an_unknown_holder_is_waited_for_while_the_model_makes_progress(model, tmp_path):
    clock, job = _Clock(), _job(model, tmp_path)
    stamps = [1, 1] + list(range(2, 40)) + [40] * 1000  # a writer elsewhere publishes every 60 s, then stops
    waits = _waits(clock, [], {}, stamps=stamps, unknown_after_s=600)
    assert "not visible from here" in waits.defer(job, Path("/c/x.lock"))
    for _ in range(39):
        clock.sleep(60)
        assert waits.held_again(job) is None
    clock.sleep(599)
    assert waits.held_again(job) is None
    clock.sleep(1)
    assert "no file of this model's cache changed for 600 s" in waits.held_again(job)


# --- beside a process that holds a lock as the server does -------------------------------------------------


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_held_entry_waits_while_other_jobs_run_then_is_a_hit(model, tmp_path):
    """The holder publishes only after the warm encoded every other job: the warm cannot have blocked on it."""
    checkpoint, plan, store = prepare(_request(model, tmp_path / "cache"))
    todo = plan.todo
    held = todo[0]  # the largest: the first the warm would take
    go, marks = tmp_path / "go", tmp_path / "marks"
    marks.mkdir()
    held.path.parent.mkdir(parents=True, exist_ok=True)
    proc = _holder(held.path, go, publish=True, job_key_json=held.key.canonical_json())
    encode = _marking_encode(marks)
    others = {j.digest for j in todo} - {held.digest}
    done: list[str] = []

    def on_done(job, result):
        done.append(job.digest)
        if set(done) >= others:
            go.touch()  # every other job is finished: now the holder publishes and releases

    try:
        for overlap in (True, False):
            if overlap is False:  # again, without overlap, on a fresh cache
                checkpoint, plan, store = prepare(_request(model, tmp_path / "cache2"))
                held = next(j for j in plan.todo if j.prefix == held.prefix and j.tp_size == held.tp_size
                            and j.tp_rank == held.tp_rank)
                others, done[:] = {j.digest for j in plan.todo} - {held.digest}, []
                go.unlink()
                held.path.parent.mkdir(parents=True, exist_ok=True)
                proc = _holder(held.path, go, publish=True, job_key_json=held.key.canonical_json())
            results = run_plan(plan, checkpoint, store, device=torch.device("cpu"), encode=encode, on_done=on_done,
                               overlap=overlap, waits=LockWaits(poll_s=0.1))
            assert proc.wait(30) == 0
            by = {r.digest: r for r in results}
            assert by[held.digest].status == "hit", by[held.digest]
            assert {by[d].status for d in others} == {"encoded"}
            assert done[-1] == held.digest  # it came back to the held job after the others
            assert len(list(marks.iterdir())) == len(others)  # each other job encoded once, the held one never
            for p in marks.iterdir():
                p.unlink()
    finally:
        _stop(proc)


def test_a_holder_that_releases_without_publishing_leaves_the_encode_to_the_warm(model, tmp_path):
    checkpoint, plan, store = prepare(_request(model, tmp_path / "cache", layers=("*.o_proj",)))
    held = plan.todo[-1]
    go, marks = tmp_path / "go", tmp_path / "marks"
    marks.mkdir()
    held.path.parent.mkdir(parents=True, exist_ok=True)
    proc = _holder(held.path, go, publish=False)  # e.g. its encode failed: nothing published
    try:
        results = run_plan(plan, checkpoint, store, device=torch.device("cpu"), encode=_marking_encode(marks),
                           on_done=lambda job, result: go.touch(), waits=LockWaits(poll_s=0.1))
    finally:
        _stop(proc)
    assert {r.status for r in results} == {"encoded"}
    assert len(list(marks.iterdir())) == len(plan.todo)
    assert CacheStore(store.root).lookup(held.key).hit


def test_lock_timeout_option_fails_the_job_unencoded_naming_the_holder(model, tmp_path, capsys, caplog, monkeypatch):
    import exl3tool.operations.warm.run as req

    real = req.run_plan
    monkeypatch.setattr(req, "run_plan", lambda *a, **k: real(*a, **{**k, "encode": fake_encode}))
    cache = tmp_path / "cache"
    _, plan, _ = prepare(_request(model, cache, layers=("*.o_proj",)))
    held = plan.todo[0]
    held.path.parent.mkdir(parents=True, exist_ok=True)
    proc = _holder(held.path, tmp_path / "never", publish=False)
    try:
        with pytest.raises(SystemExit) as exited:
            main(["cache", "warm", str(model), "--tp-size", "1,2", "--layers", "*.o_proj", "--cache-dir", str(cache),
                  "--lock-timeout", "1", "--device", "cpu", "--json", "--progress", "none", *ENC_ARGS])
    finally:
        _stop(proc)
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert exited.value.code == 1
    by = {e["digest"]: e for e in doc["entries"]}
    failed = by[held.digest]
    assert failed["status"] == "failed" and "--lock-timeout 1 s" in failed["error"]
    assert f"pid {proc.pid} (" in failed["error"] and "\n" not in failed["error"]
    assert "not encoded" in failed["error"] and "publishing failed" not in failed["error"]
    assert not held.path.exists()
    assert {e["status"] for d, e in by.items() if d != held.digest} == {"encoded"}
    # the one notice that the lock is held (stderr); under load the give-up may be logged too (CI saw it), once
    about = [r.getMessage() for r in caplog.records if str(lock_path(held.path)) in r.getMessage()]
    notes = [m for m in about if "is held by" in m]
    assert len(notes) == 1 and f"pid {proc.pid}" in notes[0] and "\n" not in notes[0], about
    assert len([m for m in about if "gave up" in m]) <= 1, about


def test_a_stopped_holder_is_given_up_on(model, tmp_path):
    checkpoint, plan, store = prepare(_request(model, tmp_path / "cache", layers=("*.o_proj",)))
    held = plan.todo[0]
    held.path.parent.mkdir(parents=True, exist_ok=True)
    proc = _holder(held.path, tmp_path / "never", publish=False)
    proc.send_signal(signal.SIGSTOP)
    try:
        results = run_plan(plan, checkpoint, store, device=torch.device("cpu"), encode=fake_encode,
                           waits=LockWaits(poll_s=0.1, stuck_after_s=0.5))
    finally:
        _stop(proc)
    by = {r.digest: r for r in results}
    if Path("/proc/locks").exists():
        assert by[held.digest].status == "failed" and "stopped" in by[held.digest].error
        assert f"pid {proc.pid}" in by[held.digest].error
    assert {r.status for d, r in by.items() if d != held.digest} == {"encoded"}


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_a_stopped_holder_is_noticed_within_seconds_while_another_job_encodes(model, tmp_path, caplog):
    """The warm is busy with one long encode (8 s) when the holder of another entry's lock is stopped: the give-up
    (stopped for 1 s here; 60 s by default) is logged within 5 s of the stop, long before that encode ends, saying
    how long the warm waited and that the entry was not encoded. The old loop looked only between jobs."""
    if not Path("/proc/locks").exists():
        pytest.skip("needs /proc/locks to name the holder")
    checkpoint, plan, store = prepare(_request(model, tmp_path / "cache", layers=("*.o_proj",)))
    held, slow = plan.todo[0], plan.todo[1]
    held.path.parent.mkdir(parents=True, exist_ok=True)
    proc = _holder(held.path, tmp_path / "never", publish=False)
    times: dict[str, float] = {}

    def encode(weight, bits, seed, device, progress=None):
        if "slow_start" not in times:  # the first encode: ``slow``'s (the held job was deferred)
            times["slow_start"] = time.time()
            proc.send_signal(signal.SIGSTOP)  # stopped while this thread is inside a long encode
            times["stopped"] = time.time()
            time.sleep(8.0)
            times["slow_end"] = time.time()
        return fake_encode(weight, bits, seed, device)

    caplog.set_level("WARNING")
    try:
        results = run_plan(plan, checkpoint, store, device=torch.device("cpu"), encode=encode,
                           waits=LockWaits(poll_s=0.25, stuck_after_s=1.0))
    finally:
        _stop(proc)
    by = {r.digest: r for r in results}
    assert by[held.digest].status == "failed" and not held.path.exists()
    error = by[held.digest].error
    assert "not encoded: gave up after waiting" in error and "did not encode the entry" in error
    assert f"pid {proc.pid}" in error and "stopped" in error and "\n" not in error
    waited = float(error.split("gave up after waiting ")[1].split(" s")[0])
    assert 1.0 <= waited <= 6.0, error
    gave_up = [r for r in caplog.records if "not encoded: gave up" in r.getMessage()]
    assert len(gave_up) == 1
    assert gave_up[0].created - times["stopped"] <= 5.0, "not noticed within 5 s of the stop"
    assert gave_up[0].created < times["slow_end"], "noticed only after the long encode (between jobs)"
    stopped_notes = [r for r in caplog.records if "is stopped (SIGSTOP" in r.getMessage()]
    assert stopped_notes and stopped_notes[0].created - times["stopped"] <= 2.0
    assert by[slow.digest].status == "encoded"
    assert {r.status for d, r in by.items() if d != held.digest} == {"encoded"}


# --- two and eight warms on one cache ----------------------------------------------------------------------


def _warm_process(model: str, cache: str, marks: str, barrier, errors) -> None:
    try:
        checkpoint, plan, store = prepare(_request(Path(model), Path(cache)))
        barrier.wait(60)
        results = run_plan(plan, checkpoint, store, device=torch.device("cpu"),
                           encode=_marking_encode(Path(marks), delay=0.02), waits=LockWaits(poll_s=0.05))
        bad = [r for r in results if r.status not in ("hit", "encoded")]
        if bad:
            errors.put(f"{os.getpid()}: {[(r.prefix, r.status, r.error) for r in bad]}")
    except BaseException as exc:  # reported to the parent
        errors.put(f"{os.getpid()}: {type(exc).__name__}: {exc}")


def _poll_for_torn_files(cache: str, keys, stop, errors, polls) -> None:
    store = CacheStore(cache, "readonly")
    n = 0
    while not stop.is_set():
        for key in keys:
            if store.lookup(key, quick=True).status == "invalid":
                errors.put(f"a reader saw an incomplete entry for {key.prefix}")
            n += 1
    polls.put(n)


@pytest.mark.parametrize("warms", [2, 8])
@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_warms_on_one_cache_encode_each_entry_once(model, tmp_path, warms):
    cache, marks = tmp_path / "cache", tmp_path / "marks"
    marks.mkdir()
    _, plan, _ = prepare(_request(model, cache))
    keys = [j.key for j in plan.todo]
    barrier, errors, stop, polls = CTX.Barrier(warms), CTX.Queue(), CTX.Event(), CTX.Queue()
    reader = CTX.Process(target=_poll_for_torn_files, args=(str(cache), keys, stop, errors, polls))
    procs = [CTX.Process(target=_warm_process, args=(str(model), str(cache), str(marks), barrier, errors))
             for _ in range(warms)]
    reader.start()
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    stop.set()
    reader.join(30)
    problems = []
    while not errors.empty():
        problems.append(errors.get())
    assert not problems, problems
    assert all(p.exitcode == 0 for p in procs + [reader])
    per_entry: dict[str, int] = {}
    for m in marks.iterdir():
        per_entry[m.name.split(".")[0]] = per_entry.get(m.name.split(".")[0], 0) + 1
    assert len(per_entry) == len(keys) and set(per_entry.values()) == {1}, per_entry  # each encoded exactly once
    _, again, _ = prepare(_request(model, cache))
    assert {j.state for j in again.jobs} == {"hit"}
    assert polls.get(timeout=10) > 0
    infos = scan(cache)
    assert all(i.status == "valid" for i in infos if i.kind == "entry") and not [i for i in infos if i.kind == "temp"]
