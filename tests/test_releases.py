"""The fork's server releases as data (exl3tool.releases) and the per-release findings of issue 42.

Each false claim of the issue is a test that fails on the code before it: a 4304-wide shard (the server does not
start: fork issue #311), an r7 routed-expert checkpoint (the server serves it whatever its quant_method), a ``~`` in
VLLM_EXL3_ENCODER_SOURCE (the server's import does not expand it), and the variables newer launches set (known,
no key changes). Hit or miss is decided by the independent server of ``tests/helpers.py``.
"""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.errors import ConfigError
from exl3tool.plan import ServerRequest, prepare
from exl3tool.releases import (
    CACHE_MODULES, NEWEST, RELEASES, lock_waits, newest, release, release_from_labels, resolve_release, rule_splits,
    variable_note,
)

from helpers import (
    ENC, ENC_ARGS, LINEAR, TINY_1, fake_warm, run, server_cache_module, server_encoder_identity, server_lookup,
    server_model_identity,
)

CLEAN = ("VLLM_EXL3_ONLINE_TRELLIS_BITS", "VLLM_EXL3_ONLINE_CACHE_DIR", "VLLM_CACHE_ROOT", "XDG_CACHE_HOME",
         "VLLM_EXL3_ENCODER_SOURCE", "VLLM_EXL3_ENCODER_REVISION", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in CLEAN:
        monkeypatch.delenv(name, raising=False)


# --- the table ----------------------------------------------------------------------------------------------------

def test_the_table_names_every_release_and_its_cache_module():
    choice = resolve_release()
    assert NEWEST == "infernal-invocation-r18" == newest().name == choice.name
    assert choice.source == "default" and not choice.assumed  # said as the default, not an assumption
    # nor as the server's release: the settings line and --server-release's help say it is compared (they said "the
    # newest (said as such)", as if r18 were the server's)
    from exl3tool.cli.commands.options import ROWS

    said = " ".join((choice.describe(), ROWS["server_release"].type.__metadata__[0].help))
    assert "newest" not in said and "not named" in choice.describe() and "(exit 2) until it is named" in said
    for r in RELEASES:
        assert r.cache is None or r.cache in CACHE_MODULES
        line, _, n = r.name.rpartition("-r")
        if r.online_cache:  # the independent reading of which module each release ships
            assert r.cache == server_cache_module(r.name), r.name
        elif r.line in ("kimi-k3", "jovian-judgement"):  # lines whose compositions add neither module
            assert r.line == r.name[:len(r.line)] and not r.retry_nonfinite and not r.r7_checkpoints
        else:
            assert (line == "gilded-gnosis" and int(n) < 20) or (line == "infernal-invocation" and int(n) < 5)
    assert len({r.tree for r in RELEASES if not r.online_cache and r.line in ("kimi-k3", "jovian-judgement")}) == 13
    older, newer = CACHE_MODULES["older"], CACHE_MODULES["newer"]
    assert (older.xdg_cache_home, older.lock_timeout_s, older.nonfinite_checks) == (False, None, False)
    assert (newer.xdg_cache_home, newer.lock_timeout_s, newer.nonfinite_checks) == (True, 600.0, True)
    assert release("gilded-gnosis-r34").retry_nonfinite and not release("gilded-gnosis-r33").retry_nonfinite


@pytest.mark.parametrize("spelled, name", [
    ("gilded-gnosis-r33", "gilded-gnosis-r33"), ("gilded-gnosis-v20-r33", "gilded-gnosis-r33"),
    ("GG r34", "gilded-gnosis-r34"), ("ii-r5", "infernal-invocation-r5"),
    ("Infernal_Invocation_R18", "infernal-invocation-r18"),
])
def test_release_names_as_operators_write_them(spelled, name):
    assert release(spelled).name == name


def test_an_unknown_release_is_a_usage_error_listing_the_known(tiny_llama, tmp_path, capsys):
    with pytest.raises(ConfigError, match="gilded-gnosis-r5..r34"):
        release("gilded-gnosis-r99")
    with pytest.raises(ConfigError, match=r"\+pr999 is not a patch exl3tool knows \(\+pr312"):
        release("gg-r34+pr999")
    with pytest.raises(ConfigError, match="encodes nothing online, so \\+pr312 changes nothing"):
        release("gg-r15+pr312")
    with pytest.raises(ConfigError, match="'' is not a release"):
        resolve_release("")  # given and empty: not the default
    hostile = resolve_release(None, {"local-inference.release.name": "gg-r34\n\x1b[31mall hit " + "x" * 200})
    assert hostile.assumed and "\n" not in hostile.unknown[0] and "\x1b" not in hostile.unknown[0]
    assert len(hostile.unknown[0]) < 300
    for argv in (["cache", "check", str(tiny_llama), "--cache-dir", str(tmp_path), *ENC_ARGS], ["cache", "ls"],
                 ["cache", "import", "b.tar"], ["verify", str(tiny_llama), *ENC_ARGS]):
        code, _, err = run([*argv, "--server-release", "gg-r99"], capsys)
        assert code == 2 and "gg-r99" in err and "infernal-invocation-r2..r18" in err, (argv, err)


def test_an_image_label_names_the_release():
    """The fork's images carry local-inference.vllm.integration.tree: the integration tree of their release."""
    r33 = release("gilded-gnosis-r33")
    assert release_from_labels({"local-inference.vllm.integration.tree": r33.tree}).cache == "older"
    assert release_from_labels({"local-inference.release.name": "infernal-invocation-r12"}).name == \
        "infernal-invocation-r12"
    assert release_from_labels({"local-inference.release.name": "infernal-invocation-cu133-torch213"}) is None
    choice = resolve_release(None, {"local-inference.vllm.integration.tree": r33.tree})
    assert choice.release.cache == "older" and choice.source == "image label" and not choice.assumed
    assert resolve_release("ii-r7", {"local-inference.vllm.integration.tree": r33.tree}).name == \
        "infernal-invocation-r7"  # --server-release wins


# --- a shard the server cannot build: K_r not a multiple of 32 (fork issue #311) ------------------------------------

@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A one-layer tiny Llama with the intermediate width of Qwen3.8's vision MLP (4304): down_proj has K=4304."""
    return write_llama_checkpoint(tmp_path_factory.mktemp("wide") / "M", **{**TINY_1, "intermediate": 4304},
                                  shards=1)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_4304_wide_shard_means_the_server_does_not_start(wide, tmp_path, monkeypatch, capsys, tp):
    """Before: every planned look-up hit, so `cache check` said all hit (exit 0) for a server that fails at start-up
    (the MXFP8 fallback refuses K_r % 32 != 0). The hits are the independent server's."""
    cache = tmp_path / "cache"
    request = ServerRequest(model=str(wide), tp_sizes=(tp,), cache_dir=str(cache), quantization_config=LINEAR, **ENC)
    fake_warm(request, monkeypatch)
    _, plan, _ = prepare(request)
    mid = server_model_identity(str(wide))
    eid = server_encoder_identity(ENC["encoder_root"], ENC["encoder_revision"])
    looked = [j for j in plan.jobs if j.state != "skipped"]
    assert looked and all(server_lookup(cache, mid, eid, j.prefix, 6, tp, j.tp_rank, j.input_size, j.output_size)
                          for j in looked)  # every look-up the server makes hits
    k_r = 4304 // tp
    assert k_r % 128 and k_r % 32  # 128-unaligned (not encoded online) and not a multiple of 32 (MXFP8 refuses it)
    code, out, err = run(["cache", "check", str(wide), "--tp-size", str(tp), "--cache-dir", str(cache),
                          "--quantization-config", LINEAR, *ENC_ARGS], capsys)
    assert code == 1, err
    assert "this server will not start" in err and "(fork issue #311)" in err and "down_proj" in err
    assert f"K_r={k_r}" in err
    code, _, err = run(["cache", "check", str(wide), "--tp-size", str(tp), "--cache-dir", str(cache),
                        "--quantization-config", LINEAR, "--layers", "*.o_proj", *ENC_ARGS], capsys)
    assert code == 1 and "(fork issue #311)" in err  # --layers selects look-ups; the server still builds down_proj
    code, out, _ = run(["cache", "check", str(wide), "--tp-size", str(tp), "--cache-dir", str(cache),
                        "--quantization-config", LINEAR, "--json", *ENC_ARGS], capsys)
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["miss"] == 0 and doc["start_failures"][0]["field"] == "start"


# --- a patched image: r34's labels, PR #312's exl3.py (the gg-r34-patched images) -----------------------------------

# exl3.py as far as exl3tool reads it (our own minimal texts): the online method and its fallback for a shard that
# is neither 128-aligned nor a multiple of 32 wide
EXL3_PY = {"pr312": "class Exl3OnlineLinearMethod:\n    def create_weights(self):\n"
                    "        self.fallback = UnquantizedLinearMethod()\n",
           "issue311": "class Exl3OnlineLinearMethod:\n    def create_weights(self):\n"
                       "        self.fallback = Mxfp8OnlineLinearMethod()\n"}
RETRY_R7 = "def _load_online_encoding_with_retry(): pass\nR7 = 'r7-complete-v2-checkpoint-v1'\n"


def _image_root(root, exl3: str, cache_module: bytes = b"# the cache module\n"):
    """An unpacked image: the fork's vllm under /opt/venv, reached through an absolute link inside the image (as
    images link their venvs), beside a link that points out of the image (never followed to this machine's /etc)."""
    real = root / "usr/local/venv/lib/python3.12/site-packages/vllm"
    quant = real / "model_executor/layers/quantization"
    quant.mkdir(parents=True)
    (real / "__init__.py").write_text("")
    (quant / "__init__.py").write_text("")
    (quant / "exl3.py").write_text(exl3 + RETRY_R7)
    (quant / "exl3_online_cache.py").write_bytes(cache_module)
    (root / "opt").mkdir()
    (root / "opt/venv").symlink_to("/usr/local/venv")
    (root / "usr/local/lib/python3.12/dist-packages").mkdir(parents=True)
    (root / "usr/local/lib/python3.12/dist-packages/vllm").symlink_to("/etc")
    return root


def _save_image(root, out, name, labels, *, top: str, oci: bool = False, env=None, whiteout: bool = True):
    """``docker save`` of image ``name`` whose files are ``root`` (an ``_image_root``), in two layers as a build
    leaves them: the first holds ``root`` with another exl3.py and a second vllm package under /opt/conda, the
    second replaces exl3.py with ``top`` and removes that package with a whiteout. ``oci``: the OCI archive (an
    index and gzip layers, as `podman save --format oci-archive` writes) instead of docker's manifest.json."""
    import gzip
    import hashlib
    import io
    import tarfile

    exl3 = "usr/local/venv/lib/python3.12/site-packages/vllm/model_executor/layers/quantization/exl3.py"
    conda = "opt/conda/lib/python3.12/site-packages/vllm"

    def tar_of(files: dict, links: dict = {}, base=None) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
            if base is not None:
                t.add(str(base), arcname=".", recursive=True)
            for path, data in files.items():
                info = tarfile.TarInfo(path)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
            for path, target in links.items():
                info = tarfile.TarInfo(path)
                info.type, info.linkname = tarfile.SYMTYPE, target
                t.addfile(info)
        return buf.getvalue()

    below = (root / exl3).read_bytes()
    (root / exl3).write_text("class Exl3OnlineLinearMethod:\n    pass  # the base image's, replaced above\n")
    first = tar_of({f"{conda}/__init__.py": b"", f"{conda}/model_executor/layers/quantization/__init__.py": b"",
                    f"{conda}/model_executor/layers/quantization/exl3.py": b"# another vllm\n"}, base=root)
    (root / exl3).write_bytes(below)
    second = tar_of({exl3: top.encode(), **({f"{conda.rsplit('/', 1)[0]}/.wh.vllm": b""} if whiteout else {})})
    config = json.dumps({"architecture": "amd64", "config": {"Env": [f"{k}={v}" for k, v in (env or {}).items()],
                                                             "Labels": labels, "Entrypoint": ["vllm"]}}).encode()
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        blobs[f"blobs/sha256/{digest}"] = data
        return {"digest": f"sha256:{digest}", "size": len(data)}

    if oci:
        manifest = {"schemaVersion": 2, "config": blob(config),
                    "layers": [blob(gzip.compress(layer)) for layer in (first, second)]}
        index = {"schemaVersion": 2, "manifests": [{**blob(json.dumps(manifest).encode()),
                                                    "annotations": {"org.opencontainers.image.ref.name": name}}]}
        outer = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}', "index.json": json.dumps(index).encode(),
                 **blobs}
    else:
        outer = {"c0ffee.json": config, "l1/layer.tar": first, "l2/layer.tar": second, "manifest.json": json.dumps(
            [{"Config": "c0ffee.json", "RepoTags": [name], "Layers": ["l1/layer.tar", "l2/layer.tar"]}]).encode()}
    out.write_bytes(tar_of(outer))
    return str(out)


def test_a_patched_image_is_never_said_not_to_start(wide, tmp_path, monkeypatch, capsys):
    """gg-r34-patched images carry r34's labels and PR #312's exl3.py (a shard neither Trellis nor MXFP8 can hold
    stays BF16: the server starts). Before: "this server will not start" (#311's rule, from the labels). Now: from
    the labels alone exl3tool cannot tell (exit 2, naming it); from the image's files, or named, it answers."""
    from dataclasses import replace as dc_replace

    from exl3tool.releases import git_blob

    cache = tmp_path / "cache"
    fake_warm(ServerRequest(model=str(wide), cache_dir=str(cache), quantization_config=LINEAR, **ENC), monkeypatch)
    r34 = release("gilded-gnosis-r34")
    image = _inspect(tmp_path, "localhost/vllm:gg-r34-patched", {"local-inference.vllm.integration.tree": r34.tree})
    base = ["cache", "check", "--launch", _launch(wide, cache), "--image", "localhost/vllm:gg-r34-patched"]
    code, out, err = run([*base, "--image-inspect", image, "--json"], capsys)
    assert code == 2, err
    assert "will not start" not in err and "cannot tell whether this server starts" in err and "K_r=4304" in err
    assert "gg-r34-patched" in err and "--server-release" in err and json.loads(out)["start_failures"] == []
    code, _, err = run([*base, "--image-inspect", image, "--server-release", "gg-r34+pr312"], capsys)
    assert code == 0, err  # named as patched: every look-up hits and the server starts
    # the image's files: its exl3.py decides; a cache module exl3tool knows (the newer one's blob, here ours)
    module = b"# our stand-in for the newer cache module\n"
    monkeypatch.setitem(CACHE_MODULES, "newer", dc_replace(CACHE_MODULES["newer"], blob=git_blob(module)))
    labels = {"local-inference.vllm.integration.tree": r34.tree}
    for (rule, want), oci in zip((("pr312", 0), ("issue311", 1)), (False, True)):
        root = _image_root(tmp_path / rule, EXL3_PY[rule], module)
        saved = _save_image(root, tmp_path / f"{rule}.tar", "localhost/vllm:gg-r34-patched", labels,
                            top=EXL3_PY[rule] + RETRY_R7, oci=oci)
        for files in (["--image-inspect", image, "--image-root", str(root)], ["--image-archive", saved]):
            code, out, err = run([*base, *files, "--json"], capsys)  # the saved image: its labels and its files
            doc = json.loads(out)
            assert code == want, err
            assert doc["settings"]["server_release"]["source"] == "image files"
            assert doc["release"]["rules"]["unaligned_shard"].startswith("mxfp8, or BF16" if want == 0 else "mxfp8 (")
            assert ("will not start" in err) == (want == 1) and "/etc" not in doc["release"]["detail"]
        assert doc["launch"]["image"]["source"] == "image archive" and doc["launch"]["image"]["labels"] == labels
    code, _, err = run([*base[:4], "--image-root", str(tmp_path / "nothing")], capsys)
    assert code == 2 and "--image-root" in err and "not a folder" in err


def test_the_fork_modules_are_read_by_git_blob_and_through_the_images_links(tmp_path):
    """git's own blob ids (git hash-object) name the files; a file reached through a link out of the image is never
    read from this machine."""
    import shutil
    import subprocess

    from exl3tool.launch.forkfiles import read_fork_modules

    root = _image_root(tmp_path / "img", EXL3_PY["pr312"])
    mods = read_fork_modules(str(root))
    quant = root / "usr/local/venv/lib/python3.12/site-packages/vllm/model_executor/layers/quantization"
    assert mods.where.endswith("/opt/venv/lib/python3.12/site-packages/vllm")
    if shutil.which("git"):
        for name, blob in (("exl3.py", mods.exl3_blob), ("exl3_online_cache.py", mods.cache_blob)):
            want = subprocess.run(["git", "hash-object", str(quant / name)], capture_output=True, text=True,
                                  check=True).stdout.strip()
            assert blob == want
    assert read_fork_modules(str(quant.parent.parent.parent)).exl3_blob == mods.exl3_blob  # the package itself
    odd = resolve_release(None, {"local-inference.vllm.integration.tree": release("gg-r34").tree}, modules=mods)
    assert odd.assumed and "exl3_online_cache.py is blob" in odd.unknown[0] and "no version" in odd.unknown[0]
    assert odd.release.unaligned == "bf16" and odd.source == "image files"  # what the files do tell is kept
    upstream = tmp_path / "upstream/vllm"
    (upstream / "model_executor/layers/quantization").mkdir(parents=True)
    (upstream / "__init__.py").write_text("")
    (upstream / "model_executor/layers/quantization/__init__.py").write_text("")
    plain = resolve_release(None, {}, modules=read_fork_modules(str(upstream.parent)))
    assert not plain.release.online_cache and "no EXL3 support" in plain.release.patched  # vLLM without exl3.py
    # a saved image of the same files gives the same modules: its later layer's exl3.py, its whiteout honoured
    from exl3tool.launch.forkfiles import read_image_archive

    top = EXL3_PY["pr312"] + RETRY_R7
    saved = read_image_archive(_save_image(root, tmp_path / "img.tar", "x:1", {}, top=top))
    assert (saved.modules.cache_blob, saved.modules.exl3_blob, saved.modules.exl3_text) == (
        mods.cache_blob, mods.exl3_blob, mods.exl3_text)
    assert saved.modules.where == f"{tmp_path / 'img.tar'}:/opt/venv/lib/python3.12/site-packages/vllm"
    assert saved.names == ("x:1",) and saved.config["Entrypoint"] == ["vllm"] and saved.layers == 2
    with pytest.raises(ConfigError, match="holds 2 vllm packages"):  # without the whiteout, /opt/conda's is there
        read_image_archive(_save_image(root, tmp_path / "nowh.tar", "x:1", {}, top=top, whiteout=False))
    (root / "usr/local/venv").rename(root / "usr/local/elsewhere")  # /opt/venv now points at nothing in the image
    with pytest.raises(ConfigError, match="no vllm package there"):
        read_fork_modules(str(root))


def test_a_hostile_image_archive_writes_nothing_outside_and_is_named(tmp_path, capsys):
    """Links out of the image, names climbing above its root, a layer the manifest names but the archive lacks, a
    file that is no archive: read in the image's own terms, or one line naming the file."""
    import io
    import tarfile

    from exl3tool.launch.forkfiles import read_image_archive

    outside = tmp_path / "outside"

    def tar(members) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            for name, data, link in members:
                info = tarfile.TarInfo(name)
                if link is not None:
                    info.type, info.linkname = tarfile.SYMTYPE, link
                    t.addfile(info)
                else:
                    info.size = len(data)
                    t.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    quant = "model_executor/layers/quantization"
    one = tar([("opt/venv", None, str(outside)), ("../../escape.py", b"x", None)])
    two = tar([(f"opt/venv/lib/python3.12/site-packages/vllm/{quant}/exl3.py", EXL3_PY["pr312"].encode(), None),
               ("opt/venv/lib/python3.12/site-packages/vllm/__init__.py", b"", None)])
    manifest = json.dumps([{"Config": "c.json", "RepoTags": ["evil:1"], "Layers": ["1.tar", "2.tar"]}]).encode()
    archive = tmp_path / "evil.tar"
    archive.write_bytes(tar([("manifest.json", manifest, None), ("c.json", b'{"config": {}}', None),
                             ("1.tar", one, None), ("2.tar", two, None)]))
    saved = read_image_archive(str(archive))
    assert saved.modules.exl3_blob and saved.modules.where.endswith(":/opt/venv/lib/python3.12/site-packages/vllm")
    assert not outside.exists() and not (tmp_path.parent / "escape.py").exists()
    archive.write_bytes(tar([("manifest.json", manifest, None), ("c.json", b"{}", None), ("1.tar", one, None)]))
    with pytest.raises(ConfigError, match="names layer 2.tar, which the archive lacks"):
        read_image_archive(str(archive))
    (tmp_path / "i.json").write_text("[]")
    for path, why in ((tmp_path / "i.json", "not a tar archive|cannot read it as a tar"), (tmp_path / "none.tar",
                                                                                          "cannot read it")):
        code, _, err = run(["cache", "check", str(tmp_path), "--image-archive", str(path)], capsys)
        assert code == 2 and "--image-archive" in err and len(err.strip().splitlines()) == 1, err


def test_a_128_unaligned_shard_that_is_32_aligned_starts(tmp_path, monkeypatch, capsys):
    """4320 = 33.75 x 128 = 135 x 32: the server builds it with MXFP8 and starts (the rule is not 'unaligned')."""
    model = write_llama_checkpoint(tmp_path / "M", **{**TINY_1, "intermediate": 4320}, shards=1)
    request = ServerRequest(model=str(model), cache_dir=str(tmp_path / "c"), quantization_config=LINEAR, **ENC)
    fake_warm(request, monkeypatch)
    code, _, err = run(["cache", "check", str(model), "--cache-dir", str(tmp_path / "c"), "--quantization-config",
                        LINEAR, *ENC_ARGS], capsys)
    assert code == 0, err
    assert "will not start" not in err


# --- r7 routed-expert checkpoints ----------------------------------------------------------------------------------

R7 = {"schema": "r7-complete-v2-checkpoint-v1", "codebook": "mcg", "bits": "mixed_tensor", "moe_layers": [3, 77],
      "k_values": [3, 4, 5]}


def _r7_checkpoint(path, **r7):
    model = write_llama_checkpoint(path, layers=1, shards=1)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "config_groups": {},
                                     "r7_routed_experts": {**R7, **r7}}
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_an_r7_checkpoint_is_served_whatever_its_quant_method(tmp_path, monkeypatch):
    """Before: refused as 'not an EXL3 checkpoint' (quant_method modelopt); the server takes r7_routed_experts
    checkpoints as EXL3 from gilded-gnosis-r34 and infernal-invocation-r5 on, and warmed entries hit there."""
    model = _r7_checkpoint(tmp_path / "M")
    cache = tmp_path / "cache"
    request = ServerRequest(model=str(model), tp_sizes=(2,), cache_dir=str(cache), quantization_config=LINEAR, **ENC)
    with pytest.raises(ConfigError, match="release is not named.*r7_routed_experts.*--server-release NAME"):
        fake_warm(request, monkeypatch)  # no release named: gilded-gnosis-r33 would refuse what r34 serves
    assert not cache.exists()  # refused before anything was written
    request = dataclasses.replace(request, server_release="infernal-invocation-r18")
    fake_warm(request, monkeypatch)
    _, plan, _ = prepare(request)
    assert any("r7" in n for n in plan.layer_plan.notes)
    mid, eid = server_model_identity(str(model)), server_encoder_identity(ENC["encoder_root"], ENC["encoder_revision"])
    looked = [j for j in plan.jobs if j.state != "skipped"]
    assert len(looked) == 8  # qkv, o, gate_up, down at 2 ranks
    assert all(server_lookup(cache, mid, eid, j.prefix, 6, 2, j.tp_rank, j.input_size, j.output_size) for j in looked)
    with pytest.raises(ConfigError, match="does not read r7_routed_experts"):
        prepare(ServerRequest(model=str(model), cache_dir=str(cache), quantization_config=LINEAR,
                            server_release="gilded-gnosis-r33", **ENC))
    from exl3tool.operations.hydrate import plan_hydrate

    with pytest.raises(ConfigError, match="what this hydrate writes depends on it: the checkpoint's r7_routed"):
        plan_hydrate(ServerRequest(model=str(model), quantization_config=LINEAR), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad, why", [({"k_values": [3, 6]}, "unsupported k_values: \\[6\\]"),
                                      ({"bits": 3}, "mixed_tensor"), ({"moe_layers": [5, 2]}, "last >= first")])
def test_an_r7_block_the_server_refuses_is_refused_with_its_reason(tmp_path, bad, why):
    model = _r7_checkpoint(tmp_path / "M", **bad)
    with pytest.raises(ConfigError, match=why):
        prepare(ServerRequest(model=str(model), cache_dir=str(tmp_path / "c"), quantization_config=LINEAR, **ENC))


# --- a ~ in VLLM_EXL3_ENCODER_SOURCE ------------------------------------------------------------------------------

def test_a_tilde_encoder_root_with_a_miss_means_the_server_does_not_start(tiny_llama, tmp_path, monkeypatch, capsys):
    """The identity expands ~ (so entries keyed with it hit), the server's import of the encoder does not: all hits
    start, a miss fails the start. Before: reported as N misses the server would encode."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cache = tmp_path / "cache"
    args = ["cache", "check", str(tiny_llama), "--cache-dir", str(cache), "--quantization-config", LINEAR,
            "--encoder-root", "~/exllamav3", "--encoder-revision", "r"]
    code, _, err = run(args, capsys)
    assert code == 1 and "this server will not start" in err and "~/exllamav3" in err and "absolute" in err
    request = ServerRequest(model=str(tiny_llama), cache_dir=str(cache), quantization_config=LINEAR,
                          encoder_root="~/exllamav3", encoder_revision="r")
    fake_warm(request, monkeypatch)
    _, plan, _ = prepare(request)
    eid = server_encoder_identity(str(tmp_path / "home" / "exllamav3"), "r")  # the server expands ~ for its identity
    mid = server_model_identity(str(tiny_llama))
    assert all(server_lookup(cache, mid, eid, j.prefix, 6, 1, j.tp_rank, j.input_size, j.output_size)
               for j in plan.jobs if j.state != "skipped")
    code, _, err = run(args, capsys)
    assert code == 0 and "will not start" not in err  # every look-up hits: the encoder is never imported
    code, out, _ = run(["identity", str(tiny_llama), "--encoder-root", "~/exllamav3", "--encoder-revision", "r",
                        "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["encoder"]["identity"] == eid  # reported, and the identity is the server's
    assert any("starts with ~" in w and "import does not" in w for w in doc["warnings"])


# --- variables of newer launches ----------------------------------------------------------------------------------

NEWER_VARS = {"VLLM_EXL3_MULTIPRECISION": "1", "VLLM_EXL3_EMBED_ONLINE_BITS": "6", "VLLM_EXL3_FP4_LAYERS": ",",
              "VLLM_EXL3_FP6_LAYERS": "mlp.gate_up_proj", "VLLM_EXL3_GRAPH_DECODE": "1",
              "VLLM_EXL3_PREFILL_CAPACITY": "8192", "VLLM_EXL3_FP8DG_PREFILL_M": "0"}


def test_newer_variables_are_known_and_change_no_key(tiny_llama, tmp_path, capsys):
    base = (f"VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ENCODER_SOURCE=/e VLLM_EXL3_ENCODER_REVISION=r "
            f"VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}/c")
    serve = f"vllm serve {tiny_llama} --quantization-config {shlex.quote(LINEAR)}"
    extra = " ".join(f"{k}={shlex.quote(v)}" for k, v in NEWER_VARS.items())
    code, plain, err = run(["cache", "warm", "--dry-run", "--json", "--launch", f"env {base} {serve}"], capsys)
    assert code == 0, err
    code, newer, err = run(["cache", "warm", "--dry-run", "--json", "--launch", f"env {base} {extra} "
                            "VLLM_EXL3_NOT_A_REAL_KNOB=1 " + serve], capsys)
    assert code == 0, err
    digests = [sorted(j["digest"] for j in json.loads(doc)["jobs"]) for doc in (plain, newer)]
    assert digests[0] == digests[1] and digests[0]  # no key changes
    for name in NEWER_VARS:
        assert f"{name}={NEWER_VARS[name]}: known" in err and "changes no cache key" in err
    assert "VLLM_EXL3_NOT_A_REAL_KNOB=1: not a variable exl3tool knows" in err
    assert variable_note("VLLM_EXL3_ONLINE_TRELLIS_BITS", "6") is None  # a key variable is a setting, not a note


def _inspect(tmp_path, name, labels, env=None):
    """A saved `docker image inspect` document of image ``name`` with ``labels`` (and ENV ``env``)."""
    doc = [{"RepoTags": [name], "Config": {"Env": [f"{k}={v}" for k, v in (env or {}).items()], "Labels": labels,
                                            "Entrypoint": None, "Cmd": None}}]
    path = tmp_path / f"inspect-{abs(hash(name))}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _launch(model, cache, extra=""):
    return (f"env VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ENCODER_SOURCE={ENC['encoder_root']} "
            f"VLLM_EXL3_ENCODER_REVISION={ENC['encoder_revision']} VLLM_EXL3_ONLINE_CACHE_DIR={cache} {extra}"
            f"vllm serve {model} --quantization-config {shlex.quote(LINEAR)}")


def test_a_release_without_the_online_cache_looks_nothing_up(tiny_llama, tmp_path, capsys):
    code, out, err = run(["cache", "check", "--json", "--server-release", "gilded-gnosis-r15", "--launch",
                          _launch(tiny_llama, tmp_path / "c")], capsys)
    doc = json.loads(out)
    assert code == 1 and doc["server_lookup"] is False and "encodes no layer to EXL3 online" in doc["lookup_off"][0]


@pytest.mark.parametrize("name", ["kimi-k3-production-lmcache-r5", "jovian-judgement-ds4-r5"])
def test_a_line_without_online_encoding_says_so_and_points_to_hydrate(tiny_llama, tmp_path, capsys, name):
    """Kimi-K3 and Jovian Judgement images (their labels) encode nothing online: `cache check` says 0 look-ups and
    points to `exl3tool hydrate` (exit 1, as every launch that looks nothing up); a warm for them is a usage error."""
    row = release(name)
    image = _inspect(tmp_path, "voipmonitor/vllm:x", {"local-inference.vllm.integration.tree": row.tree})
    args = ["--image", "voipmonitor/vllm:x", "--image-inspect", image, "--launch", _launch(tiny_llama, tmp_path / "c")]
    code, out, err = run(["cache", "check", "--json", *args], capsys)
    doc = json.loads(out)
    assert code == 1 and doc["server_lookup"] is False, err
    assert f"{row.name} encodes no layer to EXL3 online" in doc["lookup_off"][0]
    assert "exl3tool hydrate" in doc["lookup_off"][0] and doc["settings"]["server_release"]["source"] == "image label"
    code, _, err = run(["cache", "warm", "--dry-run", *args], capsys)
    assert code == 2 and "exl3tool hydrate" in err and row.name in err
    code, out, err = run(["cache", "check", str(tiny_llama), "--server-release", name, "--cache-dir", str(tmp_path),
                          "--json", *ENC_ARGS], capsys)  # without a launch: the same answer
    assert code == 1 and json.loads(out)["server_lookup"] is False and "exl3tool hydrate" in out
    code, out, err = run(["hydrate", str(tiny_llama), str(tmp_path / "out"), "--dry-run", "--json",
                          "--server-release", name, "--launch", _launch(tiny_llama, tmp_path / "c")], capsys)
    assert code == 0 and json.loads(out)["modules"], err  # what it points to plans for that server (before: refused)


UNKNOWN_LABELS = {
    "an unknown tree": ({"local-inference.vllm.integration.tree": "0123456789abcdef0123456789abcdef01234567"},
                        "local-inference.vllm.integration.tree=0123456789ab"),
    "an unknown release name": ({"local-inference.release.name": "kimi-k3-production-lmcache-r7"},
                                "local-inference.release.name=kimi-k3-production-lmcache-r7"),
    "a release of another line": ({"local-inference.release.name": "karmic-kraken-r3"},
                                  "local-inference.release.name=karmic-kraken-r3"),
}


@pytest.mark.parametrize("case", list(UNKNOWN_LABELS))
def test_an_unknown_release_label_is_named_and_never_answered_on(tiny_llama, tmp_path, monkeypatch, capsys, case):
    """Before: followed as infernal-invocation-r18 "because no image label names one" (one did) and answered "all
    hit", exit 0. Now the label and the assumption are named, and `cache check` exits 2 until --server-release
    names the release; with it, the hits (the independent server's) answer 0."""
    labels, said = UNKNOWN_LABELS[case]
    choice = resolve_release(None, labels)
    assert choice.assumed and choice.name == NEWEST and said in choice.unknown[0]
    assert choice.unknown[0].endswith(f"assumed {NEWEST}'s rules")
    if case != "an unknown release name":
        return  # the command line's answer is the same for every unknown label: run once
    cache = tmp_path / "c"
    fake_warm(ServerRequest(model=str(tiny_llama), cache_dir=str(cache), quantization_config=LINEAR, **ENC),
              monkeypatch)
    image = _inspect(tmp_path, "example.org/vllm:k3", labels)
    base = ["cache", "check", "--image", "example.org/vllm:k3", "--image-inspect", image, "--launch",
            _launch(tiny_llama, cache)]
    code, out, err = run([*base, "--json"], capsys)
    doc = json.loads(out)
    assert code == 2, err
    assert said in err and f"assumed {NEWEST}'s rules" in err and "--server-release NAME" in err
    assert doc["ok"] is False and doc["assumed"] is True and doc["hit"] == doc["lookups"] > 0
    code, _, err = run([*base, "--server-release", "ii-r18"], capsys)
    assert code == 0, err  # named: the same look-ups, now answered
    code, _, err = run(["cache", "check", str(tiny_llama), "--cache-dir", str(cache), "--quantization-config", LINEAR,
                        "--image", "example.org/vllm:k3", "--image-inspect", image, *ENC_ARGS], capsys)
    assert code == 2 and said in err  # without a launch too


def test_the_published_tables_release_name_is_read_or_named(tmp_path):
    """exl3tool's image table names an image's release in words (Fathomless Firmament v17 has no labels)."""
    assert resolve_release(None, {}, table_release="Gilded Gnosis v20 r33").name == "gilded-gnosis-r33"
    choice = resolve_release(None, {}, table_release="Fathomless Firmament v17")
    assert choice.assumed and "'Fathomless Firmament v17'" in choice.unknown[0]


def test_the_images_label_selects_the_release_of_a_launch(tiny_llama, tmp_path):
    """An image labelled with gilded-gnosis-r33's integration tree gets the older cache module's root: its server
    ignores XDG_CACHE_HOME. The labels are read from the image's saved inspect document."""
    from exl3tool.launch import LaunchInput, apply_launch

    from helpers import server_cache_root

    tree = release("gilded-gnosis-r33").tree
    image = _inspect(tmp_path, "voipmonitor/vllm:r33", {"local-inference.vllm.integration.tree": tree})
    env = {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    launch = (f"env HOME={env['HOME']} XDG_CACHE_HOME={env['XDG_CACHE_HOME']} VLLM_EXL3_ONLINE_TRELLIS_BITS=6 "
              f"VLLM_EXL3_ENCODER_SOURCE=/e VLLM_EXL3_ENCODER_REVISION=r vllm serve {tiny_llama} "
              f"--quantization-config {shlex.quote(LINEAR)}")
    li = LaunchInput(text=launch, image="voipmonitor/vllm:r33", image_inspect=image)
    request, settings, _ = apply_launch(ServerRequest(model=""), set(), li, environ={})
    assert request.release.name == settings.server_release == "gilded-gnosis-r33"
    assert settings.settings["server_release"].source == "image label"
    assert request.cache_dir == str(server_cache_root(env, "older"))
    request, settings, _ = apply_launch(ServerRequest(model="", server_release="ii-r18"), {"server_release"}, li,
                                        environ={})
    assert request.cache_dir == str(server_cache_root(env, "newer"))  # --server-release wins over the label


def test_a_release_without_the_online_cache_checked_without_a_launch(tiny_llama, tmp_path, capsys):
    code, out, err = run(["cache", "check", str(tiny_llama), "--server-release", "ii-r3", "--cache-dir",
                          str(tmp_path), "--json", *ENC_ARGS], capsys)
    assert code == 1 and json.loads(out)["server_lookup"] is False and "encodes no layer to EXL3 online" in out


def test_nothing_to_warm_for_a_release_without_the_online_cache(tiny_llama, tmp_path, capsys):
    code, _, err = run(["cache", "warm", str(tiny_llama), "--server-release", "gilded-gnosis-r19", "--dry-run",
                        "--cache-dir", str(tmp_path), *ENC_ARGS], capsys)
    assert code == 2 and "gilded-gnosis-r19 encodes no layer to EXL3 online" in err and "exl3tool hydrate" in err


# --- a release nothing determines: compared, never assumed (issue 49) ---------------------------------------------

def test_a_release_nothing_names_answers_only_where_every_release_agrees(tiny_llama, tmp_path, monkeypatch, capsys):
    """No --server-release, no image: the answer stands where every release that encodes online gives it (said in
    one note); where XDG_CACHE_HOME gives the root, Gilded Gnosis up to r33 look in ~/.cache/vllm and the newer ones
    under XDG_CACHE_HOME: check and warm name that and stop (exit 2, nothing written). Before: the newest's root,
    answered and written."""
    from exl3tool.plan.request import ServerRequest as Req

    from helpers import server_cache_root, tree

    code, _, err = run(["cache", "warm", str(tiny_llama), "--dry-run", "--cache-dir", str(tmp_path / "c"),
                        "--quantization-config", LINEAR, *ENC_ARGS], capsys)
    assert code == 0 and "release is not named, but every release exl3tool knows that encodes online" in err, err
    env = {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = [str(tiny_llama), "--quantization-config", LINEAR, *ENC_ARGS]
    older, newer = server_cache_root(env, "older"), server_cache_root(env, "newer")
    for command in (["cache", "check"], ["cache", "warm", "--dry-run"], ["cache", "warm", "--device", "cpu"]):
        code, _, err = run([*command, *args], capsys)
        assert code == 2 and "--server-release NAME" in err.splitlines()[-1], err
        assert f"the cache root is ~/.cache/vllm/exl3_online for gilded-gnosis-r20..r33, but {newer} for " \
               "gilded-gnosis-r34, infernal-invocation-r5..r18" in err.splitlines()[-1]
    assert not tree(tmp_path / "xdg") and not tree(tmp_path / "home")
    request = Req(model=str(tiny_llama), quantization_config=LINEAR, server_release="gilded-gnosis-r33", **ENC)
    fake_warm(request, monkeypatch)  # named: written where that release's server reads
    code, out, err = run(["cache", "check", *args, "--server-release", "gg-r33", "--json"], capsys)
    assert code == 0 and json.loads(out)["cache_root"] == str(older) and "not named" not in err, err


def test_an_unknown_label_or_a_patched_image_writes_where_every_release_it_could_be_would(tiny_llama, tmp_path,
                                                                                          capsys):
    """An unknown label: its release could be any that encodes online, so a warm is refused where their roots
    differ (naming the label and the rule) and goes on where they do not; a patched image not read is r34 with or
    without PR #312, which write alike (only the start differs)."""
    labels = {"local-inference.release.name": "karmic-kraken-r3"}
    image = _inspect(tmp_path, "example.org/vllm:kk", labels)
    env = f"HOME={tmp_path / 'home'} XDG_CACHE_HOME={tmp_path / 'xdg'} "
    xdg = (f"env {env}VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ENCODER_SOURCE={ENC['encoder_root']} "
           f"VLLM_EXL3_ENCODER_REVISION={ENC['encoder_revision']} vllm serve {tiny_llama} "
           f"--quantization-config {shlex.quote(LINEAR)}")
    base = ["cache", "warm", "--dry-run", "--image", "example.org/vllm:kk", "--image-inspect", image]
    code, _, err = run([*base, "--launch", xdg], capsys)
    last = err.strip().splitlines()[-1]
    assert code == 2 and "karmic-kraken-r3" in last and "the cache root is" in last and "--server-release" in last
    code, _, err = run([*base, "--launch", _launch(tiny_llama, tmp_path / "c")], capsys)
    assert code == 0 and "karmic-kraken-r3" in err, err
    assert "release is assumed, but every release it could be (gilded-gnosis-r20..r34, infernal-invocation-r5..r18) "\
           "would write the same entries in the same root" in err
    patched = resolve_release(None, {"local-inference.vllm.integration.tree": release("gg-r34").tree},
                              image="localhost/vllm:gg-r34-patched")
    assert [r.name for r in patched.candidates] == ["gilded-gnosis-r34", "gilded-gnosis-r34+pr312"]
    assert rule_splits(patched.candidates, root_env={"XDG_CACHE_HOME": "/x"}.get) == ()
    assert [s.rule for s in rule_splits(patched.candidates, unaligned=(4304, 4096))] == ["unaligned_start"]


def test_each_rule_that_can_differ_is_said_with_the_releases_on_each_side():
    """The sentences, from the table (an independent list of which releases have which module)."""
    choice = resolve_release(None)
    assert not choice.determined and choice.source == "default" and not choice.assumed
    assert {r.name for r in choice.candidates} == {r.name for r in RELEASES if r.cache is not None}
    older = "gilded-gnosis-r20..r33"
    newer = "gilded-gnosis-r34, infernal-invocation-r5..r18"
    splits = rule_splits(choice.candidates, root_env={"VLLM_CACHE_ROOT": "/v", "XDG_CACHE_HOME": "/x"}.get, r7=True,
                         unaligned=(4096, 4304), nonfinite=True)
    assert [s.rule for s in splits] == ["r7_checkpoints", "nonfinite_entries"]  # one root; no row has PR #312
    assert splits[0].text.endswith(f"by {newer}, and not by {older}")
    assert splits[1].text.endswith(f"by {newer}, but loaded as it is by {older}")
    assert lock_waits(choice.candidates) == (f"{older} wait for as long as the warm holds it (no timeout); {newer} "
                                             "wait up to 600 s, then encode that layer without the cache")
    one = resolve_release("gg-r33")
    assert one.determined and rule_splits(one.candidates, root_env={"XDG_CACHE_HOME": "/x"}.get, r7=True) == ()
