"""The cache commands take the server's launch (issue 49, goal 5): `cache ls/show/verify/prune/export/import` find
the cache root where `cache warm` of the same launch wrote it: a container's volume mapping the root to a host
folder, a host server's XDG_CACHE_HOME or HOME by its release's rule.

Each test warms a tiny Llama through the CLI with the launch (fake encodes, no encoder parity probe), then runs a
cache command with the same launch. The expected roots are written here from the fork's rule as docs/cache.md
states it (VLLM_EXL3_ONLINE_CACHE_DIR, else XDG_CACHE_HOME/vllm/exl3_online on releases that read it, else
~/.cache/vllm/exl3_online), never from exl3tool's resolution.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from helpers import LAUNCH_ENC as ENC, LINEAR_WEIGHT, TINY_1, fake_encode, run

from exl3tool.checkpoint import write_llama_checkpoint

SERVER_VARS = ("VLLM_EXL3_ONLINE_TRELLIS_BITS", "VLLM_EXL3_ENCODER_SOURCE", "VLLM_EXL3_ENCODER_REVISION",
               "VLLM_EXL3_ONLINE_CACHE_DIR", "VLLM_EXL3_ONLINE_CACHE_MODE", "VLLM_CACHE_ROOT", "XDG_CACHE_HOME")
SERVER_ENV = (f"VLLM_EXL3_ONLINE_TRELLIS_BITS=4 VLLM_EXL3_ENCODER_SOURCE={ENC[0]} "
              f"VLLM_EXL3_ENCODER_REVISION={ENC[1]}")
OLDER = "gilded-gnosis-r33"  # the last release whose cache root ignores XDG_CACHE_HOME (docs/releases.md)


def _serve(path) -> str:
    return f"vllm serve {path} --quantization-config {shlex.quote(LINEAR_WEIGHT)}"


@pytest.fixture(autouse=True)
def fake_warm(monkeypatch, tmp_path):
    """Fake encodes and no parity probe (it would run the image's encoder); no server variable from this machine,
    and a HOME of the test's own."""
    import exl3tool.operations.warm.run as req

    real = getattr(req.run_plan, "__wrapped__", req.run_plan)
    monkeypatch.setattr(req, "run_plan", lambda *a, **k: real(*a, **{**k, "encode": fake_encode}))
    monkeypatch.setattr(req, "_parity", lambda *a, **k: None)
    for name in SERVER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "my-home"))


@pytest.fixture()
def model(tmp_path) -> Path:
    return write_llama_checkpoint(tmp_path / "M", **TINY_1, seed=7)


def _json(capsys, *argv) -> tuple[int, dict, str]:
    code, out, err = run([*argv, "--json"], capsys)
    return code, json.loads(out) if out.strip() else {}, err


def _warm(capsys, *launch) -> dict:
    code, doc, err = _json(capsys, "cache", "warm", "--device", "cpu", *launch)
    assert code == 0 and doc["counts"]["encoded"] > 0, err
    return doc


def _listed(capsys, *launch) -> dict:
    code, doc, err = _json(capsys, "cache", "ls", *launch)
    assert code == 0, err
    return doc


def _docker(cache: Path, model: Path | None, *env: str) -> str:
    """A docker run line as deployments write it; ``model`` None: the model's folder is not mounted here (a cache
    host that has only the cache's volume)."""
    volumes = (f"-v {model}:/models/M:ro " if model else "") + f"-v {cache}:/cache/exl3 "
    es = " ".join(f"-e {e}" for e in (*SERVER_ENV.split(), "VLLM_EXL3_ONLINE_CACHE_DIR=/cache/exl3", *env))
    return f"docker run --gpus all --ipc=host -p 8000:8000 {volumes}{es} vllm/vllm-openai:latest {_serve('/models/M')}"


def test_the_cache_commands_read_the_volume_a_container_launch_warmed(model, tmp_path, capsys):
    cache = tmp_path / "srv-cache"
    cache.mkdir()
    launch = _docker(cache, model)
    warmed = _warm(capsys, "--launch", launch)
    assert warmed["cache_root"] == str(cache)
    listed = _listed(capsys, "--launch", launch)
    assert (listed["root"], listed["entries"]) == (str(cache), warmed["counts"]["encoded"])
    # where only the cache is mounted (the model is not reachable here): the same root, the same entries
    assert _listed(capsys, "--launch", _docker(cache, None)) == listed
    code, doc, err = _json(capsys, "cache", "verify", "--launch", _docker(cache, None))
    assert code == 0 and doc["valid"] == warmed["counts"]["encoded"], err
    digest = warmed["entries"][0]["digest"]
    code, doc, err = _json(capsys, "cache", "show", digest[:12], "--launch", launch)
    assert code == 0 and doc["status"] == "valid", err
    # the launch only picks the root: beside --cache-dir it does nothing, refused in one line
    code, _, err = run(["cache", "ls", "--launch", launch, "--cache-dir", str(cache)], capsys)
    assert code == 2 and "--launch does nothing with --cache-dir" in err


XDG_ROOT, HOME_ROOT = "xdg/vllm/exl3_online", "home/.cache/vllm/exl3_online"


NEWEST = "infernal-invocation-r18"


@pytest.mark.parametrize("release, root, other, other_release",
                         [(NEWEST, XDG_ROOT, HOME_ROOT, OLDER), (OLDER, HOME_ROOT, XDG_ROOT, NEWEST)])
def test_a_host_launch_with_xdg_cache_home_lists_the_root_of_its_release(model, tmp_path, capsys, release, root,
                                                                          other, other_release):
    """A host server started with XDG_CACHE_HOME (and a HOME of its own): the newest releases keep the cache under
    XDG_CACHE_HOME, Gilded Gnosis up to r33 under HOME, so a warm that names no release writes nothing; `cache ls`
    with the same launch and release lists what the warm wrote, and with the other release looks in the other root."""
    launch = f"env HOME={tmp_path / 'home'} XDG_CACHE_HOME={tmp_path / 'xdg'} {SERVER_ENV} {_serve(model)}"
    code, _, err = run(["cache", "warm", "--launch", launch], capsys)
    assert code == 2 and "no write on an assumption" in err and "--server-release" in err, err
    assert not (tmp_path / XDG_ROOT).exists() and not (tmp_path / HOME_ROOT).exists()
    warmed = _warm(capsys, "--launch", launch, "--server-release", release)
    assert warmed["cache_root"] == str(tmp_path / root)
    listed = _listed(capsys, "--launch", launch, "--server-release", release)
    assert (listed["root"], listed["entries"]) == (str(tmp_path / root), warmed["counts"]["encoded"])
    code, _, err = run(["cache", "ls", "--launch", launch, "--server-release", other_release], capsys)
    assert code == 2 and f"error: cache directory {tmp_path / other} does not exist" in err, err


def test_import_publishes_into_the_launchs_root_and_refuses_a_server_that_reads_no_cache(model, tmp_path, capsys):
    cache, other = tmp_path / "warmed", tmp_path / "other"
    cache.mkdir()
    other.mkdir()
    warmed = _warm(capsys, model, "--bits", "4", "--encoder-root", ENC[0], "--encoder-revision", ENC[1],
                   "--cache-dir", cache)
    bundle = tmp_path / "b.tar"
    code, _, err = run(["cache", "export", bundle, "--cache-dir", cache], capsys)
    assert code == 0, err
    code, doc, err = _json(capsys, "cache", "import", bundle, "--launch", _docker(other, None))
    assert code == 0 and (doc["root"], doc["imported"]) == (str(other), warmed["counts"]["encoded"]), err
    assert _listed(capsys, "--cache-dir", other)["entries"] == warmed["counts"]["encoded"]
    off = _docker(other, None, "VLLM_EXL3_ONLINE_CACHE_MODE=off")
    code, _, err = run(["cache", "import", bundle, "--launch", off], capsys)
    assert code == 2 and "makes no cache look-up" in err and "VLLM_EXL3_ONLINE_CACHE_MODE=off" in err
    code, _, err = run(["cache", "ls", "--launch", off], capsys)  # listing it is still right: said, not refused
    assert code == 0 and "warning: no look-up: VLLM_EXL3_ONLINE_CACHE_MODE=off" in err


def test_a_launch_whose_cache_root_is_not_mounted_is_one_line(tmp_path, capsys):
    launch = (f"docker run -e VLLM_EXL3_ONLINE_CACHE_DIR=/cache/exl3 -v {tmp_path}:/models vllm/vllm-openai:latest "
              "vllm serve /models/M")
    code, out, err = run(["cache", "ls", "--launch", launch], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 2 and not out and len(errors) == 1 and "/cache/exl3 is not on a bind mount" in errors[0], err


def test_import_against_plans_model_with_the_launchs_settings(model, tmp_path, monkeypatch):
    """`cache import B --against M --launch L`: M's plan as `cache warm L` would make it (the launch's bits, overlay
    and encoder, in its environment), M the copy read here, the launch's root the cache."""
    from helpers import CliRunner

    from exl3tool.cli import _register, app

    class Stop(Exception):
        pass

    seen = []

    def stop(request, exact=False, environ=None):
        seen.append((request, environ))
        raise Stop

    monkeypatch.setattr("exl3tool.operations.against.AgainstModel.from_request", stop)
    _register()
    cache = tmp_path / "srv-cache"
    res = CliRunner().invoke(app, ["cache", "import", str(tmp_path / "b.tar"), "--against", str(model), "--launch",
                                   _docker(cache, None)])
    assert isinstance(res.exception, Stop), res.output
    [(request, environ)] = seen
    assert (request.model, request.server_path, request.cache_dir, request.bits) == (str(model), "/models/M",
                                                                                      str(cache), 4)
    assert (request.encoder_root, request.encoder_revision, request.quantization_config) == (*ENC, LINEAR_WEIGHT)
    assert environ["VLLM_EXL3_ONLINE_CACHE_DIR"] == "/cache/exl3"


def test_no_command_picks_a_cache_root_that_depends_on_a_release_nothing_named(model, tmp_path, capsys,
                                                                                 monkeypatch):
    """Where XDG_CACHE_HOME gives the root and nothing names the release, Gilded Gnosis r20 to r33 read
    ~/.cache/vllm/exl3_online and the newer releases XDG_CACHE_HOME/vllm/exl3_online. Before: `cache warm` refused,
    but `cache import` wrote into the newest's root (exit 0) and `cache ls`, `verify`, `show`, `prune`, `export` and
    `verify MODEL` answered on it. Now each is refused (exit 2) naming both roots and both fixes, from the launch or
    from this process's environment; named, or where every release computes one root, each answers."""
    xdg, home = tmp_path / XDG_ROOT, tmp_path / HOME_ROOT
    xdg.mkdir(parents=True)  # both roots exist: the refusal is not "no such cache directory"
    home.mkdir(parents=True)
    launch = f"env HOME={tmp_path / 'home'} XDG_CACHE_HOME={tmp_path / 'xdg'} {SERVER_ENV} {_serve(model)}"
    split = (f"the cache root is ~/.cache/vllm/exl3_online for gilded-gnosis-r20..r33, but {xdg} for "
             "gilded-gnosis-r34, infernal-invocation-r5..r18")
    bundle = tmp_path / "b.tar"
    commands = (["cache", "ls"], ["cache", "verify"], ["cache", "show", "abcdef12"],
                ["cache", "prune", "--temp", "--dry-run"], ["cache", "export", str(tmp_path / "out.tar")],
                ["cache", "import", str(bundle)], ["cache", "import", str(bundle), "--against", str(model)],
                ["verify"], ["encode", "--mode", "readonly", "--dry-run"])
    for argv in commands:
        code, _, err = run([*argv, "--launch", launch], capsys)
        last = err.strip().splitlines()[-1]
        assert code == 2 and split in last and "--server-release NAME" in last and "--cache-dir DIR" in last, (argv,
                                                                                                              err)
        assert ("no write on an assumption" in last) == (argv[:2] == ["cache", "import"]), (argv, last)
    assert not any(xdg.iterdir()) and not any(home.iterdir()) and not (tmp_path / "out.tar").exists()
    # without a launch: this process's XDG_CACHE_HOME gives the root the same way
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    code, _, err = run(["cache", "ls"], capsys)
    assert code == 2 and split in err and "in place of the launch" not in err, err
    for named, root in ((OLDER, home), (NEWEST, xdg)):
        assert _listed(capsys, "--server-release", named)["root"] == str(root)
    assert _listed(capsys, "--cache-dir", str(home))["root"] == str(home)
    monkeypatch.delenv("XDG_CACHE_HOME")  # every release computes ~/.cache/vllm/exl3_online: answered, no note
    code, doc, err = _json(capsys, "cache", "ls")
    assert code == 0 and doc["root"] == str(home) and "not named" not in err, err
