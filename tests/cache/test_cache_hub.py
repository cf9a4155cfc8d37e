"""Hub revisions resolved from a local Hub-cache layout built here (offline), and the fail-closed cases."""

from __future__ import annotations

import json

import pytest

from exl3tool.cache import resolve_hub_revision, resolve_model_identity
from exl3tool.errors import ConfigError

SHA_MAIN = "1111111111aaaaaaaaaa2222222222bbbbbbbbbb"
SHA_TAG = "3333333333cccccccccc4444444444dddddddddd"
SHA_TWIN = "3333333333ffffffffff4444444444dddddddddd"


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hf" / "hub"
    repo = cache / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA_MAIN)
    (repo / "refs" / "v1.0").write_text(SHA_TAG + "\n")
    for sha in (SHA_MAIN, SHA_TAG, SHA_TWIN):
        (repo / "snapshots" / sha).mkdir(parents=True)
        (repo / "snapshots" / sha / "config.json").write_text("{}")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return cache


@pytest.mark.parametrize(
    "revision,sha",
    [(None, SHA_MAIN), ("main", SHA_MAIN), ("v1.0", SHA_TAG), (SHA_TAG, SHA_TAG), ("1111111", SHA_MAIN), ("3333333333c", SHA_TAG)],
)
def test_offline_resolution(hub, revision, sha):
    assert resolve_hub_revision("org/name", revision).sha == sha
    mid = resolve_model_identity("org/name", revision=revision)
    assert mid.kind == "hub" and mid.revision == sha
    assert mid.payload == json.dumps({"kind": "hub", "model": "org/name", "revision": sha}, sort_keys=True)


def test_hub_cache_env_takes_precedence(hub, monkeypatch):
    monkeypatch.setenv("HF_HOME", "/nonexistent")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert resolve_hub_revision("org/name", "v1.0").sha == SHA_TAG


@pytest.mark.parametrize(
    "repo,revision,match",
    [("org/name", "nope", "not a ref or snapshot"), ("org/name", "3333333333", "ambiguous"), ("org/other", "main", "not in the local Hub cache")],
)
def test_fail_closed(hub, repo, revision, match):
    with pytest.raises(ConfigError, match=match):
        resolve_hub_revision(repo, revision)
    with pytest.raises(ConfigError):
        resolve_model_identity(repo, revision=revision)


def test_commit_hash_takes_precedence(hub):
    mid = resolve_model_identity("org/name", revision="main", commit_hash="commit-a")
    assert mid.revision == "commit-a"
    assert mid.identity == resolve_model_identity("org/name", commit_hash="commit-a").identity


def test_online_then_fallback(hub, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")

    class Info:
        sha = SHA_TAG

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo, revision=None: Info())
    assert resolve_hub_revision("org/name", "main").sha == SHA_TAG

    def down(self, repo, revision=None):
        raise ConnectionError("network unreachable")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", down)
    found = resolve_hub_revision("org/name", "main")
    assert found.sha == SHA_MAIN and "network unreachable" in found.how
    with pytest.raises(ConfigError, match="online look-up failed too"):
        resolve_hub_revision("org/name", "nope")
