"""The server's image: its ENV, labels and entrypoint from a saved inspect document, from ``docker|podman image
inspect`` on PATH (a fake one here: no engine), or from the table of the fork's published images.

The four inspect documents of ``tests/data/images`` are modelled on the fork's published images (a Gilded Gnosis
r34-like and an Infernal Invocation r18-like image with the exllamav3 fork baked in, an older July image without
encoder variables, and an image built for exl3tool as the server's encoder), written in our own words;
``expected.json`` says what the server derives from each. The reference for every plan is the one exl3tool makes
from the same settings given as its own flags (no image read), and ``tests/helpers.py``'s independent server
computes the encoder identity the image's settings give.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.launch import LaunchInput, apply_launch
from exl3tool.launch.image import published_images, read_image, table_image
from exl3tool.launch.request import launch_image
from exl3tool.plan import ServerRequest
from helpers import TINY, server_encoder_identity
from seeds import fresh_seed

DATA = Path(__file__).resolve().parent.parent / "data" / "images"
EXPECTED = json.loads((DATA / "expected.json").read_text())
FILES = sorted(k for k in EXPECTED if k.endswith(".json"))
QC = '{"linear": {"weight": "mxfp8"}, "ignore": ["lm_head"]}'
FORK_REV = "704aefd743b390af4bd0fb429d1906f9b964c7d8"
R34 = "voipmonitor/vllm:gilded-gnosis-v20-vllm4d006a4-b12xcd3ce19-fi1ac6942-cu132-20260810-r34"


def _tag(name: str) -> str:
    return json.loads((DATA / name).read_text())[0]["RepoTags"][0]


@pytest.fixture()
def model(tmp_path) -> Path:
    return write_llama_checkpoint(tmp_path / "M", **TINY, seed=fresh_seed(16))


@pytest.fixture()
def export(tmp_path, cli) -> Path:
    """An `exl3tool encoder-source` export: the files the exl3tool-encoder image holds at /opt/exl3tool-encoder."""
    code, _, err = cli("encoder-source", str(tmp_path / "enc"))
    assert code == 0, err
    return tmp_path / "enc"


def _fake_runtime(tmp_path: Path, tool: str = "docker") -> Path:
    """A ``docker``/``podman`` on PATH that answers ``image inspect --format '{{json .Config}}' NAME`` with the Config
    of the saved inspect document naming NAME (as the engine would), and "No such image" otherwise."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    table = {_tag(f): str(DATA / f) for f in FILES}
    script = bindir / tool
    script.write_text(
        "#!/usr/bin/env python3\nimport json, sys\n"
        f"TABLE = {table!r}\n"
        "a = sys.argv[1:]\n"
        "if a[:3] != ['image', 'inspect', '--format'] or a[3] != '{{json .Config}}':\n"
        "    sys.exit('unexpected: ' + ' '.join(a))\n"
        "if a[4] not in TABLE:\n"
        "    sys.stderr.write('Error: No such image: ' + a[4] + '\\n'); sys.exit(1)\n"
        "print(json.dumps(json.load(open(TABLE[a[4]]))[0]['Config']))\n")
    script.chmod(0o755)
    return bindir


def _plan(cli, *args) -> tuple[int, dict, str]:
    code, out, err = cli("cache", "warm", "--dry-run", "--json", *args)
    doc = json.loads(out) if out.strip() else {}
    return code, doc, err


def _launch(name: str, model: Path, cache: Path, extra: str = "", serve: str = "serve") -> str:
    return (f"docker run --gpus all -v {model}:/models/M -v {cache}/c:/cache -v {cache}/v:/var/cache {extra} "
            f"-e VLLM_EXL3_ONLINE_TRELLIS_BITS=5 {_tag(name)} {serve} /models/M -tp 2 --quantization-config '{QC}'")


def _reference(cli, model: Path, root: str, revision: str | None, cache_here: Path, source: Path | None = None) -> dict:
    """The plan from exl3tool's own flags (nothing read from an image)."""
    args = [str(model), "--tp-size", "2", "--bits", "5", "--quantization-config", QC, "--encoder-root", root,
            "--cache-dir", str(cache_here), "--server-path", "/models/M"]
    args += ["--encoder-revision", revision] if revision else ["--encoder-source", str(source)]
    code, doc, err = _plan(cli, *args)
    assert code == 0 and doc["jobs"], err
    return doc


def _host(cache: Path, server_dir: str) -> Path:
    """Where the launch's mounts put the server's cache root here."""
    if server_dir.startswith("/cache/"):
        return cache / "c" / server_dir[len("/cache/"):]
    assert server_dir.startswith("/var/cache/")
    return cache / "v" / server_dir[len("/var/cache/"):]


@pytest.mark.parametrize("name", FILES)
def test_each_image_as_the_server_derives_it(tmp_path, cli, model, export, name):
    """``--image-inspect FILE`` with a docker launch of that image: encoder, cache root and mode as expected.json
    says, the label a release is picked by, the entrypoint; the plan equals the one from exl3tool's own flags."""
    want = EXPECTED[name]
    cache = tmp_path / "cache"
    extra = ""
    if want["entrypoint"] == ["/opt/nvidia/nvidia_entrypoint.sh"]:
        # NVIDIA's entrypoint runs its arguments: `IMAGE serve ...` runs a command `serve` of the image, not vllm's
        code, _, err = _plan(cli, "--image-inspect", str(DATA / name), "--launch", _launch(name, model, cache))
        assert code == 2 and "nvidia_entrypoint.sh" in err and "'serve' is a command of the image" in err, err
        launch_of = functools.partial(_launch, serve="vllm serve")
    else:
        launch_of = _launch
    if want["encoder_root"] is None:  # the July image sets no encoder: its launchers pass it, so must this launch
        code, _, err = _plan(cli, "--image-inspect", str(DATA / name), "--launch", launch_of(name, model, cache))
        assert code == 2 and "VLLM_EXL3_ENCODER_SOURCE" in err, err
        extra = f"-e VLLM_EXL3_ENCODER_SOURCE=/opt/exllamav3-python/exllamav3 -e VLLM_EXL3_ENCODER_REVISION={FORK_REV}"
        want = {**want, "encoder_root": "/opt/exllamav3-python/exllamav3", "encoder_revision": FORK_REV}
    if want["entrypoint"] not in (["vllm"], ["/opt/nvidia/nvidia_entrypoint.sh"]):
        # the image's entrypoint is a script inside it: named, never taken for `vllm serve`; the launch names vllm
        code, _, err = _plan(cli, "--image-inspect", str(DATA / name), "--launch", launch_of(name, model, cache, extra))
        assert code == 2 and f"entrypoint {' '.join(want['entrypoint'])}" in err and "--entrypoint" in err, err
        extra += " --entrypoint vllm"
    args = ["--image-inspect", str(DATA / name), "--launch", launch_of(name, model, cache, extra)]
    if want["encoder_revision"] is None:  # files mode: the server hashes the image's files; give their copy
        args += ["--encoder-source", str(export)]
    if want.get("cache_dir_by_release"):  # the root depends on a release nothing names: no plan until it is named
        code, _, err = _plan(cli, *args)
        assert code == 2 and "the cache root is ~/.cache/vllm/exl3_online for gilded-gnosis-r20..r33" in err, err
        assert "--server-release NAME" in err
        args += ["--server-release", "infernal-invocation-r18"]
    code, got, err = _plan(cli, *args)
    assert code == 0, err
    s, image = got["settings"], got["launch"]["image"]
    assert s["encoder_root"]["value"] == want["encoder_root"]
    assert s["encoder_revision"]["value"] == want["encoder_revision"]
    assert s["cache_dir"]["value"] == want["cache_dir"]
    assert s["cache_mode"]["value"] == want["cache_mode"]
    assert image["source"] == "inspect file" and image["entrypoint"] == want["entrypoint"]
    assert image["labels"].get("local-inference.vllm.integration.tree") == want["tree"]
    assert f"image {_tag(name)}: ENV, labels and entrypoint from inspect file" in err
    ref = _reference(cli, model, want["encoder_root"], want["encoder_revision"], _host(cache, want["cache_dir"]),
                     export)
    assert (got["model_identity"], got["encoder_identity"], got["cache_root"]) == (
        ref["model_identity"], ref["encoder_identity"], ref["cache_root"])
    assert [j["digest"] for j in got["jobs"]] == [j["digest"] for j in ref["jobs"]]
    if want["encoder_revision"]:  # the independent server's encoder identity for the image's settings
        assert got["encoder_identity"] == server_encoder_identity(want["encoder_root"], want["encoder_revision"])


@pytest.mark.parametrize("tool", ["docker", "podman"])
def test_the_runtime_on_path_inspects_the_image(tmp_path, cli, model, monkeypatch, tool):
    """No --image-inspect: `docker|podman image inspect` reads the image (never a pull); the launch's runner first."""
    name = "gg-like-r34.inspect.json"
    monkeypatch.setenv("PATH", f"{_fake_runtime(tmp_path, tool)}{os.pathsep}/usr/bin{os.pathsep}/bin")
    cache = tmp_path / "cache"
    (cache / "v").mkdir(parents=True)  # podman refuses a bind whose source is missing; docker's -v creates it
    launch = _launch(name, model, cache, serve="vllm serve").replace("docker run", f"{tool} run", 1)
    code, got, err = _plan(cli, "--launch", launch)
    assert code == 0, err
    # the cache root's own bind (cache/c) is missing: a warm creates it, so podman starts after the warm
    assert (tool == "podman") == ("`cache warm` creates it" in err), err
    if tool == "podman":  # until then podman refuses the container: cache check's first finding, not plain misses
        code, out, err = cli("cache", "check", "--json", "--launch", launch)
        failures = json.loads(out)["start_failures"]
        assert code == 1 and failures[0]["field"] == "launch" and "will not start yet" in failures[0]["text"], out
    assert got["launch"]["image"]["source"] == f"{tool} image inspect"
    assert got["settings"]["encoder_revision"]["value"] == FORK_REV
    assert got["launch"]["image"]["labels"]["local-inference.vllm.integration.tree"] == EXPECTED[name]["tree"]
    assert f"from {tool} image inspect" in err
    # an image the engine does not have and exl3tool's table does not know: one line, naming the way to give it
    code, _, err = _plan(cli, "--launch", launch.replace(_tag(name), "example.org/none:1"))
    errors = [x for x in err.splitlines() if x.startswith("error")]
    assert code == 2 and len(errors) == 1 and "No such image" in errors[0] and "--image-inspect" in errors[0], err


def test_the_published_table_when_no_runtime_is_here(tmp_path, cli, model, monkeypatch):
    """Neither docker nor podman: a published image's settings come from exl3tool's table, and say so."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    cache = tmp_path / "cache"
    launch = (f"docker run --gpus all -v {model}:/models/M -v {cache}:/cache -e VLLM_EXL3_ONLINE_TRELLIS_BITS=6 "
              f"{R34} vllm serve /models/M -tp 2 --quantization-config '{QC}'")
    code, got, err = _plan(cli, "--launch", launch)
    assert code == 0, err
    image = got["launch"]["image"]
    assert image["source"] == "published-images table" and image["release"] == "Gilded Gnosis v20 r34"
    assert got["settings"]["encoder_revision"]["value"] == FORK_REV
    assert got["settings"]["cache_dir"]["value"] == "/cache/exl3-online"
    assert got["cache_root"] == str(cache / "exl3-online")
    assert "exl3tool's published-images table: Gilded Gnosis v20 r34" in err
    assert "neither docker nor podman is on PATH" in err  # what was tried first is said too
    assert got["encoder_identity"] == server_encoder_identity("/opt/exllamav3-python/exllamav3", FORK_REV)


def test_image_without_a_launch(tmp_path, cli, model, monkeypatch):
    """`identity MODEL --image NAME`: the image's ENV is the server's environment (this process's is not)."""
    monkeypatch.setenv("PATH", f"{_fake_runtime(tmp_path)}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setenv("VLLM_EXL3_ENCODER_REVISION", "this-process-not-the-server")
    name = "ii-like-r18.inspect.json"
    code, out, err = cli("identity", str(model), "--image", _tag(name), "--json")
    assert code == 0, err
    assert json.loads(out)["encoder"]["identity"] == server_encoder_identity("/opt/exllamav3-python/exllamav3",
                                                                             FORK_REV)
    assert "from docker image inspect" in err
    code, _, err = cli("identity", str(model), "--image", "example.org/none:1")
    errors = [x for x in err.splitlines() if x.startswith("error")]
    assert code == 2 and len(errors) == 1 and "--image example.org/none:1" in errors[0], err
    code, _, err = cli("identity", str(model), "--image-inspect", str(DATA / name))
    assert code == 2 and "--image NAME" in err


def test_one_image_only(tmp_path, cli, model):
    cache = tmp_path / "cache"
    name = "gg-like-r34.inspect.json"
    code, _, err = _plan(cli, "--image", "other/image:1", "--image-inspect", str(DATA / name), "--launch",
                         _launch(name, model, cache, serve="vllm serve"))
    assert code == 2 and "give one image" in err


def test_labels_reach_the_launch_settings(tmp_path, model):
    """The library's answer: ``LaunchSettings.image_labels`` (what a server release is picked by)."""
    name = "ii-like-r18.inspect.json"
    cache = tmp_path / "cache"
    launch = LaunchInput(text=_launch(name, model, cache, "--entrypoint vllm"), image_inspect=str(DATA / name))
    request, settings, _ = apply_launch(ServerRequest(model=""), set(), launch, environ={})
    want = json.loads((DATA / name).read_text())[0]["Config"]["Labels"]
    assert settings.image_labels == want and settings.image.source == "inspect file"
    assert request.encoder_image == _tag(name) and request.encoder_image_runner == "docker"
    assert launch_image(launch, settings) is settings.image
    alone = LaunchInput(image=_tag(name), image_inspect=str(DATA / name))  # --image without a launch
    request, settings, environ = apply_launch(ServerRequest(model="m"), set(), alone, environ={"HOME": "/root"})
    assert settings is None and launch_image(alone, None).labels == want
    assert environ["VLLM_EXL3_ENCODER_REVISION"] == FORK_REV and request.encoder_image == _tag(name)


def test_published_table_rows():
    """Every row of the shipped table names its images, cites repository, file and commit for what it holds, and
    agrees with itself (the encoder revision is the exllamav3 commit its label names)."""
    rows = published_images()
    assert len(rows) >= 4
    for row in rows:
        assert row["names"] and row["release"] and row["sources"]
        for src in row["sources"]:
            assert src["repo"].count("/") == 1 and src["file"] and len(src["commit"]) == 40 and src["what"]
        rev = row["env"].get("VLLM_EXL3_ENCODER_REVISION")
        if rev is not None:
            assert row["labels"]["local-inference.exllamav3.commit"] == rev
        for n in row["names"]:
            assert table_image(n).release == row["release"]
            assert table_image("docker.io/" + n).release == row["release"]  # Docker Hub's host is the same image
    assert table_image(R34).env["VLLM_EXL3_ENCODER_REVISION"] == FORK_REV
    assert table_image("voipmonitor/vllm:gilded-gnosis-v20-unknown") is None


def test_saved_inspect_of_several_images_picks_by_name(tmp_path):
    docs = [json.loads((DATA / f).read_text())[0] for f in FILES]
    both = tmp_path / "all.json"
    both.write_text(json.dumps(docs))
    s, _ = read_image(_tag("ff-like-v17.inspect.json"), inspect_file=str(both))
    assert s.env["XDG_CACHE_HOME"] == "/cache/jit" and not s.labels
    with pytest.raises(Exception, match="several|none"):
        read_image("example.org/none:1", inspect_file=str(both))
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(Exception, match="is not JSON"):
        read_image("x", inspect_file=str(bad))


def test_image_files_without_online_encoding_are_named_not_the_labelled_release():
    """An r34 label on an image whose exl3.py has no online method: the server runs those files, so the reason it
    looks nothing up names them, never "gilded-gnosis-r34 encodes no layer" (false: r34 encodes online)."""
    from exl3tool.releases import ForkModules, git_blob, no_online_encoding, resolve_release

    labels = {"local-inference.release.name": "gilded-gnosis-r34"}
    for text, said in (("class Nothing: pass\n", "is no release's: it encodes nothing online"),
                       (None, "no exl3.py under /img/vllm")):
        blob = git_blob(text.encode()) if text is not None else None
        choice = resolve_release(labels=labels, modules=ForkModules("/img/vllm", None, blob, text or ""))
        assert not choice.release.online_cache
        why = no_online_encoding(choice.release)
        assert why.startswith("the image's own files encode no layer to EXL3 online") and said in why, why
        assert "gilded-gnosis-r34 encodes" not in why and "exl3tool hydrate" in why
    assert no_online_encoding(resolve_release("gilded-gnosis-r19").release).startswith(  # a row: said by its name
        "gilded-gnosis-r19 encodes no layer to EXL3 online")
