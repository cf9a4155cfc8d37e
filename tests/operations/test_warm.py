"""`encode` / `cache warm` on a synthetic Llama in a Hub-cache layout (offline) and on the real MiniLM BERT.

The encodes are real (K=6 on the CPU), so the layer sets are kept small: each test says what it encodes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from collections import deque
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl3tool.cache import CacheStore, layer_seed
from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.encode import dequantize_tensors
from exl3tool.format.encoded import EncodedLinear
from exl3tool.plan import ServerRequest, prepare, share_jobs
from exl3tool.operations.warm import warm

from helpers import ENC, TINY, TINY_REPO as REPO, completed
from seeds import fresh_seed



@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A fresh-random synthetic Llama in a Hub cache; returns (hub cache dir, snapshot dir, plain dir)."""
    base = tmp_path_factory.mktemp("warm")
    seed = fresh_seed()
    snap = write_llama_checkpoint(base / "plain", **TINY, seed=seed, shards=2, hub_cache=base / "hub", repo_id=REPO)
    return base / "hub", snap, base / "plain"


@pytest.fixture(scope="module")
def small_hub(tmp_path_factory):
    """The tiny Llama at half its width (hidden 128; 4 heads of 64, so o_proj's K_r stays a multiple of 128 at TP 2):
    o_proj is 128 tiles, not 256, for the tests that start warms in other processes (the kill, the torchrun split:
    what they check does not depend on the size)."""
    base = tmp_path_factory.mktemp("small")
    snap = write_llama_checkpoint(base / "plain", **{**TINY, "hidden": 128, "intermediate": 256}, head_dim=64,
                                  seed=fresh_seed(), shards=2, hub_cache=base / "hub", repo_id=REPO)
    return base / "hub", snap, base / "plain"


@pytest.fixture
def offline(monkeypatch, hub):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub[0]))
    monkeypatch.delenv("VLLM_EXL3_ENCODER_SOURCE", raising=False)
    return hub


def _env(hub) -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub[0]), PYTHONUNBUFFERED="1")


def _cli(args, env):
    """``exl3tool ARGS`` with ``env`` in this process (the kill, resume and torchrun tests start real processes)."""
    return completed(args, env)


def fake_encode(weight, bits, seed, device):  # shapes right, contents irrelevant here; fast
    k, n = weight.shape
    g = torch.Generator().manual_seed(seed)
    return EncodedLinear(torch.randint(-32768, 32767, (k // 16, n // 16, 16 * bits), generator=g,
                                       dtype=torch.int32).to(torch.int16),
                         torch.rand(k, generator=g).half(), torch.rand(n, generator=g).half(), 0.1, 1.0, bits)


def _weights(plain: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(plain.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_plan_prefixes_seeds_and_shapes_for_tp_1_2_4(offline, tmp_path):
    _, plan, _ = prepare(ServerRequest(model=REPO, tp_sizes=(1, 2, 4), cache_dir=str(tmp_path), **ENC))
    jobs = {(j.prefix, j.tp_size, j.tp_rank): j for j in plan.jobs}
    # (in=K_r, out=N_r): qkv out = (4 + 2*2) * 64 heads*hd; KV heads replicate at TP 4
    want = {
        ("model.layers.0.self_attn.qkv_proj", 1): (256, 512), ("model.layers.0.self_attn.qkv_proj", 2): (256, 256),
        ("model.layers.0.self_attn.qkv_proj", 4): (256, 192), ("model.layers.0.self_attn.o_proj", 1): (256, 256),
        ("model.layers.0.self_attn.o_proj", 2): (128, 256), ("model.layers.0.self_attn.o_proj", 4): (64, 256),
        ("model.layers.1.mlp.gate_up_proj", 1): (256, 1024), ("model.layers.1.mlp.gate_up_proj", 4): (256, 256),
        ("model.layers.1.mlp.down_proj", 2): (256, 256), ("model.layers.1.mlp.down_proj", 4): (128, 256),
    }
    for (prefix, tp), shape in want.items():
        for rank in range(tp):
            j = jobs[(prefix, tp, rank)]
            assert (j.input_size, j.output_size) == shape, (prefix, tp, rank)
            assert j.key.seed == zlib.crc32(prefix.encode()) & 0x7FFFFFFF == layer_seed(prefix)
            assert j.key.tp_world_size == tp and j.key.tp_rank == rank
    assert len(plan.jobs) == 2 * 4 * (1 + 2 + 4)
    skipped = {(j.prefix.split(".", 3)[-1], j.tp_size) for j in plan.jobs if j.state == "skipped"}
    assert skipped == {("self_attn.qkv_proj", 4), ("self_attn.o_proj", 4)}
    assert {j.state for j in plan.jobs} == {"miss", "skipped"}
    assert all("128" in j.reason for j in plan.jobs if j.state == "skipped")


def test_dry_run_cli_json_lists_plan_and_encodes_nothing(hub, tmp_path):
    r = _cli(["encode", REPO, "--tp-size", "2", "--cache-dir", str(tmp_path / "c"), "--dry-run", "--json",
              "--encoder-root", "/e", "--encoder-revision", "r"], _env(hub))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["jobs"]) == 2 * 4 * 2 and {j["state"] for j in doc["jobs"]} == {"miss"}
    assert all(len(j["digest"]) == 64 for j in doc["jobs"])
    assert not (tmp_path / "c").exists()


def test_missing_encoder_identity_is_a_usage_error(hub, tmp_path):
    env = _env(hub)
    env.pop("VLLM_EXL3_ENCODER_SOURCE", None)
    r = _cli(["cache", "warm", REPO, "--cache-dir", str(tmp_path)], env)
    assert r.returncode == 2
    assert "--encoder-root" in r.stderr and "Traceback" not in r.stderr


def test_share_jobs_is_a_balanced_partition(offline, tmp_path):
    _, plan, _ = prepare(ServerRequest(model=REPO, tp_sizes=(1, 2, 4), cache_dir=str(tmp_path), **ENC))
    todo = plan.todo
    for workers in (2, 3, 5):
        shares = [share_jobs(todo, w, workers) for w in range(workers)]
        digests = [j.digest for s in shares for j in s]
        assert sorted(digests) == sorted(j.digest for j in todo) and len(set(digests)) == len(digests)
        loads = [sum(j.tiles for j in s) for s in shares]
        assert max(loads) - min(loads) <= max(j.tiles for j in todo)


@pytest.mark.slow
def test_warm_kill_resume_decode_and_all_hits(small_hub, monkeypatch, tmp_path):
    """o_proj of layer 0 (256 in, 128 out: small_hub) at TP 1 and 2 (3 entries): kill a warm after its first entry,
    resume, check slices."""
    hub = small_hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub[0]))
    monkeypatch.delenv("VLLM_EXL3_ENCODER_SOURCE", raising=False)
    cache = tmp_path / "cache"
    layer = "model.layers.0.self_attn.o_proj"
    args = ["cache", "warm", REPO, "--tp-size", "1,2", "--layers", layer, "--cache-dir", str(cache),
            "--device", "cpu", "--encoder-root", ENC["encoder_root"], "--encoder-revision", ENC["encoder_revision"]]
    proc = subprocess.Popen([sys.executable, "-m", "exl3tool", *args, "--quiet"], env=_env(hub),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and not list(cache.rglob("*.safetensors")):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    published = {p for p in cache.rglob("*.safetensors") if not p.name.startswith(".")}
    assert 1 <= len(published) < 3, "the kill should land between the first and the last entry"

    request = ServerRequest(model=REPO, tp_sizes=(1, 2), layers=(layer,), cache_dir=str(cache), device="cpu", **ENC)
    resumed = warm(request)
    assert resumed.counts == {"hit": len(published), "encoded": 3 - len(published), "skipped": 0, "failed": 0}

    full = _weights(hub[2])
    store = CacheStore(cache, "readonly")
    for e in resumed.entries:
        w = full[e.prefix.replace("o_proj", "o_proj.weight")].float()  # [out, in]
        k = 256 // e.tp_size
        want = w[:, e.tp_rank * k:(e.tp_rank + 1) * k].t()  # row-parallel: input columns of this rank
        other = w[:, ((e.tp_rank + 1) % e.tp_size) * k:][:, :k].t()
        _, plan, _ = prepare(ServerRequest(model=REPO, tp_sizes=(e.tp_size,), layers=(e.prefix,), cache_dir=str(cache), **ENC))
        found = store.lookup(plan.jobs[e.tp_rank].key)
        assert found.status == "hit"
        t = found.tensors
        deq = dequantize_tensors(t["trellis"], t["suh"], t["svh"], 6)
        err = ((deq - want).norm() / want.norm()).item()
        assert err < 0.03, f"{e.prefix} tp{e.tp_size} rank {e.tp_rank}: rel err {err}"
        if e.tp_size > 1:
            assert ((deq - other).norm() / other.norm()).item() > 0.5

    t0 = time.perf_counter()
    again = warm(request)
    assert again.counts == {"hit": 3, "encoded": 0, "skipped": 0, "failed": 0}
    assert time.perf_counter() - t0 < 30


@pytest.mark.slow
def test_torchrun_two_cpu_workers_split_the_plan(small_hub, tmp_path):
    """layer-1 o_proj at TP 1 and 2 (3 entries), two gloo workers: the union is the plan, nothing twice."""
    cache = tmp_path / "cache"
    env = _env(small_hub)
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "exl3tool",
           "cache", "warm", REPO, "--tp-size", "1,2", "--layers", "model.layers.1.self_attn.o_proj",
           "--cache-dir", str(cache), "--device", "cpu", "--json", "--quiet",
           "--encoder-root", ENC["encoder_root"], "--encoder-revision", ENC["encoder_revision"]]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["workers"] == 2 and doc["counts"]["encoded"] == 3 and doc["counts"]["failed"] == 0, doc["counts"]
    jobs = [(e["prefix"], e["tp_size"], e["tp_rank"]) for e in doc["entries"]]
    assert sorted(jobs) == sorted({(p, t, r_) for p, t, r_ in jobs}) and len(jobs) == 3
    assert {e["worker"] for e in doc["entries"]} == {0, 1}
    assert len([p for p in cache.rglob("*.safetensors") if not p.name.startswith(".")]) == 3
    assert len(doc["worker_stats"]) == 2
    # the same warm in one process with 2 threads (the workers had 1 each): the same bytes (issue 14; these small
    # random layers rarely showed the old thread-dependent sums, test_encode_threads pins them deterministically)
    env.pop("OMP_NUM_THREADS")
    alone = tmp_path / "alone"
    one = [sys.executable, "-m", "exl3tool", *cmd[cmd.index("exl3tool") + 1:]]
    one[one.index(str(cache))] = str(alone)
    r = subprocess.run(one, capture_output=True, text=True, env={**env, "EXL3TOOL_THREADS": "2"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    mine = {p.relative_to(cache): p.read_bytes() for p in cache.rglob("*.safetensors")}
    theirs = {p.relative_to(alone): p.read_bytes() for p in alone.rglob("*.safetensors")}
    assert mine.keys() == theirs.keys() and [k for k in mine if mine[k] != theirs[k]] == []


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_non_finite_weight_fails_that_layer_only(tmp_path):
    """A NaN in layer 0's o_proj: that job fails by name, nothing is published for it, layer 1 still encodes."""
    plain = write_llama_checkpoint(tmp_path / "m", **TINY, seed=3, shards=1)
    f = plain / "model.safetensors"
    tensors = load_file(f)
    w = tensors["model.layers.0.self_attn.o_proj.weight"].clone()
    w[5, 7] = float("nan")
    tensors["model.layers.0.self_attn.o_proj.weight"] = w
    save_file(tensors, f, metadata={"format": "pt"})
    cache = tmp_path / "cache"
    r = _cli(["cache", "warm", str(plain), "--layers", "*.o_proj", "--cache-dir", str(cache), "--device", "cpu",
              "--json", "--encoder-root", "/e", "--encoder-revision", "r"], dict(os.environ))
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    status = {e["prefix"]: e for e in doc["entries"]}
    assert status["model.layers.0.self_attn.o_proj"]["status"] == "failed"
    assert "non-finite" in status["model.layers.0.self_attn.o_proj"]["error"]
    assert status["model.layers.1.self_attn.o_proj"]["status"] == "encoded"
    assert len([p for p in cache.rglob("*.safetensors") if not p.name.startswith(".")]) == 1


def test_bad_checkpoint_is_a_one_line_error(tmp_path):
    plain = write_llama_checkpoint(tmp_path / "m", **TINY, seed=4, shards=1)
    (plain / "model.safetensors").write_bytes(b"\xff" * 64)
    r = _cli(["cache", "warm", str(plain), "--cache-dir", str(tmp_path / "c"), "--encoder-root", "/e",
              "--encoder-revision", "r"], dict(os.environ))
    assert r.returncode == 2
    assert "model.safetensors" in r.stderr and "Traceback" not in r.stderr


def test_workers_with_stale_plans_still_cover_every_job(offline, tmp_path):
    """Worker 1 plans after worker 0 published one entry; with worker 0's agreed list nothing is dropped."""
    from exl3tool.checkpoint import open_checkpoint
    from exl3tool.operations.warm import run_plan

    request = ServerRequest(model=REPO, tp_sizes=(1, 2), layers=("*.o_proj", "*.down_proj"), cache_dir=str(tmp_path), **ENC)
    checkpoint = open_checkpoint(REPO)
    _, plan0, store = prepare(request)
    agreed = plan0.todo
    first = agreed[0]
    store.publish(first.key, fake_encode(torch.zeros(first.input_size, first.output_size), 6, 1, "cpu"))
    _, plan1, _ = prepare(request)  # worker 1's late view: `first` is already a hit
    assert len(plan1.todo) == len(agreed) - 1
    r0 = run_plan(plan0, checkpoint, store, device=torch.device("cpu"), worker=0, workers=2, todo=agreed, encode=fake_encode)
    r1 = run_plan(plan1, checkpoint, store, device=torch.device("cpu"), worker=1, workers=2, todo=agreed, encode=fake_encode)
    done = sorted((r.prefix, r.tp_size, r.tp_rank) for r in r0 + r1 if r.status in ("hit", "encoded"))
    assert done == sorted((j.prefix, j.tp_size, j.tp_rank) for j in plan0.jobs)  # each job exactly once
    assert len([p for p in tmp_path.rglob("*.safetensors") if not p.name.startswith(".")]) == len(plan0.jobs)


# ---- overlap: prefetch thread, encodes on the calling thread, publishing thread ------------------------------


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _no_leftovers(store: CacheStore, plan) -> None:
    from filelock import FileLock

    from exl3tool.cache import lock_path

    assert not [p for p in store.root.rglob("*.tmp")], "temp files left behind"
    for job in plan.jobs:
        lock = lock_path(job.path)
        if lock.exists():
            with FileLock(str(lock), timeout=0):  # raises Timeout if a lock was left held
                pass


@pytest.mark.slow
def test_overlap_on_and_off_publish_identical_trees(offline, viterbi_memo, tmp_path):
    """Real encodes of layer 1's o_proj at TP 2 (2 entries of 128 x 256), once with overlap and once without (the
    second run's Viterbi reuses the first's states where its tiles are the same bits: conftest's viterbi_memo)."""
    from exl3tool.checkpoint import open_checkpoint
    from exl3tool.operations.warm import run_plan

    checkpoint = open_checkpoint(REPO)
    outcomes = {}
    for overlap in (True, False):
        request = ServerRequest(model=REPO, tp_sizes=(2,), layers=("model.layers.1.self_attn.o_proj",),
                              cache_dir=str(tmp_path / str(overlap)), **ENC)
        _, plan, store = prepare(request)
        results = run_plan(plan, checkpoint, store, device=torch.device("cpu"), overlap=overlap)
        assert [r.status for r in results] == ["encoded", "encoded"]
        outcomes[overlap] = ([(r.prefix, r.tp_rank, r.status, r.digest, r.bytes, r.proxy_error) for r in results],
                             _tree(store.root))
        _no_leftovers(store, plan)
    assert outcomes[True][0] == outcomes[False][0]
    on, off = outcomes[True][1], outcomes[False][1]
    assert sorted(on) == sorted(off) and len([n for n in on if n.endswith(".safetensors")]) == 2
    assert [n for n in on if on[n] != off[n]] == [], "entries differ between overlap on and off"


def test_overlap_failed_read_and_failed_publish_are_per_layer(offline, tmp_path, monkeypatch):
    """o_proj and down_proj at TP 1 and 2 (12 jobs, fake encode): one weight read fails, one publish fails."""
    import exl3tool.cache.store as store_mod
    from exl3tool.checkpoint import open_checkpoint
    from exl3tool.operations.warm import run_plan

    checkpoint = open_checkpoint(REPO)
    request = ServerRequest(model=REPO, tp_sizes=(1, 2), layers=("*.o_proj", "*.down_proj"), cache_dir=str(tmp_path), **ENC)
    _, plan, store = prepare(request)
    todo = plan.todo
    unreadable = "model.layers.0.self_attn.o_proj.weight"
    real_read = checkpoint.read

    def read(name, rows=None, cols=None):
        if name == unreadable:
            raise OSError(5, "Input/output error", unreadable)
        return real_read(name, rows, cols)

    monkeypatch.setattr(checkpoint, "read", read)
    doomed = next(j for j in todo if "down_proj" in j.prefix and j.tp_size == 2)
    real_write = store_mod.write_entry

    def write_entry(path, key, *a, **k):
        if key.digest() == doomed.digest:  # an I/O error on one file (a full disk stops the warm, see below)
            raise OSError(5, "Input/output error")
        return real_write(path, key, *a, **k)

    monkeypatch.setattr(store_mod, "write_entry", write_entry)
    results = run_plan(plan, checkpoint, store, device=torch.device("cpu"), encode=fake_encode)
    by = {(r.prefix, r.tp_size, r.tp_rank): r for r in results}
    assert len(results) == len(plan.jobs) == 12
    failed = {k for k, r in by.items() if r.status == "failed"}
    want_failed = {("model.layers.0.self_attn.o_proj", 1, 0), ("model.layers.0.self_attn.o_proj", 2, 0),
                   ("model.layers.0.self_attn.o_proj", 2, 1), (doomed.prefix, 2, doomed.tp_rank)}
    assert failed == want_failed
    assert all("Input/output error" in by[k].error for k in want_failed if "o_proj" in k[0])
    assert "publishing failed" in by[(doomed.prefix, 2, doomed.tp_rank)].error
    assert {r.status for k, r in by.items() if k not in want_failed} == {"encoded"}
    published = {p.name for p in tmp_path.rglob("*.safetensors")}
    assert published == {f"{j.digest}.safetensors" for j in plan.jobs if (j.prefix, j.tp_size, j.tp_rank) not in failed}
    _no_leftovers(store, plan)


def test_overlap_entry_published_by_another_writer_is_a_hit(offline, tmp_path):
    """Another writer holds the entry lock while the warm starts and publishes meanwhile: a hit, no encode."""
    import threading

    from filelock import FileLock

    from exl3tool.cache import lock_path, write_entry
    from exl3tool.checkpoint import open_checkpoint
    from exl3tool.operations.warm import run_plan

    checkpoint = open_checkpoint(REPO)
    request = ServerRequest(model=REPO, tp_sizes=(1,), layers=("model.layers.0.self_attn.o_proj",), cache_dir=str(tmp_path), **ENC)
    _, plan, store = prepare(request)
    (job,) = plan.todo
    job.path.parent.mkdir(parents=True, exist_ok=True)
    holding, calls = threading.Event(), []

    def other_writer():
        with FileLock(str(lock_path(job.path))):
            holding.set()
            time.sleep(1.0)  # the warm finds no entry, then waits for the lock
            enc = fake_encode(torch.zeros(job.input_size, job.output_size), 6, job.key.seed, "cpu")
            write_entry(job.path, job.key, enc.tensors(), enc.proxy_error)

    t = threading.Thread(target=other_writer)
    t.start()
    assert holding.wait(10)

    def spy(*a):
        calls.append(a)
        return fake_encode(*a)

    t0 = time.perf_counter()
    (result,) = run_plan(plan, checkpoint, store, device=torch.device("cpu"), encode=spy)
    t.join(10)
    assert result.status == "hit" and not calls and result.path == str(job.path)
    assert time.perf_counter() - t0 > 0.5  # it waited on the lock (not the unlocked fast path)
    _no_leftovers(store, plan)


def test_overlap_callbacks_once_per_job_on_the_main_thread(offline, tmp_path):
    """12 jobs, fake encode: on_start/on_done once each, in job order, from this thread; same results as without."""
    import threading

    from exl3tool.checkpoint import open_checkpoint
    from exl3tool.operations.warm import run_plan

    checkpoint = open_checkpoint(REPO)
    main = threading.current_thread()
    outcomes = {}
    for overlap in (True, False):
        request = ServerRequest(model=REPO, tp_sizes=(1, 2), layers=("*.o_proj", "*.down_proj"),
                              cache_dir=str(tmp_path / str(overlap)), **ENC)
        _, plan, store = prepare(request)
        calls = []

        def on_start(job):
            calls.append(("start", job.digest, threading.current_thread() is main))

        def on_done(job, result):
            assert result.digest == job.digest
            calls.append(("done", job.digest, threading.current_thread() is main))

        results = run_plan(plan, checkpoint, store, device=torch.device("cpu"), encode=fake_encode,
                           on_start=on_start, on_done=on_done, overlap=overlap)
        digests = [j.digest for j in plan.todo]
        assert all(on_main for _, _, on_main in calls)
        assert [d for kind, d, _ in calls if kind == "start"] == digests
        assert [d for kind, d, _ in calls if kind == "done"] == digests
        assert {r.status for r in results} == {"encoded"} and all(r.seconds > 0 for r in results)
        outcomes[overlap] = ([(r.prefix, r.tp_size, r.tp_rank, r.status, r.bytes) for r in results], _tree(store.root))
    assert outcomes[True] == outcomes[False]


def test_overlap_interrupt_stops_threads_and_leaves_no_lock(offline, tmp_path):
    """A KeyboardInterrupt in the second encode: it propagates, the first entry is published, nothing is left held."""
    import threading

    from exl3tool.checkpoint import open_checkpoint
    from exl3tool.operations.warm import run_plan

    checkpoint = open_checkpoint(REPO)
    request = ServerRequest(model=REPO, tp_sizes=(1, 2), layers=("*.o_proj",), cache_dir=str(tmp_path), **ENC)
    _, plan, store = prepare(request)
    calls = []

    def encode(*a):
        calls.append(a)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return fake_encode(*a)

    reported = []
    with pytest.raises(KeyboardInterrupt):
        run_plan(plan, checkpoint, store, device=torch.device("cpu"), encode=encode,
                 on_done=lambda job, result: reported.append(result.status))
    assert len([p for p in tmp_path.rglob("*.safetensors")]) == 1
    assert reported == ["encoded"]  # the publish in flight at Ctrl-C is reported: `published` is exact
    assert not [t for t in threading.enumerate() if t.name.startswith("exl3tool-")]
    _no_leftovers(store, plan)


def test_host_threads_under_torchrun():
    from exl3tool.errors import ConfigError
    from exl3tool.operations.warm import host_threads

    cores = os.cpu_count() or 1
    torchrun = {"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}
    assert host_threads(True, torchrun) == max(1, cores // 2)
    assert host_threads(True, {**torchrun, "EXL3TOOL_THREADS": "3"}) == 3
    assert host_threads(False, {"EXL3TOOL_THREADS": "5"}) == 5
    assert host_threads(False, torchrun) is None  # not under torchrun: leave torch alone
    assert host_threads(True, {"OMP_NUM_THREADS": "4", "LOCAL_WORLD_SIZE": "2"}) is None  # the user's own setting
    with pytest.raises(ConfigError, match="EXL3TOOL_THREADS"):
        host_threads(True, {"EXL3TOOL_THREADS": "zero"})


def test_group_timeout_outlasts_gloos_default():
    """Worker 0 waits in the gather for the slowest worker: far longer than gloo's 30 minutes by default."""
    from datetime import timedelta

    from exl3tool.errors import ConfigError
    from exl3tool.operations.warm.distributed import group_timeout

    assert group_timeout({}) >= timedelta(hours=12)
    assert group_timeout({"EXL3TOOL_DIST_TIMEOUT_S": "90"}) == timedelta(seconds=90)
    for bad in ("0", "-5", "soon", "nan", "inf"):
        with pytest.raises(ConfigError, match="EXL3TOOL_DIST_TIMEOUT_S"):
            group_timeout({"EXL3TOOL_DIST_TIMEOUT_S": bad})


@pytest.mark.parametrize("command", [["cache", "warm"], ["encode"]])
def test_overlap_flag_reaches_the_request(command, monkeypatch):
    from helpers import CliRunner

    from exl3tool.cli import _register, app

    _register()
    seen = []
    monkeypatch.setattr("exl3tool.operations.warm.warm", lambda request, **kw: seen.append(request.overlap))  # None: nothing to report
    for flag in ([], ["--no-overlap"], ["--overlap"]):
        r = CliRunner().invoke(app, [*command, REPO, "--cache-dir", "/nonexistent", *flag])
        assert r.exit_code == 0, r.output
    assert seen == [True, False, True]


def test_bare_cuda_device_names_one_gpu(monkeypatch):
    """`--device cuda` resolves to an indexed GPU (the one `auto` would pick), and a missing index fails by name."""
    from exl3tool.plan import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda", local_rank=3) == torch.device("cuda", 1)
    assert resolve_device("auto", local_rank=1) == torch.device("cuda", 1)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="has 2 GPU"):
        resolve_device("cuda:2")


class _RacingFuture:
    """A publish that finishes between two looks: ``done()`` is False the first time it is asked, True after."""

    def __init__(self) -> None:
        self.asked = 0

    def done(self) -> bool:
        self.asked += 1
        return self.asked > 1

    def result(self):
        return None


def test_publish_slot_wait_survives_publishes_finishing_while_it_looks():
    """Two publishes finish while the throttle looks at them: it returns instead of raising StopIteration."""
    from exl3tool.operations.warm.pipeline import _Pipeline

    pipeline = _Pipeline.__new__(_Pipeline)
    pipeline.pending = deque((object(), _RacingFuture()) for _ in range(_Pipeline.MAX_PUBLISHES))
    pipeline.results, pipeline.on_done = [], None
    pipeline._finish_ready = lambda wait=False: None
    pipeline._wait_for_publish_slot()
    assert all(f.asked >= 2 for _, f in pipeline.pending)


def test_interrupt_while_waiting_to_publish_releases_the_claim(offline, tmp_path, monkeypatch):
    """An interrupt between encode and publish (the throttle) releases the entry lock it claimed."""
    from exl3tool.checkpoint import open_checkpoint
    from exl3tool.operations.warm import run_plan
    from exl3tool.operations.warm.pipeline import _Pipeline

    checkpoint = open_checkpoint(REPO)
    request = ServerRequest(model=REPO, tp_sizes=(1,), layers=("*.o_proj",), cache_dir=str(tmp_path), **ENC)
    _, plan, store = prepare(request)

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(_Pipeline, "_wait_for_publish_slot", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_plan(plan, checkpoint, store, device=torch.device("cpu"), encode=fake_encode)
    assert not list(tmp_path.rglob("*.safetensors"))
    _no_leftovers(store, plan)  # every entry lock that exists can be taken at once
