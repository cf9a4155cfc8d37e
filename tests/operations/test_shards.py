"""`cache warm --shard I/N` and the schedulers' index variables: a static split of the plan by encode cost.

The split is checked against properties bad code breaks: the shards' jobs are the unsharded plan's, each in one
shard; the jobs one encode fills (``sharing``) never straddle two shards; the split is the same whatever the cache
holds (so a retried task finds what it published); the loads are within one encode of each other. The processes
test runs N shard processes at once into one cache (the fake encoder, ``tests/fake_exl3tool.py``) and compares
with an unsharded warm byte for byte, then checks the union with `cache check`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exl3tool.checkpoint.tiny import write_tiny
from exl3tool.errors import ConfigError
from exl3tool.plan import ServerRequest, prepare
from exl3tool.plan.sharing import shard_identity
from exl3tool.plan.shards import Shard, parse_shard, resolve_shard

from helpers import ENC, ENC_ARGS, completed, fake_warm

FAKE_CLI = Path(__file__).resolve().parent.parent / "fake_exl3tool.py"
TP = (1, 2)  # glm5.3 at TP 1 and 2: 42 entries, 36 encodes (g_a_proj is replicated), 9 skipped


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("shards") / "glm5.3", "glm5.3", seed=5)


def _request(model: Path, cache: Path, shard: Shard | None = None) -> ServerRequest:
    return ServerRequest(model=str(model), tp_sizes=TP, cache_dir=str(cache), device="cpu", shard=shard, **ENC)


def _plan(model: Path, cache: Path, shard: Shard | None = None):
    return prepare(_request(model, cache, shard))[1]


# --- the value and the variables ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["3/2", "0/0", "x/y", "2", "-1/2", "1/-2", "", "1/2/3"])
def test_bad_shard_values_are_refused(text):
    with pytest.raises(ValueError):
        parse_shard(text)
    with pytest.raises(ConfigError):
        resolve_shard(text, None, {})


def test_shard_from_option_and_schedulers():
    assert resolve_shard("1/4", None, {"JOB_COMPLETION_INDEX": "3"}) == Shard(1, 4, "--shard")  # the option wins
    assert resolve_shard(None, None, {}) is None
    k8s = resolve_shard(None, 5, {"JOB_COMPLETION_INDEX": "4"})
    assert (k8s.index, k8s.count) == (4, 5) and "JOB_COMPLETION_INDEX" in k8s.source and "--shard-count" in k8s.source
    slurm = resolve_shard(None, None, {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "3",
                                       "SLURM_ARRAY_TASK_MIN": "0"})
    assert (slurm.index, slurm.count) == (0, 3) and "SLURM_ARRAY_TASK_ID" in slurm.source
    # --array=1-3: the first task is 1; --array=10-16:3: tasks 10, 13, 16
    assert resolve_shard(None, None, {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "3",
                                      "SLURM_ARRAY_TASK_MIN": "1"}).index == 2
    assert resolve_shard(None, None, {"SLURM_ARRAY_TASK_ID": "13", "SLURM_ARRAY_TASK_COUNT": "3",
                                      "SLURM_ARRAY_TASK_MIN": "10", "SLURM_ARRAY_TASK_STEP": "3"}).index == 1


@pytest.mark.parametrize("count, env, words", [
    (None, {"JOB_COMPLETION_INDEX": "2"}, "--shard-count"),  # Kubernetes gives no count
    (2, {"JOB_COMPLETION_INDEX": "2"}, "task 0 to 1"),  # index outside the count
    (None, {"JOB_COMPLETION_INDEX": "two"}, "not an integer"),
    (None, {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "1"},
     "one range"),  # --array=1,3,7: not a range
    (4, {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "0"}, "disagrees"),
    (None, {"SLURM_ARRAY_TASK_ID": "0", "JOB_COMPLETION_INDEX": "0"}, "both"),
    (3, {}, "without an index"),
])
def test_bad_scheduler_variables_are_one_line_errors(count, env, words):
    with pytest.raises(ConfigError) as err:
        resolve_shard(None, count, env)
    assert words in str(err.value) and "\n" not in str(err.value)


BEYOND = "more than the plan's 51 jobs (36 encodes"  # 42 entries and 9 skipped jobs


@pytest.mark.parametrize("argv, env, words", [
    (["--shard", "3/2"], {}, None), (["--shard", "0/0"], {}, None), (["--shard", "x/y"], {}, None),
    ([], {"JOB_COMPLETION_INDEX": "1"}, None), (["--shard-count", "2"], {}, None),
    (["--shard-count", "0", "--shard", "0/1"], {}, None),
    # a count beyond the plan's jobs: refused before anything is sized by it (2**63 would not fit in memory)
    (["--shard", "0/52"], {}, BEYOND), (["--shard", "0/99999999999999999999"], {}, BEYOND),
    (["--shard", "0/9223372036854775807"], {}, BEYOND),
    ([], {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "9223372036854775807"}, BEYOND),
    (["--shard-count", "99999999999999999999"], {"JOB_COMPLETION_INDEX": "0"}, BEYOND),
])
def test_cli_refuses_bad_shards_with_exit_2(glm, tmp_path, argv, env, words):
    r = completed(["cache", "warm", glm, "--tp-size", "1,2", *ENC_ARGS, "--cache-dir", tmp_path, "--dry-run",
                   *argv], env={**os.environ, **env})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len([line for line in r.stderr.splitlines() if "rror" in line]) == 1, r.stderr
    assert words is None or (words in r.stderr and "from 1 to 51" in r.stderr), r.stderr
    assert not (tmp_path / "v1").exists()


# --- the split -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_split_partitions_the_plan_and_keeps_share_groups_together(glm, tmp_path, count):
    whole = _plan(glm, tmp_path)
    slices = [_plan(glm, tmp_path, Shard(i, count)) for i in range(count)]
    digests = [j.digest for s in slices for j in s.jobs]
    assert sorted(digests) == sorted(j.digest for j in whole.jobs) and len(set(digests)) == len(digests)
    assert {j.digest for j in whole.jobs if j.state == "skipped"} <= {j.digest for j in slices[0].jobs}
    where = {}
    for i, s in enumerate(slices):
        for j in s.jobs:
            if j.state != "skipped":
                where.setdefault(shard_identity(j), set()).add(i)
    assert all(len(shards) == 1 for shards in where.values()), "an encode's jobs straddle two shards"
    assert sum(s.shard.encodes for s in slices) == len(where) == 36
    loads = [s.shard.cost_tiles for s in slices]
    biggest = max(j.tiles for j in whole.jobs if j.state != "skipped")
    assert max(loads) - min(loads) <= biggest and sum(loads) == slices[0].shard.plan_cost_tiles


def test_split_does_not_depend_on_the_cache(glm, tmp_path, monkeypatch):
    """Shard 1 of 3 before and after another shard and part of its own slice were published: the same jobs."""
    cache = tmp_path / "c"
    before = [j.digest for j in _plan(glm, cache, Shard(1, 3)).jobs]
    fake_warm(_request(glm, cache, Shard(0, 3)), monkeypatch)
    fake_warm(ServerRequest(model=str(glm), tp_sizes=(2,), cache_dir=str(cache), device="cpu", **ENC,
                          layers=("*.layers.0.*",)), monkeypatch)
    after = _plan(glm, cache, Shard(1, 3))
    assert [j.digest for j in after.jobs] == before
    assert 0 < after.count("hit") < len(after.jobs)


def test_dry_run_shows_the_shard_and_an_empty_shard_is_success(glm, tmp_path):
    r = completed(["cache", "warm", glm, "--tp-size", "1,2", *ENC_ARGS, "--cache-dir", tmp_path, "--dry-run",
                   "--json"], env={**os.environ, "SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "3",
                                   "SLURM_ARRAY_TASK_MIN": "4"})
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["shard"]["index"] == 1 and doc["shard"]["count"] == 3 and "SLURM_ARRAY_TASK_ID" in doc["shard"]["source"]
    expected = [j.digest for j in _plan(glm, tmp_path, Shard(1, 3)).jobs]
    assert [j["digest"] for j in doc["jobs"]] == expected and doc["shard"]["jobs"] == len(expected)
    assert "shard 1/3 (from SLURM_ARRAY_TASK_ID" in r.stderr

    r = completed(["cache", "warm", glm, "--tp-size", "1,2", *ENC_ARGS, "--cache-dir", tmp_path, "--json",
                   "--shard", "39/40", "--device", "cpu"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["shard"]["empty"] is True and doc["entries"] == [] and doc["counts"]["encoded"] == 0
    assert "no job" in r.stderr and "nothing to do here" in r.stderr


# --- N processes into one cache ------------------------------------------------------------------------------------

def _files(cache: Path) -> dict[Path, bytes]:
    return {p.relative_to(cache): p.read_bytes() for p in (cache / "v1").rglob("*.safetensors")}


@pytest.mark.slow
def test_concurrent_shard_processes_equal_an_unsharded_warm(glm, tmp_path, monkeypatch):
    cache, n = tmp_path / "shared", 3
    base = [sys.executable, str(FAKE_CLI), "cache", "warm", str(glm), "--tp-size", "1,2", *ENC_ARGS,
            "--cache-dir", str(cache), "--device", "cpu", "--json", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([*base, "--shard", f"{i}/{n}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for i in range(n)]
    docs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        docs.append(json.loads(out))
    whole = _plan(glm, tmp_path / "empty")
    reported = [(e["digest"], e["status"]) for d in docs for e in d["entries"]]
    assert sorted(d for d, _ in reported) == sorted(j.digest for j in whole.jobs)  # union == the plan, once each
    assert {s for _, s in reported} == {"encoded", "skipped"}  # nothing found: no shard wrote another's entry
    assert sum(d["encodes"] for d in docs) == 36 and [d["shard"]["index"] for d in docs] == [0, 1, 2]
    assert sum(d["counts"]["encoded"] for d in docs) == 42 == len(_files(cache))

    alone = tmp_path / "alone"  # the same warm, unsharded, in this process: the same files, byte for byte
    summary = fake_warm(_request(glm, alone), monkeypatch)
    assert summary.counts["encoded"] == 42 and _files(alone) == _files(cache)

    again = subprocess.run([*base, "--shard", f"1/{n}"], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    doc = json.loads(again.stdout)  # resumable: a re-run shard finds what it published
    assert doc["counts"]["encoded"] == 0 and doc["counts"]["hit"] == docs[1]["counts"]["encoded"]

    check = completed(["cache", "check", glm, "--tp-size", "1,2", *ENC_ARGS, "--cache-dir", cache, "--json"])
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    report = json.loads(check.stdout)
    assert report["ok"] is True and report["lookups"] == report["hit"] == 42


@pytest.mark.slow
def test_torchrun_inside_a_shard_splits_its_slice(glm, tmp_path):
    """Shard 1 of 2 under torchrun with two gloo workers: both encode, together exactly the shard's slice."""
    cache = tmp_path / "c"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(FAKE_CLI),
           "cache", "warm", str(glm), "--tp-size", "1,2", *ENC_ARGS, "--cache-dir", str(cache), "--device", "cpu",
           "--json", "--quiet", "--shard", "1/2"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    expected = _plan(glm, tmp_path / "empty", Shard(1, 2)).jobs
    assert doc["workers"] == 2 and doc["shard"]["index"] == 1
    assert sorted(e["digest"] for e in doc["entries"]) == sorted(j.digest for j in expected)
    assert {e["worker"] for e in doc["entries"] if e["status"] == "encoded"} == {0, 1}
    assert doc["counts"]["encoded"] == len(expected) == len(list((cache / "v1").rglob("*.safetensors")))
