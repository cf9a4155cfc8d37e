"""One rule, one place (issue 42, goal 5): the bits default, the cache root, the Hub offline rule and the entry path
are each computed by one function, and the library and the CLI give the same answer.

Before: ``prepare(ServerRequest(model=M))`` planned bits 6 where ``cache warm`` planned the server's
``VLLM_EXL3_ONLINE_TRELLIS_BITS`` (the default lived in the CLI); the cache root was computed twice (and per release
only once: an older server ignores ``XDG_CACHE_HOME``); the checkpoint reader ignored ``TRANSFORMERS_OFFLINE``; the
entry path was spelled in five files. The oracles are independent: ``helpers.server_cache_root`` and
``helpers.server_path`` (written from the fork's two cache modules) and huggingface_hub itself.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import zlib

import pytest

from exl3tool.cache.key import CacheKey
from exl3tool.plan import ServerRequest, prepare

from helpers import ENC, ENC_ARGS, LINEAR, run, server_cache_module, server_cache_root, server_key_json, server_path

CLEAN = ("VLLM_EXL3_ONLINE_TRELLIS_BITS", "VLLM_EXL3_ONLINE_CACHE_DIR", "VLLM_CACHE_ROOT", "XDG_CACHE_HOME",
         "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_EXL3_ENCODER_SOURCE", "VLLM_EXL3_ENCODER_REVISION")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in CLEAN:
        monkeypatch.delenv(name, raising=False)


def test_bits_default_is_the_same_in_the_library_and_the_cli(tiny_llama, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_EXL3_ONLINE_TRELLIS_BITS", "4")
    _, plan, _ = prepare(ServerRequest(model=str(tiny_llama), cache_dir=str(tmp_path), **ENC))
    code, out, err = run(["cache", "warm", str(tiny_llama), "--dry-run", "--json", "--cache-dir", str(tmp_path),
                          *ENC_ARGS], capsys)
    assert code == 0, err
    assert plan.bits == json.loads(out)["bits"] == 4  # before: the library planned 6
    # prepare's environ is the server's environment: its variable decides, an explicit bits wins
    _, plan5, _ = prepare(ServerRequest(model=str(tiny_llama), cache_dir=str(tmp_path), **ENC),
                          environ={"VLLM_EXL3_ONLINE_TRELLIS_BITS": " 5 "})
    _, plan8, _ = prepare(ServerRequest(model=str(tiny_llama), cache_dir=str(tmp_path), bits=8, **ENC),
                          environ={"VLLM_EXL3_ONLINE_TRELLIS_BITS": "5"})
    _, plan6, _ = prepare(ServerRequest(model=str(tiny_llama), cache_dir=str(tmp_path), **ENC), environ={})
    assert (plan5.bits, plan8.bits, plan6.bits) == (5, 8, 6)


ROOT_CASES = {
    "default": {},
    "xdg": {"XDG_CACHE_HOME": "@/xdg"},
    "vllm-root": {"VLLM_CACHE_ROOT": "@/vroot"},
    "both": {"XDG_CACHE_HOME": "@/xdg", "VLLM_CACHE_ROOT": "~/vr"},
    "online-dir": {"XDG_CACHE_HOME": "@/xdg", "VLLM_EXL3_ONLINE_CACHE_DIR": "~/online"},
}


@pytest.mark.parametrize("release", ["gilded-gnosis-r33", "gilded-gnosis-r34", "infernal-invocation-r18"])
@pytest.mark.parametrize("case", list(ROOT_CASES))
def test_cache_root_is_the_releases_in_the_library_the_cli_and_a_launch(tiny_llama, tmp_path, monkeypatch, capsys,
                                                                       release, case):
    """XDG_CACHE_HOME on an older release: its server looks in ~/.cache/vllm/exl3_online. Every path agrees with the
    independent oracle of that release's cache module."""
    from exl3tool.cache.settings import cache_root
    from exl3tool.releases import release as release_row

    home = tmp_path / "home"
    env = {k: v.replace("@", str(tmp_path)) for k, v in ROOT_CASES[case].items()}
    want = server_cache_root({**env, "HOME": str(home)}, server_cache_module(release))
    assert cache_root({**env, "HOME": str(home)}, release_row(release)) == want  # the library
    monkeypatch.setenv("HOME", str(home))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, out, err = run(["cache", "warm", str(tiny_llama), "--dry-run", "--json", "--server-release", release,
                          "--quantization-config", LINEAR, *ENC_ARGS], capsys)  # the CLI, this process's environment
    assert code == 0, err
    assert json.loads(out)["cache_root"] == str(want)
    for k in env:
        monkeypatch.delenv(k)
    assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in {**env, "HOME": str(home)}.items())
    launch = (f"env {assigns} VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ENCODER_SOURCE=/e VLLM_EXL3_ENCODER_REVISION=r "
              f"vllm serve {tiny_llama} --quantization-config {shlex.quote(LINEAR)}")
    code, out, err = run(["cache", "warm", "--dry-run", "--json", "--server-release", release, "--launch", launch],
                         capsys)  # a launch
    assert code == 0, err
    assert json.loads(out)["cache_root"] == str(want)
    if case == "xdg" and server_cache_module(release) == "older":
        assert "XDG_CACHE_HOME" in err and "ignored" in err  # said, not silently different


@pytest.mark.parametrize("env", [
    {"TRANSFORMERS_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"},
    {"HF_HUB_OFFLINE": " 1"}, {"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "yes"}, {},
])
def test_hub_offline_is_huggingface_hubs_in_every_reader(env, monkeypatch):
    """huggingface_hub itself decides (a fresh interpreter reads its constants); before: the checkpoint reader
    ignored TRANSFORMERS_OFFLINE and stripped the value."""
    from exl3tool.cache.hub import hub_offline
    from exl3tool.checkpoint import source

    child = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    truth = subprocess.run([sys.executable, "-c", "import huggingface_hub.constants as c; print(c.HF_HUB_OFFLINE)"],
                           env={**child, **env}, capture_output=True, text=True, check=True).stdout.strip() == "True"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert hub_offline() == source._env_offline() == truth


def test_entry_path_is_the_servers_everywhere(tmp_path):
    """The store, the records, the bundles and the verdicts share one layout, the server's (independent oracle)."""
    from exl3tool.cache.entry import _path_problem
    from exl3tool.cache.paths import entry_path, entry_relpath
    from exl3tool.cache.records import ProvenanceRecord, RecordEntry, entry_file

    mid, eid = "ab" * 32, "cd" * 32
    prefix = "model.layers.0.mlp.down_proj"
    key = CacheKey(mid, eid, prefix, 6, zlib.crc32(prefix.encode()) & 0x7FFFFFFF, 4, 3, 512, 256)
    want = server_path(tmp_path, mid, 4, 3, server_key_json(mid, eid, key.prefix, 6, 4, 3, 512, 256))
    assert entry_path(key, tmp_path) == want
    assert tmp_path / entry_relpath(mid, 4, 3, key.digest()) == want
    assert _path_problem(want, key) is None and _path_problem(want.parent.parent / "tp4-rank2" / want.name, key)
    record = ProvenanceRecord.__new__(ProvenanceRecord)
    object.__setattr__(record, "model_identity", mid)
    assert entry_file(tmp_path, record, RecordEntry(key.digest(), key.prefix, 4, 3, "written")) == want


def test_a_warm_for_an_older_release_with_xdg_cache_home_hits_its_server(tiny_llama, tmp_path, monkeypatch, capsys):
    """Before: exl3tool wrote under $XDG_CACHE_HOME/vllm/exl3_online, where a Gilded Gnosis r33 server never looks
    (its root is ~/.cache/vllm/exl3_online): every look-up missed. The independent server decides."""
    from helpers import fake_warm, server_encoder_identity, server_lookup, server_model_identity

    env = {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    request = ServerRequest(model=str(tiny_llama), quantization_config=LINEAR, server_release="gilded-gnosis-r33",
                          **ENC)
    fake_warm(request, monkeypatch)
    _, plan, _ = prepare(request)
    mid = server_model_identity(str(tiny_llama))
    eid = server_encoder_identity(ENC["encoder_root"], ENC["encoder_revision"])
    jobs = [j for j in plan.jobs if j.state != "skipped"]

    def hits(root) -> int:
        return sum(bool(server_lookup(root, mid, eid, j.prefix, 6, 1, j.tp_rank, j.input_size, j.output_size))
                   for j in jobs)

    assert jobs and hits(server_cache_root(env, "older")) == len(jobs)
    assert hits(server_cache_root(env, "newer")) == 0 and server_cache_root(env, "newer") != \
        server_cache_root(env, "older")
    # one release per run: every cache command given the same --server-release reads the root the warm wrote
    older = server_cache_root(env, "older")
    r33 = ["--server-release", "gilded-gnosis-r33"]
    code, out, err = run(["cache", "ls", "--json", *r33], capsys)
    assert code == 0 and json.loads(out)["root"] == str(older) and json.loads(out)["entries"] == len(jobs), err
    code, out, err = run(["cache", "verify", "--json", *r33], capsys)
    assert code == 0 and json.loads(out)["entries"] == len(jobs), err
    code, out, err = run(["cache", "prune", "--temp", "--dry-run", "--json", *r33], capsys)
    assert code == 0 and str(older) in out, err
    code, _, err = run(["cache", "show", jobs[0].digest[:12], *r33], capsys)
    assert code == 0 and str(older) in err + _, err
    bundle = tmp_path / "b.tar"
    code, out, err = run(["cache", "export", str(bundle), "--json", *r33], capsys)
    assert code == 0 and json.loads(out)["entries"] == len(jobs), err
    code, out, err = run(["cache", "import", str(bundle), "--json", *r33], capsys)
    assert code == 0 and json.loads(out)["present"] == len(jobs), err
    code, _, err = run(["cache", "ls"], capsys)  # no release named: the root depends on it, so no answer
    assert code == 2 and str(server_cache_root(env, "newer")) in err and "--server-release" in err
    code, _, err = run(["cache", "ls", "--cache-dir", str(older), *r33], capsys)
    assert code == 2 and "--server-release does nothing with --cache-dir" in err
