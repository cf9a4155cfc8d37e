"""`exl3tool identity` and `exl3tool cache ls|show|verify|prune` through Typer's CliRunner: exit codes and --json."""

from __future__ import annotations

import json
import os
import time

import pytest
from helpers import ENCODER_ID, MODEL_ID, CliRunner, make_encoded

from exl3tool.cache import CacheKey, CacheStore, entry_path, lock_path
from exl3tool.cli import _register, app
from exl3tool.errors import ConfigError, InputError


_register()
runner = CliRunner()
OTHER_MODEL = "ab" * 32


def run(*args):
    return runner.invoke(app, list(args))


@pytest.fixture()
def cache(tmp_path):
    root = tmp_path / "cache"
    store = CacheStore(root)
    for model in (MODEL_ID, OTHER_MODEL):
        for world in (1, 2):
            for rank in range(world):
                for prefix in ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"):
                    key = CacheKey.for_layer(model, ENCODER_ID, prefix, 6, world, rank, 128, 256)
                    store.publish(key, make_encoded(128, 256))
    return root


def test_identity_json_matches_the_worked_example(monkeypatch):
    monkeypatch.delenv("VLLM_EXL3_ENCODER_SOURCE", raising=False)
    res = run("identity", "meta-llama/Llama-3.1-8B-Instruct", "--revision", "0123456789abcdef0123456789abcdef01234567",
              "--encoder-root", "/encoders/exllamav3", "--encoder-revision", "fedcba9876543210fedcba9876543210fedcba98", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["model"]["identity"] == MODEL_ID and data["model"]["kind"] == "hub"
    assert data["model"]["revision"] == "0123456789abcdef0123456789abcdef01234567"
    assert data["encoder"]["identity"] == ENCODER_ID and data["encoder"]["mode"] == "revision"
    human = run("identity", "meta-llama/Llama-3.1-8B-Instruct", "--revision", "0123456789abcdef0123456789abcdef01234567",
                "--encoder-root", "/encoders/exllamav3", "--encoder-revision", "x")
    assert human.exit_code == 0 and MODEL_ID in human.stdout.replace("\n", "").replace("│", "").replace(" ", "")


def test_identity_without_encoder_fails_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_EXL3_ENCODER_SOURCE", raising=False)
    res = run("identity", str(tmp_path))
    assert isinstance(res.exception, ConfigError) and res.exception.exit_code == 2
    assert "--encoder-root" in str(res.exception) and "VLLM_EXL3_ENCODER_SOURCE" in str(res.exception)


def test_identity_hub_unresolvable_fails_closed(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    res = run("identity", "org/missing", "--encoder-root", "/e", "--encoder-revision", "r")
    assert isinstance(res.exception, ConfigError)


def test_ls_groups_by_model_and_tp(cache):
    res = run("cache", "ls", "--cache-dir", str(cache), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["entries"] == 12
    groups = {(g["model_identity"], g["tp_world_size"]): g for g in data["groups"]}
    assert groups[(MODEL_ID, 2)]["ranks"] == [0, 1] and groups[(MODEL_ID, 2)]["entries"] == 4
    res = run("cache", "ls", "--cache-dir", str(cache), "--model", OTHER_MODEL[:8], "--json")
    assert json.loads(res.stdout)["entries"] == 6
    assert run("cache", "ls", "--cache-dir", str(cache)).exit_code == 0


def test_show_by_digest_and_path(cache):
    key = CacheKey.for_layer(MODEL_ID, ENCODER_ID, "model.layers.0.mlp.down_proj", 6, 2, 1, 128, 256)
    res = run("cache", "show", key.digest()[:10], "--cache-dir", str(cache), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["status"] == "valid" and data["key"] == key.as_dict()
    assert data["tensors"]["trellis"] == {"dtype": "I16", "shape": [8, 16, 96]}
    assert data["metadata"]["cache_key"] == key.canonical_json() and "exl3tool_sha256" in data["metadata"]
    path = entry_path(key, cache)
    assert run("cache", "show", str(path), "--cache-dir", str(cache)).exit_code == 0
    path.write_bytes(b"junk")
    assert run("cache", "show", str(path)).exit_code == 1
    res = run("cache", "show", "0" * 12, "--cache-dir", str(cache))
    assert isinstance(res.exception, InputError)


def test_verify_and_prune(cache):
    assert run("cache", "verify", "--cache-dir", str(cache)).exit_code == 0
    key = CacheKey.for_layer(OTHER_MODEL, ENCODER_ID, "model.layers.0.mlp.down_proj", 6, 1, 0, 128, 256)
    bad = entry_path(key, cache)
    bad.write_bytes(bad.read_bytes()[:-10])
    res = run("cache", "verify", "--cache-dir", str(cache), "--json")
    assert res.exit_code == 1
    data = json.loads(res.stdout)
    assert data["valid"] == 11 and [i["path"] for i in data["invalid"]] == [str(bad)]
    assert run("cache", "verify", "--cache-dir", str(cache), "--model", MODEL_ID).exit_code == 0
    # a plan first; the dry run deletes nothing
    res = run("cache", "prune", "--invalid", "--dry-run", "--cache-dir", str(cache), "--json")
    assert res.exit_code == 0
    plan = json.loads(res.stdout)
    assert {p["path"] for p in plan["planned"]} == {str(bad), str(lock_path(bad))} and plan["bytes_planned"] > 0
    assert bad.exists()
    assert isinstance(run("cache", "prune", "--invalid", "--cache-dir", str(cache), "--json").exception, ConfigError)
    res = runner.invoke(app, ["cache", "prune", "--invalid", "--cache-dir", str(cache)], input="n\n")
    assert res.exit_code == 0 and "nothing removed" in res.output and bad.exists()  # declined: nothing removed
    res = runner.invoke(app, ["cache", "prune", "--invalid", "--cache-dir", str(cache)], input="y\n")
    assert res.exit_code == 0 and not bad.exists()
    assert run("cache", "verify", "--cache-dir", str(cache)).exit_code == 0
    live_locks = sorted(cache.rglob("*.lock"))
    assert len(live_locks) == 11


def test_prune_older_than_and_nothing_selected(cache):
    assert isinstance(run("cache", "prune", "--cache-dir", str(cache)).exception, ConfigError)
    old = time.time() - 10 * 86400
    key = CacheKey.for_layer(MODEL_ID, ENCODER_ID, "model.layers.0.self_attn.o_proj", 6, 1, 0, 128, 256)
    os.utime(entry_path(key, cache), (old, old))
    res = run("cache", "prune", "--older-than", "5", "--yes", "--cache-dir", str(cache), "--json")
    assert res.exit_code == 0, res.output
    assert [p["path"] for p in json.loads(res.stdout)["planned"] if p["kind"] == "entry"] == [str(entry_path(key, cache))]
    assert not entry_path(key, cache).exists()
    assert run("cache", "prune", "--older-than", "-1", "--cache-dir", str(cache)).exit_code == 2


def test_default_cache_dir_comes_from_the_environment(cache, monkeypatch):
    monkeypatch.setenv("VLLM_EXL3_ONLINE_CACHE_DIR", str(cache))
    assert json.loads(run("cache", "ls", "--json").stdout)["entries"] == 12


def test_cache_app_is_importable_for_other_commands():
    from exl3tool.cli.commands.cache import cache_app

    assert {c.name for c in cache_app.registered_commands} >= {"ls", "show", "verify", "prune"}


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_real_entry_point_exit_codes(cache):
    """Through `python -m exl3tool` (cli.main): findings exit 1 with one error line and parseable --json."""
    import subprocess
    import sys

    key = CacheKey.for_layer(MODEL_ID, ENCODER_ID, "model.layers.0.mlp.down_proj", 6, 1, 0, 128, 256)
    entry_path(key, cache).write_bytes(b"junk")
    out = subprocess.run([sys.executable, "-m", "exl3tool", "cache", "verify", "--cache-dir", str(cache), "--json"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and json.loads(out.stdout)["valid"] == 11
    assert out.stderr.strip().startswith("error: 1 invalid entry")
