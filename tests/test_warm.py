"""`encode` / `cache warm` on a synthetic Llama in a Hub-cache layout (offline) and on the real MiniLM BERT.

The encodes are real (K=6 on the CPU), so the layer sets are kept small: each test says what it encodes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exl3tool.cache import CacheStore, layer_seed
from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.encode import dequantize_tensors
from exl3tool.warm import WarmRequest, prepare, share_jobs, warm

REPO = "test-org/tiny-llama"
TINY = dict(hidden=256, heads=4, kv_heads=2, intermediate=512, layers=2, vocab=512)
ENC = dict(encoder_root="/encoders/exllamav3", encoder_revision="test-rev")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A fresh-random synthetic Llama in a Hub cache; returns (hub cache dir, snapshot dir, plain dir)."""
    base = tmp_path_factory.mktemp("warm")
    seed = random.SystemRandom().randrange(2**31)
    snap = write_llama_checkpoint(base / "plain", **TINY, seed=seed, shards=2, hub_cache=base / "hub", repo_id=REPO)
    return base / "hub", snap, base / "plain"


@pytest.fixture
def offline(monkeypatch, hub):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub[0]))
    monkeypatch.delenv("VLLM_EXL3_ENCODER_SOURCE", raising=False)
    return hub


def _env(hub) -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub[0]), PYTHONUNBUFFERED="1")


def _cli(args, env, **kw):
    return subprocess.run([sys.executable, "-m", "exl3tool", *args], capture_output=True, text=True, env=env, **kw)


def _weights(plain: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(plain.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_plan_prefixes_seeds_and_shapes_for_tp_1_2_4(offline, tmp_path):
    _, plan, _ = prepare(WarmRequest(model=REPO, tp_sizes=(1, 2, 4), cache_dir=str(tmp_path), **ENC))
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
    _, plan, _ = prepare(WarmRequest(model=REPO, tp_sizes=(1, 2, 4), cache_dir=str(tmp_path), **ENC))
    todo = plan.todo
    for workers in (2, 3, 5):
        shares = [share_jobs(todo, w, workers) for w in range(workers)]
        digests = [j.digest for s in shares for j in s]
        assert sorted(digests) == sorted(j.digest for j in todo) and len(set(digests)) == len(digests)
        loads = [sum(j.tiles for j in s) for s in shares]
        assert max(loads) - min(loads) <= max(j.tiles for j in todo)


def test_warm_kill_resume_decode_and_all_hits(hub, offline, tmp_path):
    """o_proj of both layers at TP 1 and 2 (6 entries): kill a warm after its first entry, resume, check slices."""
    cache = tmp_path / "cache"
    args = ["cache", "warm", REPO, "--tp-sizes", "1,2", "--layers", "*.o_proj", "--cache-dir", str(cache),
            "--device", "cpu", "--encoder-root", ENC["encoder_root"], "--encoder-revision", ENC["encoder_revision"]]
    proc = subprocess.Popen([sys.executable, "-m", "exl3tool", *args, "--quiet"], env=_env(hub),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and not list(cache.rglob("*.safetensors")):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    published = {p for p in cache.rglob("*.safetensors") if not p.name.startswith(".")}
    assert 1 <= len(published) < 6, "the kill should land between the first and the last entry"

    request = WarmRequest(model=REPO, tp_sizes=(1, 2), layers=("*.o_proj",), cache_dir=str(cache), device="cpu", **ENC)
    resumed = warm(request)
    assert resumed.counts == {"hit": len(published), "encoded": 6 - len(published), "skipped": 0, "failed": 0}

    full = _weights(hub[2])
    store = CacheStore(cache, "readonly")
    for e in resumed.entries:
        w = full[e.prefix.replace("o_proj", "o_proj.weight")].float()  # [out, in]
        k = 256 // e.tp_size
        want = w[:, e.tp_rank * k:(e.tp_rank + 1) * k].t()  # row-parallel: input columns of this rank
        other = w[:, ((e.tp_rank + 1) % e.tp_size) * k:][:, :k].t()
        _, plan, _ = prepare(WarmRequest(model=REPO, tp_sizes=(e.tp_size,), layers=(e.prefix,), cache_dir=str(cache), **ENC))
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
    assert again.counts == {"hit": 6, "encoded": 0, "skipped": 0, "failed": 0}
    assert time.perf_counter() - t0 < 30


def test_torchrun_two_cpu_workers_split_the_plan(hub, tmp_path):
    """layer-1 o_proj at TP 1 and 2 (3 entries), two gloo workers: the union is the plan, nothing twice."""
    cache = tmp_path / "cache"
    env = _env(hub)
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "exl3tool",
           "cache", "warm", REPO, "--tp-sizes", "1,2", "--layers", "model.layers.1.self_attn.o_proj",
           "--cache-dir", str(cache), "--device", "cpu", "--json", "--quiet",
           "--encoder-root", ENC["encoder_root"], "--encoder-revision", ENC["encoder_revision"]]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["workers"] == 2 and doc["counts"]["encoded"] == 3 and doc["counts"]["failed"] == 0
    jobs = [(e["prefix"], e["tp_size"], e["tp_rank"]) for e in doc["entries"]]
    assert sorted(jobs) == sorted({(p, t, r_) for p, t, r_ in jobs}) and len(jobs) == 3
    assert {e["worker"] for e in doc["entries"]} == {0, 1}
    assert len([p for p in cache.rglob("*.safetensors") if not p.name.startswith(".")]) == 3
    assert len(doc["worker_stats"]) == 2


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
    from exl3tool.encode.encoded import EncodedLinear
    from exl3tool.warm import run_plan

    def fake_encode(weight, bits, seed, device):  # shapes right, contents irrelevant here; fast
        k, n = weight.shape
        g = torch.Generator().manual_seed(seed)
        return EncodedLinear(torch.randint(-32768, 32767, (k // 16, n // 16, 16 * bits), generator=g,
                                           dtype=torch.int32).to(torch.int16),
                             torch.rand(k, generator=g).half(), torch.rand(n, generator=g).half(), 0.1, 1.0, bits)

    request = WarmRequest(model=REPO, tp_sizes=(1, 2), layers=("*.o_proj", "*.down_proj"), cache_dir=str(tmp_path), **ENC)
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
