"""Identities as a server elsewhere sees them: --server-path in every command, Hub-cache blob links, --encoder-source,
and the revision the server must be started with.

Every expected identity comes from the tests' independent re-implementation (``helpers``) run on a *server*
tree: a copy of the model made with mtimes (and links) kept at another absolute path.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from helpers import TINY, TINY_REPO as REPO
from helpers import CliRunner, completed, server_encoder_identity, server_model_identity, transformers_commit_hash

from exl3tool.cache import resolve_encoder_identity, server_identities
from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.cli import _register, app
from exl3tool.errors import ConfigError


_register()
runner = CliRunner()
SNAP = "c0ffee" + "0" * 34  # a 40-hex snapshots/ folder name


def _cli(args, env=None):
    env = dict(os.environ if env is None else env)
    env.pop("VLLM_EXL3_ENCODER_SOURCE", None)
    env.pop("VLLM_EXL3_ENCODER_REVISION", None)
    return completed(args, env)


def _json(r):
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """A plain copy inside ``.../snapshots/<hash>/`` (CI side) and the server's copy at another path, mtimes kept."""
    base = tmp_path_factory.mktemp("ids")
    plain = write_llama_checkpoint(base / "plain", **TINY, seed=3, shards=2)
    local = base / "ci" / "hub" / "snapshots" / SNAP
    shutil.copytree(plain, local)  # copy2: mtimes kept to the nanosecond
    server = base / "srv" / "models" / "tiny"
    shutil.copytree(local, server)
    enc_local = base / "ci" / "venv" / "exllamav3"
    (enc_local / "modules" / "quant" / "exl3_lib").mkdir(parents=True)
    (enc_local / "__init__.py").write_text("# encoder\n")
    (enc_local / "modules" / "quant" / "exl3_lib" / "quantize.py").write_text("def quantize_exl3(): pass\n")
    enc_server = base / "srv" / "opt" / "exllamav3"
    shutil.copytree(enc_local, enc_server)
    return dict(base=base, local=local, server=server, enc_local=enc_local, enc_server=enc_server)


@pytest.mark.slow  # > 5 s on 2 shared cores (--durations, issue 44): the full suite only
def test_server_path_gives_one_identity_in_identity_encode_warm_and_verify(trees):
    """o_proj of layer 0 at TP 1 (one 256 x 256 entry): encode publishes it, warm finds it, verify passes it."""
    cache = trees["base"] / "cache-agree"
    ids = ["--server-path", str(trees["server"]), "--encoder-root", str(trees["enc_server"]),
           "--encoder-source", str(trees["enc_local"])]
    layer = ["--layers", "model.layers.0.self_attn.o_proj", "--cache-dir", str(cache), "--device", "cpu"]
    want_model = server_model_identity(str(trees["server"]), commit_hash=transformers_commit_hash(str(trees["server"])))
    want_encoder = server_encoder_identity(str(trees["enc_server"]))

    ident = _json(_cli(["identity", str(trees["local"]), *ids, "--json"]))
    assert ident["model"]["identity"] == want_model
    assert ident["model"]["revision"] is None and ident["model"]["revision_from"] == "none"
    assert ident["encoder"]["identity"] == want_encoder
    assert ident["encoder"]["root"] == str(trees["enc_server"])
    assert ident["encoder"]["files_from"] == str(trees["enc_local"])

    encoded = _json(_cli(["encode", str(trees["local"]), *ids, *layer, "--json", "--quiet"]))
    warmed = _json(_cli(["cache", "warm", str(trees["local"]), *ids, *layer, "--json", "--quiet"]))
    checked = _json(_cli(["verify", str(trees["local"]), *ids, *layer[:-2], "--rows", "1", "--json", "--quiet"]))
    assert encoded["model_identity"] == warmed["model_identity"] == checked["model_identity"] == want_model
    assert encoded["encoder_identity"] == warmed["encoder_identity"] == want_encoder
    assert encoded["counts"]["encoded"] == 1 and warmed["counts"] == {"hit": 1, "encoded": 0, "skipped": 0, "failed": 0}
    assert checked["ok"] and [c["status"] for c in checked["layers"]] == ["pass"]


def test_without_server_path_the_local_snapshot_hash_is_the_revision(trees):
    s = server_identities(str(trees["local"]), encoder_root="/e", encoder_revision="r")
    assert s.model.revision == SNAP and s.server_revision is None and "snapshots/<hash>" in s.revision_note
    assert s.model.identity == server_model_identity(str(trees["local"]), commit_hash=SNAP)
    # A Hub commit handed in by a download never applies to a local folder.
    assert server_identities(str(trees["local"]), server_path=str(trees["server"]), encoder_root="/e",
                             encoder_revision="r", hub_commit="f" * 40).model.revision is None


@pytest.fixture(scope="module")
def hub_trees(tmp_path_factory):
    """A Hub cache on the CI side (snapshot links into ../../blobs/) and the same tree copied, links kept, elsewhere."""
    base = tmp_path_factory.mktemp("hubids")
    snap = write_llama_checkpoint(base / "plain", **TINY, seed=4, shards=2, hub_cache=base / "ci-hub", repo_id=REPO)
    shutil.copytree(base / "ci-hub", base / "mnt" / "hub", symlinks=True)  # what a mount of the cache shows
    server_snap = base / "mnt" / "hub" / snap.relative_to(base / "ci-hub")
    return dict(base=base, snap=snap, server_snap=server_snap)


def test_hub_snapshot_links_map_beside_the_servers_snapshots_folder(hub_trees):
    snap, server_snap = hub_trees["snap"], hub_trees["server_snap"]
    assert os.readlink(snap / "model-00001-of-00002.safetensors").startswith("../../blobs/")
    s = server_identities(str(snap), server_path=str(server_snap), encoder_root="/e", encoder_revision="r")
    assert s.model.identity == server_model_identity(str(server_snap), commit_hash=snap.name)
    shards = json.loads(s.model.payload)["shards"]
    assert all(path.startswith(str(server_snap.parent.parent / "blobs") + "/") for _, path, _, _ in shards)
    assert "mapped" in s.model.derivation and not s.warnings
    # The CLI commands agree (dry runs: the plan carries the identity).
    args = [str(snap), "--server-path", str(server_snap), "--encoder-root", "/e", "--encoder-revision", "r"]
    planned = _json(_cli(["cache", "warm", *args, "--dry-run", "--json", "--cache-dir", str(hub_trees["base"] / "c")]))
    assert planned["model_identity"] == s.model.identity


def test_hub_snapshot_under_a_plain_server_path_is_refused_with_the_fix(hub_trees):
    snap = hub_trees["snap"]
    with pytest.raises(ConfigError) as err:
        server_identities(str(snap), server_path="/models/tiny", encoder_root="/e", encoder_revision="r")
    msg = str(err.value)
    assert "/models/tiny" in msg and "cp -rL --preserve=timestamps" in msg and "<mount>/snapshots/" + snap.name in msg
    r = _cli(["identity", str(snap), "--server-path", "/models/tiny", "--encoder-root", "/e", "--encoder-revision", "r"])
    assert r.returncode == 2 and "cp -rL" in r.stderr and "Traceback" not in r.stderr


def test_absolute_blob_links_are_refused(tmp_path):
    repo = tmp_path / "hub" / "models--o--n"
    snap = repo / "snapshots" / SNAP
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "abc").write_bytes(b"x" * 10)
    (snap / "config.json").write_text("{}")
    os.symlink(repo / "blobs" / "abc", snap / "model.safetensors")  # absolute: does not move with a mount
    with pytest.raises(ConfigError, match="absolute link"):
        server_identities(str(snap), server_path=f"/mnt/models--o--n/snapshots/{SNAP}", encoder_root="/e",
                          encoder_revision="r")


def test_links_outside_a_plain_folder_keep_their_path_with_a_warning(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "w.safetensors").write_bytes(b"w")
    os.symlink(tmp_path / "store" / "w.safetensors", d / "model.safetensors")
    s = server_identities(str(d), server_path="/models/m", encoder_root="/e", encoder_revision="r")
    assert json.loads(s.model.payload)["shards"][0][1] == str(tmp_path / "store" / "w.safetensors")
    assert any("must see the shard at exactly" in w for w in s.warnings)


def test_encoder_source_hashes_the_copy_and_keys_the_server_root(trees):
    want = server_encoder_identity(str(trees["enc_server"]))
    eid = resolve_encoder_identity(str(trees["enc_server"]), source=str(trees["enc_local"]))
    assert eid.identity == want and eid.root == str(trees["enc_server"]) and eid.files_from == str(trees["enc_local"])
    # The server's root need not exist here: only its string enters the payload.
    far = resolve_encoder_identity("/opt/exllamav3", source=str(trees["enc_local"]))
    assert json.loads(far.payload)["root"] == "/opt/exllamav3"
    assert json.loads(far.payload)["files"] == json.loads(eid.payload)["files"]
    with pytest.raises(ConfigError, match="--encoder-source .* does not exist"):
        resolve_encoder_identity("/opt/exllamav3", source=str(trees["base"] / "nope"))
    # With a revision nothing is hashed; the source is named as unused.
    s = server_identities(str(trees["local"]), encoder_root="/opt/exllamav3", encoder_revision="v1",
                          encoder_source=str(trees["enc_local"]))
    assert s.encoder.mode == "revision" and any("--encoder-source is not used for the identity" in w for w in s.warnings)
    # A folder that is not the package (no modules/quant/exl3_lib/quantize.py) is warned about.
    s = server_identities(str(trees["local"]), encoder_root="/opt/exllamav3", encoder_source=str(trees["base"] / "ci"))
    assert any("package folder" in w for w in s.warnings)


def test_identity_cli_shows_root_and_copy(trees):
    r = runner.invoke(app, ["identity", str(trees["local"]), "--encoder-root", "/opt/exllamav3",
                            "--encoder-source", str(trees["enc_local"])])
    assert r.exit_code == 0, r.output
    assert "/opt/exllamav3" in r.stdout and "encoder files hashed from: " + str(trees["enc_local"]) in r.stdout


@pytest.fixture
def offline_hub(hub_trees, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_trees["base"] / "ci-hub"))
    return hub_trees


def test_revision_the_server_must_start_with(offline_hub, tmp_path):
    sha = offline_hub["snap"].name
    for given in ("main", None):
        s = server_identities(REPO, revision=given, encoder_root="/e", encoder_revision="r")
        assert s.server_revision == sha and f"--revision {sha}" in s.revision_note
        assert len(s.warnings) == 1 and sha in s.warnings[0] and "moved" in s.warnings[0]
    s = server_identities(REPO, revision=sha, encoder_root="/e", encoder_revision="r")
    assert s.server_revision == sha and s.warnings == ()
    r = runner.invoke(app, ["identity", REPO, "--revision", "main", "--encoder-root", "/e", "--encoder-revision", "r",
                            "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["model"]["server_revision"] == sha and "branch, tag" in doc["warnings"][0]
    # A local folder: the string is hashed as given, or nothing.
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    s = server_identities(str(d), revision="v2", encoder_root="/e", encoder_revision="r")
    assert s.server_revision == "v2" and "exactly" in s.revision_note and s.warnings == ()
    s = server_identities(str(d), encoder_root="/e", encoder_revision="r")
    assert s.server_revision is None and "without --revision" in s.revision_note


def _three_commands(model: str, extra: list[str], cache) -> set[str]:
    """The model identity of `identity`, `encode --dry-run` and `cache warm --dry-run` (in process)."""
    found = set()
    for cmd in (["identity"], ["encode", "--dry-run"], ["cache", "warm", "--dry-run"]):
        args = [*cmd, model, *extra, "--encoder-root", "/e", "--encoder-revision", "r", "--json"]
        if cmd[0] != "identity":
            args += ["--cache-dir", str(cache), "--layers", "model.layers.0.self_attn.o_proj"]
        r = runner.invoke(app, args)
        assert r.exit_code == 0, (args, r.output, r.exception)
        doc = json.loads(r.stdout)
        found.add(doc["model"]["identity"] if cmd[0] == "identity" else doc["model_identity"])
    return found


@pytest.mark.parametrize("case", ["copy-in-snapshot", "copy-in-snapshot-with-revision", "hub-mapped", "hub-in-place",
                                  "plain-with-revision"])
def test_identity_encode_and_warm_agree_on_every_server_path_case(case, trees, hub_trees, tmp_path):
    if case.startswith("copy-in-snapshot"):
        model, server = str(trees["local"]), str(trees["server"])
        extra = ["--server-path", server] + (["--revision", "v7"] if case.endswith("revision") else [])
        want = server_model_identity(server, revision="v7" if case.endswith("revision") else None)
    elif case == "hub-mapped":
        model, server = str(hub_trees["snap"]), str(hub_trees["server_snap"])
        extra, want = ["--server-path", server], server_model_identity(server, commit_hash=hub_trees["snap"].name)
    elif case == "hub-in-place":
        model = str(hub_trees["snap"])
        extra, want = [], server_model_identity(model, commit_hash=hub_trees["snap"].name)
    else:
        model = str(trees["server"])
        extra, want = ["--revision", "v7"], server_model_identity(model, revision="v7")
    assert _three_commands(model, extra, tmp_path / "c") == {want}
