"""Each distinct shard is encoded once: replicated layers on every rank and TP size share one encode, published under
every key with the bytes a separate encode writes (tiny GLM-5: the DSA indexer's ``wq_b`` is a ReplicatedLinear).

The encodes are real (K=6 on the CPU) on 128 x 128 layers (64 tiles each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from exl3tool.checkpoint import RankJob, open_checkpoint, plan_layers, rank_local_weight, rank_reads
from exl3tool.plan import ServerRequest, prepare
from exl3tool.operations.warm import warm
from exl3tool.plan.sharing import group_jobs, share_jobs, sharing_figures
from exl3tool.releases import newest
from helpers import ENC, LINEAR, completed

from tiny_models import write_glm5, write_glm53
from seeds import fresh_seed

WQ_B = "model.layers.1.self_attn.indexer.wq_b"
KV_B = "model.layers.1.self_attn.kv_b_proj"  # sharded: one encode per rank


@pytest.fixture(scope="module")
def glm5(tmp_path_factory) -> Path:
    return write_glm5(tmp_path_factory.mktemp("glm5") / "m", seed=fresh_seed())


def _files(cache: Path) -> dict[Path, bytes]:
    return {p.relative_to(cache): p.read_bytes() for p in cache.rglob("*.safetensors") if not p.name.startswith(".")}


def test_reads_are_equal_exactly_where_the_plan_replicates(glm5):
    """Replicated layers read the same slices on every rank and TP size; sharded layers never repeat a read."""
    plan = plan_layers(open_checkpoint(str(glm5)), release=newest())
    jobs = [rj for tp in (1, 2, 4) for rj in plan.for_tp(tp)]
    by_layer: dict[str, set] = {}
    for rj in jobs:
        by_layer.setdefault(rj.prefix, set()).add(rank_reads(rj))
    for layer in plan.layers:
        if layer.prefix not in by_layer:
            continue
        expected = 1 if layer.parallel == "replicated" else sum(rj.prefix == layer.prefix for rj in jobs)
        assert len(by_layer[layer.prefix]) == expected, (layer.prefix, layer.parallel)
    ckpt = open_checkpoint(str(glm5))
    for rj in jobs:  # the reads are what rank_local_weight reads: equal reads, equal (bit-identical) weights
        if rj.prefix == WQ_B:
            alone = RankJob(rj.layer, 1, 0, rj.input_size, rj.output_size)
            assert rank_local_weight(ckpt, rj).equal(rank_local_weight(ckpt, alone))


def test_glm53_g_a_proj_is_shared_across_ranks(tmp_path):
    plan = plan_layers(open_checkpoint(str(write_glm53(tmp_path / "g"))), overlay=LINEAR, release=newest())
    shared = {rj.prefix for rj in plan.for_tp(2) if rj.layer.parallel == "replicated"}
    assert shared and all(p.endswith(".g_a_proj") for p in shared)


def test_share_jobs_keeps_each_group_on_one_worker(glm5, tmp_path):
    _, plan, _ = prepare(ServerRequest(model=str(glm5), tp_sizes=(1, 2, 4), cache_dir=str(tmp_path), **ENC))
    todo = plan.todo
    groups = group_jobs(todo)
    assert max(len(g.jobs) for g in groups) == 1 + 2 + 4  # every wq_b: 7 entries, one encode
    assert sharing_figures(todo)["encodes_saved"] == 4 * 6
    for workers in (1, 2, 3):
        shares = [share_jobs(todo, w, workers) for w in range(workers)]
        digests = [j.digest for s in shares for j in s]
        assert sorted(digests) == sorted(j.digest for j in todo) and len(set(digests)) == len(digests)
        where = {j.digest: w for w, s in enumerate(shares) for j in s}
        for g in groups:
            assert len({where[j.digest] for j in g.jobs}) == 1
            members = [j.digest for j in g.jobs]
            share = [j.digest for j in shares[where[members[0]]]]
            first = share.index(members[0])
            assert share[first:first + len(members)] == members  # one after another: one encode in flight
        loads = [sum(g.tiles for g in group_jobs(s)) for s in shares]
        assert max(loads) - min(loads) <= max(g.tiles for g in groups)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_one_encode_published_under_every_key_byte_for_byte(glm5, tmp_path, overlap):
    """wq_b at TP 1, 2, 4 (7 entries) from one encode, each file with its own key and checksum and byte for byte
    what a warm of that one (TP size, rank) alone writes."""
    cache = tmp_path / "all"
    request = ServerRequest(model=str(glm5), tp_sizes=(1, 2, 4), layers=(WQ_B,), cache_dir=str(cache),
                          device="cpu", overlap=overlap, **ENC)
    summary = warm(request)
    assert summary.counts == {"hit": 0, "encoded": 7, "skipped": 0, "failed": 0}
    assert summary.encodes == 1 and summary.encodes_saved == 6
    owners = [e for e in summary.entries if e.reused_from is None]
    assert len(owners) == 1 and {e.reused_from for e in summary.entries if e.reused_from} == {owners[0].digest}
    files = _files(cache)
    assert len(files) == 7
    keys = set()
    for e in summary.entries:
        with safe_open(e.path, "pt") as f:
            meta = f.metadata()
        key = json.loads(meta["cache_key"])
        assert (key["tp_world_size"], key["tp_rank"]) == (e.tp_size, e.tp_rank)
        keys.add(meta["cache_key"])
    assert len(keys) == 7
    for tp, rank in ((4, 3),) if not overlap else ((4, 3), (1, 0)):
        alone = tmp_path / f"alone{tp}{rank}"
        one = warm(ServerRequest(model=str(glm5), tp_sizes=(tp,), tp_ranks=(rank,), layers=(WQ_B,),
                               cache_dir=str(alone), device="cpu", overlap=overlap, **ENC))
        assert one.encodes == 1 and one.entries[0].reused_from is None
        (rel, data), = _files(alone).items()
        assert files[rel] == data, (tp, rank)
    again = warm(request)  # all hits: nothing reused, nothing encoded
    assert again.counts["hit"] == 7 and again.encodes == 0 and again.encodes_saved == 0


def _env() -> dict:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")


def test_dry_run_reports_reuse_and_encodes(glm5, tmp_path):
    args = ["cache", "warm", str(glm5), "--tp-size", "1,2", "--layers", WQ_B,
            "--layers", KV_B, "--cache-dir", str(tmp_path), "--dry-run", "--encoder-root", ENC["encoder_root"],
            "--encoder-revision", ENC["encoder_revision"]]
    r = completed([*args, "--json"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    jobs = {(j["prefix"], j["tp_size"], j["tp_rank"]): j for j in doc["jobs"]}
    assert doc["encodes"] == 4 and doc["sharing"]["encodes_saved"] == 2
    leader = [j for k, j in jobs.items() if k[0] == WQ_B and "reused_from" not in j]
    assert len(leader) == 1
    assert {j["reused_from"] for k, j in jobs.items() if k[0] == WQ_B and j is not leader[0]} == {leader[0]["digest"]}
    assert all("reused_from" not in j for k, j in jobs.items() if k[0] == KV_B)
    r = completed(args)
    assert r.returncode == 0 and "need 4 encodes: 2 saved" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_torchrun_workers_keep_a_share_group_together(glm5, tmp_path):
    """Two gloo workers on the CPU: wq_b at TP 1 and 2 (3 entries, one encode) goes whole to one worker."""
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "exl3tool",
           "cache", "warm", str(glm5), "--tp-size", "1,2", "--layers", WQ_B, "--layers",
           "model.layers.1.self_attn.o_proj", "--cache-dir", str(cache), "--device", "cpu", "--json", "--quiet",
           "--encoder-root", ENC["encoder_root"], "--encoder-revision", ENC["encoder_revision"]]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["workers"] == 2 and doc["counts"]["encoded"] == 6 and doc["encodes"] == 4
    wq = [e for e in doc["entries"] if e["prefix"] == WQ_B]
    assert len({e["worker"] for e in wq}) == 1 and sum("reused_from" in e for e in wq) == 2
    assert {e["worker"] for e in doc["entries"]} == {0, 1}
    assert len(_files(cache)) == 6


@pytest.mark.gpu
def test_split_encode_on_two_streams_writes_the_same_bytes(glm5, tmp_path):
    """On CUDA the overlapped warm (weights read ahead, publishes on their own thread, share groups encoded once)
    writes entries byte for byte those of a warm without overlap (one thread)."""
    layers = ("model.layers.0.*", "model.layers.1.*")
    runs = {}
    for overlap in (True, False):
        cache = tmp_path / f"overlap{overlap}"
        summary = warm(ServerRequest(model=str(glm5), tp_sizes=(1, 2), layers=layers, cache_dir=str(cache),
                                   device="cuda", overlap=overlap, **ENC))
        assert summary.counts["failed"] == 0 and summary.counts["encoded"] > 10
        stages = summary.worker_stats[0]["stages"]
        assert {"viterbi", "pack"} <= set(stages) and (("scale_search" in stages) or not overlap)
        runs[overlap] = _files(cache)
    assert runs[True].keys() == runs[False].keys()
    assert [k for k in runs[True] if runs[True][k] != runs[False][k]] == []
