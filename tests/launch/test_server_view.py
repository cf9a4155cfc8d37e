"""The model identity exactly as the server derives it, in the server's own filesystem (issue 35, item 1).

Every expected identity and every hit comes from the tests' independent server functions (``helpers``) run in a
real fake container (``fake_server.in_server_view``: the launch's host folders bind-mounted at its paths on an
empty root, chrooted), and for HF_HUB_OFFLINE from huggingface_hub's own ``snapshot_download`` run there, as vLLM's
``get_model_path`` runs it; never from exl3tool's identity code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import snapshot_download  # imported here: the fake container has no Python library

from exl3tool.cache import server_identities
from exl3tool.cache.hub import hub_cache_dir, hub_offline
from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.launch import Explicit, LaunchInput, apply_launch, load_launch, resolve_launch
from exl3tool.plan import ServerRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fake_server
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # helpers
from fake_server import in_server_view  # noqa: E402
from helpers import LAUNCH_ENC as ENC, LINEAR_WEIGHT as QC, TINY_1 as TINY, TINY_REPO as REPO  # noqa: E402
from helpers import fake_warm, server_encoder_identity, server_lookup, server_model_identity, transformers_commit_hash  # noqa: E402

SERVER_ENV = {"VLLM_EXL3_ONLINE_TRELLIS_BITS": "6", "VLLM_EXL3_ENCODER_SOURCE": ENC[0],
              "VLLM_EXL3_ENCODER_REVISION": ENC[1], "VLLM_EXL3_ONLINE_CACHE_DIR": "/cache"}


def _docker(env: dict, volumes: dict, serve: str) -> str:
    """A ``docker run`` line as deployments write it: -e and -v before the image, the server's words after."""
    es = " ".join(f"-e {k}={v}" for k, v in {**SERVER_ENV, **env}.items())
    vs = " ".join(f"-v {host}:{inside}" for inside, host in volumes.items())
    return f"docker run --gpus all --ipc=host -p 8000:8000 {es} {vs} vllm/vllm-openai:latest {serve}"


def _identity(cli, text: str) -> dict:
    code, out, err = cli("identity", "--launch", text, "--json")
    assert code == 0, err
    return json.loads(out)


# --- HF_HUB_OFFLINE: the snapshot folder, not the repo id ----------------------------------------------------------

@pytest.fixture()
def hf(tmp_path):
    """A host folder used as the container's HF_HOME: two revisions of REPO (refs main and v2)."""
    home = tmp_path / "hf"
    main = write_llama_checkpoint(tmp_path / "w1", **TINY, seed=21, hub_cache=home / "hub", repo_id=REPO)
    v2 = write_llama_checkpoint(tmp_path / "w2", **TINY, seed=22, hub_cache=home / "hub", repo_id=REPO,
                                revision_tags=("v2",))
    assert main.name != v2.name
    (tmp_path / "cache").mkdir()
    return dict(home=home, main=main, v2=v2, cache=tmp_path / "cache", root=tmp_path / "rootfs")


def _server_offline(repo: str, revision, cache: str):
    """In the server's view: vLLM's get_model_path (huggingface_hub's snapshot_download, offline), then the
    server's identity of that folder with transformers' _commit_hash."""
    folder = snapshot_download(repo_id=repo, revision=revision, cache_dir=cache, local_files_only=True)
    return folder, server_model_identity(folder, revision=revision, commit_hash=transformers_commit_hash(folder))


# (the launch's Hub variables, where the host folder is mounted, the server's HF_HUB_CACHE)
HUB_LAYOUTS = {
    "HF_HOME": ({"HF_HOME": "/home/vllm/.cache/huggingface"}, "/home/vllm/.cache/huggingface", "/home/vllm/.cache/huggingface/hub"),
    "HF_HUB_CACHE": ({"HF_HUB_CACHE": "/hub-cache"}, None, "/hub-cache"),
    "HOME": ({"HOME": "/home/srv"}, "/home/srv/.cache/huggingface", "/home/srv/.cache/huggingface/hub"),
    "XDG_CACHE_HOME": ({"XDG_CACHE_HOME": "/xdg", "HOME": "/nonexistent"}, "/xdg/huggingface",
                       "/xdg/huggingface/hub"),
    "legacy HUGGINGFACE_HUB_CACHE": ({"HUGGINGFACE_HUB_CACHE": "/legacy"}, None, "/legacy"),
}


@pytest.mark.parametrize("offline", [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "true"}, {"HF_HUB_OFFLINE": "YES"},
                                     {"HF_HUB_OFFLINE": "On"}, {"TRANSFORMERS_OFFLINE": "1"}])
@pytest.mark.parametrize("layout", list(HUB_LAYOUTS))
def test_offline_hub_repo_is_the_snapshot_directory(cli, hf, offline, layout, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hf["home"]))  # exl3tool's own Hub cache holds the repo too (a CI host)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env, mount, server_cache = HUB_LAYOUTS[layout]
    volumes = {mount: hf["home"]} if mount else {server_cache: hf["home"] / "hub"}
    volumes["/cache"] = hf["cache"]
    text = _docker({**env, **offline}, volumes, f"--model {REPO} --quantization-config '{QC}'")
    folder, want = in_server_view(hf["root"], volumes, _server_offline, REPO, None, server_cache)
    assert folder == f"{server_cache}/models--{REPO.replace('/', '--')}/snapshots/{hf['main'].name}"
    got = _identity(cli, text)
    assert got["model"]["identity"] == want
    assert (got["model"]["kind"], got["model"]["revision"]) == ("directory", hf["main"].name)
    assert got["settings"]["server_path"]["value"] == folder


def test_offline_revision_follows_refs_and_a_commit_is_taken_as_is(cli, hf):
    volumes = {"/home/vllm/.cache/huggingface": hf["home"], "/cache": hf["cache"]}
    env = {"HF_HOME": "/home/vllm/.cache/huggingface", "HF_HUB_OFFLINE": "1"}
    for revision in ("v2", hf["main"].name):
        text = _docker(env, volumes, f"--model {REPO} --revision {revision} --quantization-config '{QC}'")
        folder, want = in_server_view(hf["root"], volumes, _server_offline, REPO, revision,
                                      "/home/vllm/.cache/huggingface/hub")
        got = _identity(cli, text)
        assert got["model"]["identity"] == want and folder.endswith(got["model"]["revision"])
    # a ref the cache does not hold: the server does not start (LocalEntryNotFoundError), so neither does the check
    code, _, err = cli("identity", "--launch", _docker(env, volumes, f"--model {REPO} --revision nope"), "--json")
    assert code == 2 and "refs/nope" in err and "would not start" in err
    with pytest.raises(AssertionError, match="LocalEntryNotFound|Cannot find"):
        in_server_view(hf["root"], volumes, _server_offline, REPO, "nope", "/home/vllm/.cache/huggingface/hub")


def test_offline_warm_is_a_hit_for_the_server(cli, hf, monkeypatch):
    """The headline case of issue 35: every entry the warm writes is a hit for the server's look-up."""
    monkeypatch.setenv("HF_HOME", str(hf["home"]))  # exl3tool's own Hub cache holds the repo too (a CI host)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    volumes = {"/home/vllm/.cache/huggingface": hf["home"], "/cache": hf["cache"]}
    text = _docker({"HF_HOME": "/home/vllm/.cache/huggingface", "HF_HUB_OFFLINE": "1"}, volumes,
                   f"--model {REPO} -tp 2 --quantization-config '{QC}'")
    request, _, _ = apply_launch(ServerRequest(model="", device="cpu"), (), LaunchInput(text=text), add_tp_sizes=True,
                                 environ={})
    summary = fake_warm(request, monkeypatch)
    entries = [(e.prefix, e.tp_size, e.tp_rank, e.input_size, e.output_size) for e in summary.entries]
    assert len(entries) >= 8 and all(e.status == "encoded" for e in summary.entries)

    def server_hits():
        folder = snapshot_download(repo_id=REPO, cache_dir="/home/vllm/.cache/huggingface/hub", local_files_only=True)
        model = server_model_identity(folder, commit_hash=transformers_commit_hash(folder))
        encoder = server_encoder_identity(*ENC)
        return sum(server_lookup("/cache", model, encoder, p, 6, w, r, k, n) is not None for p, w, r, k, n in entries)

    assert in_server_view(hf["root"], volumes, server_hits) == len(entries)
    code, out, err = cli("cache", "check", "--launch", text, "--json")  # and the pre-start check agrees
    assert code == 0 and json.loads(out)["ok"] is True, err


def test_offline_plain_command_line_on_this_host(cli, hf, monkeypatch):
    """``HF_HUB_OFFLINE=1 vllm serve REPO`` on this host: the variables before the command and ours apply."""
    monkeypatch.setenv("HF_HOME", str(hf["home"]))
    env = " ".join(f"{k}={v}" for k, v in {**SERVER_ENV, "VLLM_EXL3_ONLINE_CACHE_DIR": str(hf["cache"])}.items())
    got = _identity(cli, f"HF_HUB_OFFLINE=yes {env} vllm serve {REPO} --revision v2")
    folder = snapshot_download(repo_id=REPO, revision="v2", cache_dir=str(hf["home"] / "hub"), local_files_only=True)
    assert got["model"]["identity"] == server_model_identity(folder, commit_hash=transformers_commit_hash(folder))


def test_online_hub_revision_comes_from_the_launchs_hub_cache(cli, hf, monkeypatch):
    """HF_HUB_OFFLINE=0 wins over TRANSFORMERS_OFFLINE=1 (huggingface_hub reads the first non-empty one), so the
    server keys the Hub repo; exl3tool, itself offline, resolves --revision v2 in the *launch's* Hub cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(hf["root"] / "empty-hf-home"))  # exl3tool's own cache has nothing
    volumes = {"/hf": hf["home"], "/cache": hf["cache"]}
    text = _docker({"HF_HOME": "/hf", "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"}, volumes,
                   f"--model {REPO} --revision v2 --quantization-config '{QC}'")
    got = _identity(cli, text)
    assert got["model"]["kind"] == "hub" and got["model"]["revision"] == hf["v2"].name
    assert got["model"]["identity"] == server_model_identity(REPO, commit_hash=hf["v2"].name)


@pytest.mark.parametrize("env", [
    {"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "true"}, {"HF_HUB_OFFLINE": "On"}, {"HF_HUB_OFFLINE": "yes"},
    {"HF_HUB_OFFLINE": " 1"}, {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"}, {"TRANSFORMERS_OFFLINE": "TRUE"},
    {"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "2"}, {},
])
def test_offline_spellings_are_huggingface_hubs(env):
    from huggingface_hub.constants import _is_true

    assert hub_offline(env) == _is_true(env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE"))


@pytest.mark.parametrize("env", [
    {"HOME": "/home/a"}, {"HOME": "/home/a", "XDG_CACHE_HOME": "/x"}, {"HOME": "/home/a", "HF_HOME": "~/hf"},
    {"HOME": "/home/a", "HF_HOME": "$BASE/hf", "BASE": "/b"}, {"HOME": "/home/a", "HUGGINGFACE_HUB_CACHE": "/legacy"},
    {"HOME": "/home/a", "HF_HUB_CACHE": "${BASE}/hub", "BASE": "/c", "HF_HOME": "/ignored"},
    {"HOME": "/home/a", "HF_HUB_CACHE": "$UNSET/hub"},
])
def test_hub_cache_dir_is_huggingface_hubs(env):
    """huggingface_hub's constants, imported in a process with exactly that environment, are the reference."""
    out = subprocess.run([sys.executable, "-c", "import huggingface_hub.constants as c; print(c.HF_HUB_CACHE)"],
                         env={**env, "PATH": os.environ.get("PATH", "")}, capture_output=True, text=True, check=True)
    assert str(hub_cache_dir(env)) == out.stdout.strip()


# --- a model path that is a link inside the container --------------------------------------------------------------

@pytest.fixture()
def linked(tmp_path):
    """/models (host M) and /weights (host W): v1, v2 folders; links only the container can follow."""
    m, w = tmp_path / "models", tmp_path / "weights"
    write_llama_checkpoint(m / "v1", **TINY, seed=31)
    write_llama_checkpoint(m / "v2", **TINY, seed=32)
    write_llama_checkpoint(w / "v3", **TINY, seed=33)
    os.symlink("v2", m / "current")  # relative
    os.symlink("/models/v2", m / "latest")  # absolute: /models is the container's
    os.symlink("/weights/v3", m / "ext")  # into another mount
    os.symlink("../models/current", w / "chain")  # a link to a link, across mounts
    # v4: its shards are absolute links into /weights/blobs, as a deduplicating layout makes them
    v4 = write_llama_checkpoint(tmp_path / "v4src", **TINY, seed=34)
    (m / "v4").mkdir()
    (w / "blobs").mkdir()
    for f in v4.iterdir():
        if f.suffix == ".safetensors":
            shutil.copy2(f, w / "blobs" / f.name)
            os.symlink(f"/weights/blobs/{f.name}", m / "v4" / f.name)
        else:
            shutil.copy2(f, m / "v4" / f.name)
    (tmp_path / "cache").mkdir()
    return dict(m=m, w=w, cache=tmp_path / "cache", root=tmp_path / "rootfs",
                volumes={"/models": m, "/weights": w, "/cache": tmp_path / "cache"})


@pytest.mark.parametrize("model", ["/models/current", "/models/latest", "/models/ext", "/weights/chain",
                                   "/models/v4", "/models/v1/../current"])
def test_linked_model_path_resolves_as_in_the_container(cli, linked, model):
    want = in_server_view(linked["root"], linked["volumes"], server_model_identity, model)
    text = _docker({}, linked["volumes"], f"--model {model} --quantization-config '{QC}'")
    got = _identity(cli, text)
    assert got["model"]["identity"] == want
    payload = json.loads(got["model"]["payload"])
    assert payload["path"] == in_server_view(linked["root"], linked["volumes"], os.path.realpath, model)


def test_linked_model_warm_is_a_hit_for_the_server(cli, linked, monkeypatch):
    text = _docker({}, linked["volumes"], f"--model /models/current -tp 2 --quantization-config '{QC}'")
    request, settings, _ = apply_launch(ServerRequest(model="", device="cpu"), (), LaunchInput(text=text),
                                        add_tp_sizes=True, environ={})
    assert request.model == str(linked["m"] / "v2")  # the folder read here is the one the link names there
    summary = fake_warm(request, monkeypatch)
    entries = [(e.prefix, e.tp_size, e.tp_rank, e.input_size, e.output_size) for e in summary.entries]

    def server_hits():
        model, encoder = server_model_identity("/models/current"), server_encoder_identity(*ENC)
        return sum(server_lookup("/cache", model, encoder, p, 6, w, r, k, n) is not None for p, w, r, k, n in entries)

    assert entries and in_server_view(linked["root"], linked["volumes"], server_hits) == len(entries)
    code, out, err = cli("cache", "check", "--launch", text, "--json")
    assert code == 0 and json.loads(out)["ok"] is True, err
    # the link moves to v1 (the operator switches versions): the server misses, and so does the check
    os.remove(linked["m"] / "current")
    os.symlink("v1", linked["m"] / "current")
    assert in_server_view(linked["root"], linked["volumes"], server_hits) == 0
    code, out, err = cli("cache", "check", "--launch", text, "--json")
    assert code == 1 and json.loads(out)["ok"] is False, err


def test_link_that_leaves_the_mounts_is_refused_naming_it(cli, linked):
    os.symlink("/opt/models/v9", linked["m"] / "image-only")
    code, _, err = cli("identity", "--launch", _docker({}, linked["volumes"], "--model /models/image-only"))
    assert code == 2 and "/opt" in err and "inside the server's image" in err


# --- VLLM_CACHE_DIR: deployments set it; the fork's envs.py never reads it ----------------------------------------

def test_vllm_cache_dir_is_not_the_servers_cache_root(tmp_path):
    text = (f"docker run -e VLLM_CACHE_DIR=/cache/jit/vllm -e XDG_CACHE_HOME=/xdg -e VLLM_EXL3_ONLINE_TRELLIS_BITS=6 "
            f"-e VLLM_EXL3_ENCODER_SOURCE=/e -e VLLM_EXL3_ENCODER_REVISION=r -v {tmp_path}/x:/xdg "
            f"-v {tmp_path}/j:/cache/jit IMAGE serve {REPO}")
    launch, layers = load_launch(text=text, environ={})
    s = resolve_launch(launch, layers, Explicit(), need_cache=True)
    # the root is $XDG_CACHE_HOME/vllm (vllm/envs.py get_default_cache_root), whatever VLLM_CACHE_DIR says
    assert s.settings["cache_dir"].value == "/xdg/vllm/exl3_online" and s.cache_dir == f"{tmp_path}/x/vllm/exl3_online"
    assert any("VLLM_CACHE_DIR=/cache/jit/vllm is not read by the server" in w for w in s.warnings)
    # VLLM_CACHE_ROOT wins; the same value in both is no warning
    both = text.replace("-e XDG_CACHE_HOME=/xdg", "-e VLLM_CACHE_ROOT=/cache/jit/vllm")
    s = resolve_launch(*load_launch(text=both, environ={}), Explicit())
    assert s.cache_dir == f"{tmp_path}/j/vllm/exl3_online" and not any("VLLM_CACHE_DIR" in w for w in s.warnings)
    assert "not read by the server" in s.settings["vllm_cache_dir"].detail


# --- --pid of a server in a container (pivot_root) or a chroot: a fake /proc tree ----------------------------------

def _proc(tmp_path: Path, pid: int, argv: list[str], env: dict, *, root: str, cwd: str, ns: str,
          mountinfo: str, host_mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    d = proc / str(pid)
    (d / "ns").mkdir(parents=True)
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    (d / "mountinfo").write_text(mountinfo)
    os.symlink(root, d / "root")
    os.symlink(cwd, d / "cwd")
    os.symlink(ns, d / "ns" / "mnt")
    (proc / "self" / "ns").mkdir(parents=True, exist_ok=True)
    (proc / "self" / "mountinfo").write_text(host_mountinfo)
    if not (proc / "self" / "ns" / "mnt").is_symlink():
        os.symlink("mnt:[4026531840]", proc / "self" / "ns" / "mnt")
    return proc


def _pid_identity(proc: Path, pid: int):
    launch, layers = load_launch(pid=pid, environ={}, proc=str(proc))
    s = resolve_launch(launch, layers, Explicit())
    ids = server_identities(s.model, revision=s.revision, server_path=s.server_path, encoder_root=s.encoder_root,
                            encoder_revision=s.encoder_revision, environ=s.environ, view=s.view)
    return s, ids.model


def test_pid_of_a_docker_server_reads_its_mount_namespace(tmp_path, linked):
    """docker/podman pivot_root: /proc/PID/root reads "/", the mount namespace differs; the bind mounts' host
    folders come from its mountinfo and ours (same device, the mounted folder)."""
    m, w, c = linked["m"], linked["w"], linked["cache"]
    mountinfo = (f"600 1 0:77 / / rw,relatime - overlay overlay rw,lowerdir=/x\n"
                 f"601 600 8:1 {m} /models ro,relatime - ext4 /dev/sda1 rw\n"
                 f"602 600 8:1 {w} /weights rw,relatime - ext4 /dev/sda1 rw\n"
                 f"603 600 8:1 {c} /cache rw,relatime - ext4 /dev/sda1 rw\n")
    argv = ["/usr/bin/python3", "/usr/local/bin/vllm", "serve", "current", "--quantization-config", QC]
    proc = _proc(tmp_path, 4242, argv, {**SERVER_ENV, "HOME": "/home/vllm"}, root="/", cwd="/models",
                 ns="mnt:[4026532999]", mountinfo=mountinfo, host_mountinfo="22 1 8:1 / / rw - ext4 /dev/sda1 rw\n")
    s, mid = _pid_identity(proc, 4242)
    assert mid.identity == in_server_view(linked["root"], linked["volumes"], server_model_identity, "/models/current")
    assert s.server_path == "/models/current" and s.model == str(m / "v2")
    assert s.cache_dir == str(c)  # written at the host side of its mount, not through /proc/PID/root
    assert s.settings["cache_dir_here"].detail.startswith("/cache through")


def test_pid_of_a_chrooted_server(tmp_path):
    """A chroot: /proc/PID/root and /proc/PID/cwd read the chroot's host paths; links are the chroot's."""
    chroot = tmp_path / "chroot"
    write_llama_checkpoint(chroot / "models" / "v2", **TINY, seed=41)
    os.symlink("/models/v2", chroot / "models" / "current")
    (chroot / "srv").mkdir()
    (chroot / "cache").mkdir()
    argv = ["vllm", "serve", "../models/current", "--quantization-config", QC]
    proc = _proc(tmp_path, 4343, argv, {**SERVER_ENV, "HOME": "/home/vllm"}, root=str(chroot), cwd=str(chroot / "srv"),
                 ns="mnt:[4026531840]", mountinfo="", host_mountinfo="")
    s, mid = _pid_identity(proc, 4343)
    assert s.server_path == "/models/current"  # its working directory /srv, as it sees it
    assert mid.identity == in_server_view(chroot, {}, server_model_identity, "/models/current")
    assert Path(s.cache_dir).resolve() == chroot / "cache"


def test_mountinfo_escapes_and_stacking():
    from exl3tool.launch.proc import host_mounts, parse_mountinfo

    theirs = parse_mountinfo("1 0 0:5 / / rw - overlay o rw\n"
                             "2 1 8:1 /srv/my\\040models /models ro - ext4 /dev/sda1 rw\n"
                             "3 1 8:2 /data/a /data rw - xfs /dev/sdb rw\n"
                             "4 1 0:9 / /tmp rw - tmpfs tmpfs rw\n")
    ours = parse_mountinfo("10 0 8:1 / / rw - ext4 /dev/sda1 rw\n11 10 8:2 /data /mnt/big rw - xfs /dev/sdb rw\n")
    got = {m.inside: (m.host, m.readonly) for m in host_mounts(theirs, ours, 7)}
    assert got == {"/models": ("/srv/my models", True), "/data": ("/mnt/big/a", False), "/tmp": (None, False)}


def test_pid_of_a_real_server_in_its_own_mount_namespace(cli, tmp_path, linked):
    """The kernel's own /proc: a process started in a new mount namespace, chrooted over the launch's volumes (as
    a container runtime starts one), serving /models/current; --pid reads it as that server sees its files."""
    import time

    from fake_server import start_server

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "vllm").write_text("import time\ntime.sleep(60)\n")
    volumes = {**linked["volumes"], "/opt/bin": tmp_path / "bin"}
    argv = [sys.executable, "/opt/bin/vllm", "serve", "/models/current", "-tp", "2", "--quantization-config", QC]
    pid = start_server(tmp_path / "server-root", volumes, argv, {**SERVER_ENV, "HOME": "/home/vllm"})
    try:
        deadline = time.monotonic() + 20
        while b"/opt/bin/vllm" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.05)
        code, out, err = cli("identity", "--pid", str(pid), "--json")
        launch, layers = load_launch(pid=pid, environ={})
        s = resolve_launch(launch, layers, Explicit())
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert code == 0, err
    want = in_server_view(linked["root"], linked["volumes"], server_model_identity, "/models/current")
    assert json.loads(out)["model"]["identity"] == want
    assert (s.model, s.tp_size, s.cache_dir) == (str(linked["m"] / "v2"), 2, str(linked["cache"]))
