"""Fleets (issue 42, goal 4): `cache check --nodes` compares the identities each node computes before a rollout.

The false claim: a local folder's identity holds its shards' mtimes, so per-node `hf download --local-dir` gives
every node another identity and a bundle warmed on one node misses on all the others, with nothing saying so before
the rollout. Here the "nodes" are the same folder before and after a re-download (same bytes, new mtimes); the
independent server of tests/helpers.py decides hit and miss.
"""

from __future__ import annotations

import json
import os
import shlex

import pytest

from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.plan import ServerRequest, prepare

from helpers import (
    ENC, ENC_ARGS, LINEAR, TINY_1, fake_warm, run, server_encoder_identity, server_lookup, server_model_identity,
)


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("VLLM_EXL3_ONLINE_TRELLIS_BITS", "VLLM_EXL3_ONLINE_CACHE_DIR", "HF_HUB_OFFLINE", "HF_HUB_CACHE",
                 "TRANSFORMERS_OFFLINE", "VLLM_EXL3_ENCODER_SOURCE", "VLLM_EXL3_ENCODER_REVISION"):
        monkeypatch.delenv(name, raising=False)


def _identity_doc(capsys, path, *args) -> dict:
    code, out, err = run(["identity", *args, *ENC_ARGS, "--json"], capsys)
    assert code == 0, err
    (path).write_text(out)
    return json.loads(out)


def test_per_node_downloads_are_named_before_the_rollout(tmp_path, monkeypatch, capsys):
    model = write_llama_checkpoint(tmp_path / "models" / "M", **TINY_1, shards=2)
    cache = tmp_path / "cache"
    request = ServerRequest(model=str(model), cache_dir=str(cache), quantization_config=LINEAR, **ENC)
    fake_warm(request, monkeypatch)  # warmed on node a
    a = _identity_doc(capsys, tmp_path / "a.json", str(model))
    assert a["model"]["identity"] == server_model_identity(str(model))
    _, plan, _ = prepare(request)
    jobs = [j for j in plan.jobs if j.state != "skipped"]
    eid = server_encoder_identity(ENC["encoder_root"], ENC["encoder_revision"])

    def hits() -> int:
        mid = server_model_identity(str(model))
        return sum(bool(server_lookup(cache, mid, eid, j.prefix, 6, 1, j.tp_rank, j.input_size, j.output_size))
                   for j in jobs)

    assert hits() == len(jobs)
    # node b downloaded the same files itself: same bytes, same path, its own mtimes
    shard = sorted(model.glob("*.safetensors"))[1]
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 7_000_000_000))
    b = _identity_doc(capsys, tmp_path / "b.json", str(model))
    assert b["model"]["identity"] == server_model_identity(str(model)) != a["model"]["identity"]
    assert hits() == 0  # the bundle warmed on a misses everywhere on b
    code, out, err = run(["cache", "check", "--nodes", f"a={tmp_path / 'a.json'}", "--nodes",
                          f"b={tmp_path / 'b.json'}"], capsys)
    assert code == 1
    assert f"b: {shard.name} mtime" in out and "on a" in out and "pinned --revision" in out
    assert "1 node of 2" in err
    code, out, _ = run(["cache", "check", "--json", "--nodes", f"a={tmp_path / 'a.json'}", "--nodes",
                        f"b={tmp_path / 'b.json'}"], capsys)
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["differences"][0]["node"] == "b"
    assert doc["differences"][0]["field"] == "model_identity" and "mtime" in doc["differences"][0]["text"]


def test_a_warm_record_is_a_node_document_too(tmp_path, monkeypatch, capsys):
    model = write_llama_checkpoint(tmp_path / "M", **TINY_1, shards=1)
    cache = tmp_path / "cache"
    fake_warm(ServerRequest(model=str(model), cache_dir=str(cache), quantization_config=LINEAR, **ENC), monkeypatch)
    record = next((cache / "exl3tool-records").rglob("*.json"))
    _identity_doc(capsys, tmp_path / "here.json", str(model))
    code, out, err = run(["cache", "check", "--nodes", f"warm={record}", "--nodes", str(tmp_path / "here.json")],
                         capsys)
    assert code == 0, err + out
    assert "2 nodes: the same model and encoder identity as warm" in out


def test_the_hub_id_with_a_pinned_revision_is_the_same_on_every_node(tmp_path, monkeypatch, capsys):
    """The recommendation of docs/deploy.md: two nodes with their own Hub caches (own mtimes) agree. Their servers run
    online (the identity is the repo and the commit); exl3tool reads the commit from each node's cache offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    docs = []
    for node in ("a", "b"):
        snapshot = write_llama_checkpoint(tmp_path / node / "files", **TINY_1, shards=1, hub_cache=tmp_path / node / "hub")
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / node / "hub"))
        commit = snapshot.name
        docs.append(_identity_doc(capsys, tmp_path / f"{node}.json", "test-org/tiny-llama", "--revision", commit))
    assert docs[0]["model"]["identity"] == docs[1]["model"]["identity"]
    code, out, err = run(["cache", "check", "--nodes", f"a={tmp_path / 'a.json'}", "--nodes",
                          f"b={tmp_path / 'b.json'}"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("content, why", [("not json", "not JSON"), ('{"model": 1}', "no model identity")])
def test_a_bad_node_document_is_a_usage_error(tmp_path, capsys, content, why):
    (tmp_path / "x.json").write_text(content)
    (tmp_path / "y.json").write_text(content)
    code, _, err = run(["cache", "check", "--nodes", str(tmp_path / "x.json"), "--nodes", str(tmp_path / "y.json")],
                       capsys)
    assert code == 2 and why in err and "x.json" in err


def test_an_object_storage_model_is_refused_naming_the_folder_vllm_serves(tiny_llama, tmp_path, capsys):
    """vLLM pulls an s3:// model's config files into $VLLM_ASSETS_CACHE/model_streamer/<sha256(url)[:8]> and serves
    that folder (no shard in it): the fork's identity is that folder's, which exl3tool does not reproduce."""
    import hashlib

    url = "s3://bucket/models/GLM-5.2"
    launch = (f"env HOME=/home/vllm VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ENCODER_SOURCE=/e "
              f"VLLM_EXL3_ENCODER_REVISION=r VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}/c vllm serve {url} "
              f"--load-format runai_streamer --quantization-config {shlex.quote(LINEAR)}")
    code, _, err = run(["cache", "check", "--launch", launch], capsys)
    folder = f"/home/vllm/.cache/vllm/assets/model_streamer/{hashlib.sha256(url.encode()).hexdigest()[:8]}"
    assert code == 2 and folder in err and "runai_streamer" in err and url in err
