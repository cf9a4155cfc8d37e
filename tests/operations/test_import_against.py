"""Forged bundle entries: the key binding (exl3tool_key_sha256) and `cache import --against MODEL [--exact]`.

A forged entry here is another entry's tensors (rank 1 of the same layer: same shapes, other weights) under the
target's key (rank 0). Copied with its checksums and only its cache_key edited, the key binding refuses it; written
with freshly computed checksums (a deliberate forger), only a check against the checkpoint can.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from helpers import CliRunner
from safetensors.torch import save_file

from exl3tool.cache import CacheKey, CacheStore
from exl3tool.cache.bundle import BundleEntry, ExportPlan, write_bundle_file
from exl3tool.cache.entry import read_entry, validate_entry, write_entry
from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.cli import _register, app
from exl3tool.errors import Exl3ToolError
from exl3tool.plan import ServerRequest, prepare
from exl3tool.operations.warm import warm

from helpers import ENC, ENC_ARGS, TINY, make_encoded, viterbi_memo
from seeds import fresh_seed

# every test here shares a module fixture that encodes on the CPU (30-100 s on 2 shared cores, --durations):
# the full suite only (issue 44)
pytestmark = pytest.mark.slow

_register()
LAYER = "model.layers.1.self_attn.o_proj"


@pytest.fixture(scope="module", autouse=True)
def _memo():
    """import --against --exact's fresh encodes repeat the warm's encode of the same weights: their Viterbi reuses
    its states where the tiles are the same bits (helpers.viterbi_memo); where they differ the kernel runs."""
    with viterbi_memo() as counts:
        yield counts


def cli(*args):
    """(exit code, stdout, stderr) as `exl3tool` would exit."""
    res = CliRunner().invoke(app, list(args))
    code = res.exception.exit_code if isinstance(res.exception, Exl3ToolError) else res.exit_code
    if res.exception is not None and not isinstance(res.exception, (Exl3ToolError, SystemExit)):
        raise res.exception
    return code, res.stdout, res.stderr + (str(res.exception) if res.exception else "")


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """A model and a cache holding LAYER at TP 2 (ranks 0 and 1), with the two jobs (rank order)."""
    base = tmp_path_factory.mktemp("against")
    model = write_llama_checkpoint(base / "model", **TINY, seed=fresh_seed(24), shards=1)
    cache = base / "cache"
    assert warm(ServerRequest(model=str(model), tp_sizes=(2,), layers=(LAYER,), cache_dir=str(cache), device="cpu",
                            **ENC)).counts["encoded"] == 2
    _, plan, _ = prepare(ServerRequest(model=str(model), tp_sizes=(2,), layers=(LAYER,), cache_dir=str(cache),
                                     mode="readonly", **ENC))
    return model, cache, sorted(plan.jobs, key=lambda j: j.tp_rank)


def _bundle(tmp_path, files: dict[CacheKey, bytes]):
    """A well-formed bundle (manifest sizes and hashes right) holding ``files`` at their keys' paths."""
    stage = tmp_path / "stage"
    entries = []
    for key, data in files.items():
        rel = f"v1/{key.model_identity[:20]}/tp{key.tp_world_size}-rank{key.tp_rank}/{key.digest()}.safetensors"
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage / rel).write_bytes(data)
        entries.append(BundleEntry(rel, key.digest(), key.canonical_json(), len(data), hashlib.sha256(data).hexdigest()))
    out = tmp_path / "bundle.tar"
    write_bundle_file(ExportPlan(stage, tuple(sorted(entries, key=lambda e: e.path)), ()), out)
    return out


def _rekeyed_copy(path, key: CacheKey, tmp_path) -> bytes:
    """``path``'s file with only its cache_key metadata changed to ``key`` (its checksums kept)."""
    contents = read_entry(path)
    out = tmp_path / "rekeyed.safetensors"
    save_file(contents.tensors, str(out), metadata={**contents.metadata, "cache_key": key.canonical_json()})
    return out.read_bytes()


def _recomputed(path, key: CacheKey, tmp_path) -> bytes:
    """``path``'s tensors published under ``key`` by our own writer: every checksum right for the forgery."""
    contents = read_entry(path)
    out = write_entry(tmp_path / "forged" / "e.safetensors", key, contents.tensors, float(contents.metadata["proxy_error"]))
    return out.read_bytes()


def test_another_entrys_file_under_the_target_key_is_refused(warmed, tmp_path):
    model, cache, (rank0, rank1) = warmed
    bundle = _bundle(tmp_path, {rank0.key: _rekeyed_copy(rank1.path, rank0.key, tmp_path)})
    code, out, err = cli("cache", "import", str(bundle), "--cache-dir", str(tmp_path / "dst"), "--json")
    assert code == 1, err
    doc = json.loads(out)
    assert doc["refused"] == 1 and doc["imported"] == 0
    assert "exl3tool_key_sha256 does not match" in doc["entries"][0]["reason"]
    assert not (tmp_path / "dst").joinpath(doc["entries"][0]["path"]).exists()


def test_entries_without_the_key_binding_are_still_read(warmed, tmp_path):
    """Entries written before the binding carry exl3tool_sha256 alone (and no metadata checksum): accepted, their
    tensors still checked."""
    model, cache, (rank0, _) = warmed
    dst = tmp_path / "cache"
    shutil.copytree(cache, dst)
    path = dst / rank0.path.relative_to(cache)
    contents = read_entry(path)
    old = {k: v for k, v in contents.metadata.items()
           if k not in ("exl3tool_key_sha256", "exl3tool_platform", "exl3tool_meta_sha256")}
    save_file(contents.tensors, str(path), metadata=old)
    found = CacheStore(dst, "readonly").lookup(rank0.key)
    assert found.hit and found.checked
    t = dict(contents.tensors)
    t["trellis"] = t["trellis"].clone()
    t["trellis"].view(-1)[5] ^= 1
    save_file(t, str(path), metadata=old)
    with pytest.raises(ValueError, match="differ from exl3tool_sha256"):
        validate_entry(path, rank0.key)


def test_against_refuses_what_is_not_the_models_and_imports_the_rest(warmed, tmp_path):
    model, cache, (rank0, rank1) = warmed
    foreign = CacheKey.for_layer("c9" * 32, rank0.key.encoder_identity, LAYER, 6, 2, 0, 128, 256)
    foreign_file = tmp_path / "foreign.safetensors"
    write_entry(foreign_file, foreign, make_encoded(128, 256).tensors(), 0.1)
    files = {rank0.key: _recomputed(rank1.path, rank0.key, tmp_path), rank1.key: rank1.path.read_bytes(),
             foreign: foreign_file.read_bytes()}
    bundle = _bundle(tmp_path, files)

    code, out, err = cli("cache", "import", str(bundle), "--cache-dir", str(tmp_path / "plain"), "--json")
    assert code == 0 and json.loads(out)["imported"] == 3, err  # a plain import proves none of this wrong

    base = ["cache", "import", str(bundle), "--against", str(model), *ENC_ARGS, "--json"]
    for mode, extra in (("bound", []), ("exact", ["--exact", "--device", "cpu"])):
        code, out, err = cli(*base, *extra, "--cache-dir", str(tmp_path / mode))
        assert code == 1, err
        doc = json.loads(out)
        status = {e["path"].split("/")[-1].removesuffix(".safetensors"): (e["status"], e["reason"]) for e in doc["entries"]}
        assert status[rank1.digest][0] == "imported", status
        assert status[rank0.digest][0] == "refused" and "not MODEL's weights" in status[rank0.digest][1], status
        assert status[foreign.digest()] == ("refused", status[foreign.digest()][1])
        assert "not in MODEL's plan: another model identity" in status[foreign.digest()][1]
        assert doc["against"] == {"model": str(model), "exact": mode == "exact"}
        if mode == "exact":
            assert "exactly (differs)" in status[rank0.digest][1]
        else:
            assert "the verify bound is 0.0266" in status[rank0.digest][1]
        assert not (tmp_path / mode).joinpath(rank0.path.relative_to(cache)).exists()


def test_model_options_without_against_are_a_usage_error(tmp_path):
    code, _, err = cli("cache", "import", str(tmp_path / "b.tar"), "--exact", "--cache-dir", str(tmp_path))
    assert code == 2 and "--exact" in err and "--against" in err
    code, _, err = cli("cache", "import", str(tmp_path / "b.tar"), "--layers", "x", "--cache-dir", str(tmp_path))
    assert code == 2 and "--layers" in err
