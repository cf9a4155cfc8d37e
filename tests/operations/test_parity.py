"""Encoder parity: before exl3tool writes entries under an encoder identity that is not its own, a probe layer is
encoded by that encoder (loaded and called as the fork's server does) and by exl3tool's, and the bytes compared.

The server's view of each entry is ``tests/helpers.py``'s independent look-up (no exl3tool code): the entries a
warm writes under the image's encoder identity are hits for that server, which is why the claim must be checked.
Encodes of the warms themselves are helpers' fake encoder (the probe is what is under test, not the layers).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from exl3tool.cache.identity import resolve_encoder_identity
from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.operations import parity as parity_mod
from exl3tool.operations.parity import encoder_parity, listing_digest, own_encoder
from helpers import TINY, fake_encode, run, server_encoder_identity, server_lookup, server_model_identity, tree
from seeds import fresh_seed

FORK_ROOT = "/opt/exllamav3-python/exllamav3"  # the published images' encoder and revision (docs/images.md)
FORK_REV = "704aefd743b390af4bd0fb429d1906f9b964c7d8"
LAYER = "model.layers.0.self_attn.o_proj"
K, N = TINY["hidden"] // 2, TINY["hidden"]  # o_proj at TP 2 (row parallel): half the input, the whole output
SERVER_VARS = ("VLLM_EXL3_ENCODER_SOURCE", "VLLM_EXL3_ENCODER_REVISION", "VLLM_EXL3_ONLINE_TRELLIS_BITS",
               "VLLM_EXL3_ONLINE_CACHE_DIR", "VLLM_CACHE_ROOT")

FAKE_QUANTIZE = textwrap.dedent('''
    """A deliberately different encoder: right shapes and dtypes, other bytes (test data)."""
    import torch


    def quantize_exl3(weight, H_data, quant_args, return_weight_q=False, verbose=False):
        k, n = weight.shape
        bits = quant_args["K"]
        g = torch.Generator().manual_seed(quant_args["seed"] + 1)
        trellis = torch.randint(-32768, 32767, (k // 16, n // 16, 16 * bits), generator=g, dtype=torch.int32)
        quant_args["q_fallback"] = True
        return None, 0.5, {"trellis": trellis.to(torch.int16), "suh": torch.ones(k, dtype=torch.float16),
                           "svh": torch.ones(n, dtype=torch.float16), "mcg": torch.tensor(1)}
''')


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in SERVER_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture()
def cli(capsys):
    """``exl3tool ARGS`` in this process: (exit code, stdout, stderr)."""
    return lambda *args: run([str(a) for a in args], capsys)


@pytest.fixture()
def model(tmp_path) -> Path:
    return write_llama_checkpoint(tmp_path / "model", **TINY, seed=fresh_seed(16), shards=1)


@pytest.fixture()
def fake_layers(monkeypatch):
    """The warm's layer encodes are helpers' fake encoder (fast); the parity probe runs for real."""
    import exl3tool.operations.warm.run as run

    real = run.run_plan

    def run_plan(*args, **kwargs):
        kwargs["encode"] = lambda weight, bits, seed, device, progress=None: fake_encode(weight, bits, seed, device)
        return real(*args, **kwargs)

    monkeypatch.setattr(run, "run_plan", run_plan)


def _fake_encoder(base: Path) -> Path:
    lib = base / "modules" / "quant" / "exl3_lib"
    lib.mkdir(parents=True)
    (lib / "quantize.py").write_text(FAKE_QUANTIZE)
    return base


def _warm(cli, model: Path, cache: Path, *extra: str) -> tuple[int, str, str]:
    return cli("cache", "warm", str(model), "--tp-size", "2", "--layers", LAYER, "--cache-dir", str(cache),
               "--device", "cpu", "--encoder-root", FORK_ROOT, *extra)


def _served(model: Path, cache: Path, root: str, revision: str | None) -> list[bool]:
    """Whether the server (helpers' independent look-up) finds each rank's entry of LAYER."""
    mid, eid = server_model_identity(str(model)), server_encoder_identity(root, revision)
    return [server_lookup(cache, mid, eid, LAYER, 6, 2, r, K, N) is not None for r in (0, 1)]


def _records(cache: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((cache / "exl3tool-records").rglob("*.json"))]


def test_an_unverified_encoder_identity_is_said_recorded_and_reported(tmp_path, cli, model, fake_layers):
    """The false claim: the launch keys entries with the image's revision of an exllamav3 *fork*, and nothing here
    can run that encoder. The warm says so in one line, records ``unverified``; cache check and verify report it.
    The entries are hits for that server all the same: the claim is what is at stake."""
    cache = tmp_path / "cache"
    code, out, err = _warm(cli, model, cache, "--encoder-revision", FORK_REV, "--json")
    assert code == 0, err
    said = [x for x in err.splitlines() if "encoder parity" in x]
    assert len(said) == 1 and "unverified" in said[0] and "--encoder-source" in said[0], err
    assert json.loads(out)["encoder_parity"]["status"] == "unverified"
    (record,) = _records(cache)
    assert record["encoder_parity"]["status"] == "unverified" and record["encoder_parity"]["basis"] == "none"
    assert all(_served(model, cache, FORK_ROOT, FORK_REV))
    check = ["cache", "check", str(model), "--tp-size", "2", "--layers", LAYER, "--cache-dir", str(cache),
             "--encoder-root", FORK_ROOT, "--encoder-revision", FORK_REV]
    code, out, err = cli(*check, "--json")
    assert code == 0, err  # every look-up hits; the parity is a note, not a miss
    notes = [n for n in json.loads(out)["notes"] if n["field"] == "encoder_parity"]
    assert len(notes) == 1 and "encoder parity unverified" in notes[0]["text"]
    code, _, err = cli(*check)
    assert "encoder parity unverified" in err
    code, out, err = cli("verify", str(model), "--tp-size", "2", "--layers", LAYER, "--cache-dir", str(cache),
                         "--encoder-root", FORK_ROOT, "--encoder-revision", FORK_REV, "--device", "cpu", "--json")
    assert [p["status"] for p in json.loads(out)["encoder_parity"]] == ["unverified"]
    assert "encoder parity unverified" in err
    # a bundle carries the verdict to the server host, where cache check reports it the same
    bundle, there = tmp_path / "b.tar", tmp_path / "there"
    assert cli("cache", "export", str(bundle), "--cache-dir", str(cache))[0] == 0
    assert cli("cache", "import", str(bundle), "--cache-dir", str(there))[0] == 0
    code, out, err = cli(*[str(there) if a == str(cache) else a for a in check], "--json")
    assert code == 0 and [n["field"] for n in json.loads(out)["notes"]].count("encoder_parity") == 1, err


def test_exl3tools_own_encoder_is_identical_by_construction(tmp_path, cli, model, fake_layers, monkeypatch):
    """An `exl3tool encoder-source` export as the server's encoder (files mode): identical by construction, decided
    from the identity's payload; no probe runs (a subprocess would fail this test)."""
    export = tmp_path / "enc"
    assert cli("encoder-source", str(export))[0] == 0

    def no_probe(*a, **k):
        raise AssertionError("a probe ran")

    monkeypatch.setattr(parity_mod.subprocess, "run", no_probe)
    cache = tmp_path / "cache"
    code, out, err = cli("cache", "warm", str(model), "--tp-size", "2", "--layers", LAYER, "--cache-dir", str(cache),
                         "--device", "cpu", "--encoder-root", "/opt/exl3tool-encoder", "--encoder-source", str(export),
                         "--json")
    assert code == 0, err
    p = json.loads(out)["encoder_parity"]
    assert (p["status"], p["basis"]) == ("identical", "construction") and "encoder-source` export" in p["detail"]
    assert _records(cache)[0]["encoder_parity"]["status"] == "identical"
    # the exllamav3 release exl3tool is bit-exact with: its file listing, wherever the package sits
    pkg = tmp_path / "pkg"
    (pkg / "modules").mkdir(parents=True)
    (pkg / "modules" / "a.py").write_text("A = 1\n")
    eid = resolve_encoder_identity("/srv/exllamav3", source=str(pkg))
    assert own_encoder(eid) == ""
    monkeypatch.setitem(parity_mod.OWN_LISTINGS, listing_digest(json.loads(eid.payload)["files"]), "exllamav3 X")
    assert "byte for byte exllamav3 X" in own_encoder(eid)
    assert own_encoder(resolve_encoder_identity("/srv/exllamav3", FORK_REV)) == ""  # a revision proves nothing


@pytest.mark.slow
def test_a_different_encoder_is_refused_and_trust_writes_it(tmp_path, cli, model, fake_layers):
    """A local copy of the server's encoder (--encoder-source) that writes other bytes: refused (exit 2) before
    anything is written, with the way forward; --trust-encoder-identity writes and records ``differs``."""
    fake = _fake_encoder(tmp_path / "fork-encoder")
    cache = tmp_path / "cache"
    code, _, err = _warm(cli, model, cache, "--encoder-revision", FORK_REV, "--encoder-source", str(fake))
    errors = [x for x in err.splitlines() if x.startswith("error")]
    assert code == 2 and len(errors) == 1, err
    assert "encoder parity differs" in errors[0] and "trellis, suh, svh differ" in errors[0]
    assert "exl3tool encoder-source" in errors[0] and "--trust-encoder-identity" in errors[0]
    assert tree(cache) == {} and not any(_served(model, cache, FORK_ROOT, FORK_REV))
    code, out, err = _warm(cli, model, cache, "--encoder-revision", FORK_REV, "--encoder-source", str(fake),
                           "--trust-encoder-identity", "--json")
    assert code == 0, err
    assert json.loads(out)["encoder_parity"]["status"] == "differs"
    assert [x for x in err.splitlines() if "encoder parity differs" in x]
    (record,) = _records(cache)
    assert record["encoder_parity"]["status"] == "differs" and record["encoder_parity"]["basis"] == "probe"
    probe = record["encoder_parity"]["probe"]
    assert probe["theirs"]["tensors"]["trellis"]["sha256"] != probe["ours"]["tensors"]["trellis"]["sha256"]
    assert all(_served(model, cache, FORK_ROOT, FORK_REV))
    # a server on this host: its encoder root is here, so that copy is the one probed (no --encoder-source)
    code, _, err = cli("cache", "warm", str(model), "--tp-size", "2", "--layers", LAYER, "--cache-dir",
                       str(tmp_path / "c2"), "--device", "cpu", "--encoder-root", str(fake),
                       "--encoder-revision", FORK_REV)
    assert code == 2 and "encoder parity differs" in err and f"as found here ({fake})" in err, err


@pytest.mark.slow
def test_an_export_under_the_images_revision_is_identical_by_probe(tmp_path, cli, model, fake_layers):
    """The server keeps the image's revision string but its encoder source is an `exl3tool encoder-source` export:
    the probe (the export loaded as the fork loads it, in a fresh Python) gives exl3tool's bytes."""
    export = tmp_path / "enc"
    assert cli("encoder-source", str(export))[0] == 0
    cache = tmp_path / "cache"
    code, out, err = _warm(cli, model, cache, "--encoder-revision", FORK_REV, "--encoder-source", str(export),
                           "--json")
    assert code == 0, err
    p = json.loads(out)["encoder_parity"]
    assert (p["status"], p["basis"]) == ("identical", "probe"), p
    assert p["probe"]["theirs"]["tensors"] == p["probe"]["ours"]["tensors"]
    assert all(_served(model, cache, FORK_ROOT, FORK_REV))


def _fake_docker_runner(tmp_path: Path, encoder: Path) -> Path:
    """A ``docker`` whose ``run`` executes the command as the image would, with the image's encoder root mapped to
    ``encoder`` here; every call's arguments go to calls.log."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "docker"
    script.write_text(
        f"#!{sys.executable}\nimport os, subprocess, sys\n"
        f"open({str(tmp_path / 'calls.log')!r}, 'a').write(repr(sys.argv[1:]) + '\\n')\n"
        "a = sys.argv[1:]\n"
        "if a[0] != 'run':\n    sys.exit('unexpected: ' + ' '.join(a))\n"
        "i = a.index('--entrypoint')\n"
        "image, cmd = a[i + 2], a[i + 3:]\n"
        f"cmd[-1] = {str(encoder)!r}  # the image's copy at its root\n"
        f"sys.exit(subprocess.run([{sys.executable!r}, *cmd]).returncode)\n")
    script.chmod(0o755)
    return bindir


@pytest.mark.slow
def test_the_images_encoder_runs_in_the_image(tmp_path, monkeypatch):
    """Only the image has the encoder: ``docker run --rm --pull=never`` runs the probe there (a fake runtime here
    runs it as the image would); without docker or podman it is not attempted."""
    eid = resolve_encoder_identity(FORK_ROOT, FORK_REV)
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    p = encoder_parity(eid, bits=6, image="example.org/lab/vllm:r34", runner="docker")
    assert p.status == "unverified" and "neither docker nor podman" in p.detail
    bindir = _fake_docker_runner(tmp_path, _fake_encoder(tmp_path / "image-encoder"))
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    p = encoder_parity(eid, bits=6, image="example.org/lab/vllm:r34", runner="docker")
    assert (p.status, p.basis) == ("differs", "probe"), p.detail
    assert "in the image example.org/lab/vllm:r34" in p.probe["encoder"] or "example.org/lab/vllm:r34" in p.detail
    call = (tmp_path / "calls.log").read_text()
    assert "'--rm'" in call and "'--pull=never'" in call and "'--network=none'" in call
    assert f"'{FORK_ROOT}'" in call  # the encoder's path inside the image


# ---- on a GPU (the lead's run): exllamav3 1.6.5 itself as the other encoder ------------------------------------------
# EXL3TOOL_REFERENCE_SOURCE=/tmp/site/exllamav3 PYTHONPATH=$PWD:/tmp/site python3 -m pytest -q -m gpu \
#     tests/operations/test_parity.py      (the wheel installed as benchmarks/gpu_callers.sh does)

def _cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


@pytest.mark.gpu
def test_exllamav3_1_6_5_is_identical_by_construction_and_by_probe_on_the_gpu():
    """The release exl3tool is bit-exact with: its unpacked package's listing is OWN_LISTINGS' (construction), and
    under a revision string (no construction) the probe on the GPU gives the same bytes as exl3tool's encoder."""
    _cuda()
    src = os.environ.get("EXL3TOOL_REFERENCE_SOURCE")
    if not src:
        pytest.skip("EXL3TOOL_REFERENCE_SOURCE is not set (the exllamav3 1.6.5 package directory)")
    files = resolve_encoder_identity("/opt/exllamav3", source=src)
    assert own_encoder(files).startswith("the hashed files are byte for byte exllamav3 1.6.5")
    p = encoder_parity(resolve_encoder_identity("/opt/exllamav3", "v1.6.5"), bits=6, device="cuda:0",
                       encoder_source=src)
    assert (p.status, p.basis) == ("identical", "probe"), p.detail
    assert p.probe["theirs"]["device"].startswith("cuda") and p.probe["theirs"] == p.probe["ours"]


@pytest.mark.gpu
def test_a_different_encoder_differs_on_the_gpu(tmp_path):
    _cuda()
    eid = resolve_encoder_identity(FORK_ROOT, FORK_REV)
    p = encoder_parity(eid, bits=4, device="cuda:0", encoder_source=str(_fake_encoder(tmp_path / "fork")))
    assert (p.status, p.basis) == ("differs", "probe") and p.probe["ours"]["device"].startswith("cuda")
