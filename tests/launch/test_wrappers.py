"""Wrappers before the server that change its filesystem, user, host or environment (``launch/wrappers.py``): each
row of the table is followed (its root and binds are the server's view, its environment rules applied, a user's home
from this machine's passwd) or refused in one line naming it; the runtime stand-ins answer queries as a clean host;
``bash -c SCRIPT NAME ARGS`` gives the script ``$0`` and ``"$@"``; an image's entrypoint script is read or named.

Most tests read argv forms (no sandbox: fast); the few that need bash run one launcher each."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import sys
from pathlib import Path

import pytest

from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.errors import ConfigError
from exl3tool.launch import Explicit, load_launch, resolve_launch
from exl3tool.launch.parse import find_server
from exl3tool.launch.script import run_launcher, sandbox_problem
from exl3tool.launch.wrappers import ENTRYPOINT_PASS_THROUGH, WRAPPERS, entrypoint_passes
from helpers import LINEAR as QC, TINY_1 as TINY

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fake_server

DOCS = Path(__file__).resolve().parents[2] / "docs" / "launch.md"
SERVER = ("VLLM_EXL3_ONLINE_TRELLIS_BITS=6", "VLLM_EXL3_ENCODER_SOURCE=/enc", "VLLM_EXL3_ENCODER_REVISION=r1")
sandboxed = pytest.mark.skipif(bool(shutil.which("bash") is None or sandbox_problem()), reason="no sandbox here")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_llama_checkpoint(tmp_path_factory.mktemp("m") / "M", **TINY)


def settings(argv, environ=None, cwd=None):
    launch, layers = load_launch(argv=argv, environ=environ or {}, cwd=cwd)
    return resolve_launch(launch, layers, Explicit())


def serve(model, *more: str) -> list[str]:
    return ["vllm", "serve", str(model), "--quantization-config", QC, *more]


# --- followed: the server's filesystem -----------------------------------------------------------------------------

def test_proot_root_and_binds_are_the_servers_view(tmp_path, model):
    """``proot -R ROOT -b HOST:GUEST``: the guest's /cache/x is the bound host folder, the encoder the one in ROOT,
    the model the bound one; nothing is planned on this machine's /cache or /opt."""
    root, cache = tmp_path / "rootfs", tmp_path / "cache"
    (root / "opt" / "enc" / "modules").mkdir(parents=True)
    (root / "opt" / "enc" / "modules" / "quant.py").write_text("x = 1\n")
    cache.mkdir()
    argv = ["proot", "-R", str(root), "-b", f"{model.parent}:/models", f"--bind={cache}:/cache", "-w", "/models",
            "/usr/bin/env", "-i", "HOME=/root", "VLLM_EXL3_ONLINE_TRELLIS_BITS=6", "VLLM_EXL3_ENCODER_SOURCE=/opt/enc",
            "VLLM_EXL3_ONLINE_CACHE_DIR=/cache/x", "vllm", "serve", "M", "--quantization-config", QC]
    s = settings(argv, environ={"HOME": str(tmp_path / "home"), "VLLM_EXL3_ENCODER_REVISION": "dropped-by-env-i"})
    v = {k: x.value for k, x in s.settings.items()}
    assert v["server_path"] == "/models/M" and v["model_here"] == str(model)  # relative to -w, through the bind
    assert (v["cache_dir"], s.cache_dir) == ("/cache/x", str(cache / "x"))
    assert v["encoder_revision"] is None and s.encoder_source == str(root / "opt" / "enc")  # env -i dropped it
    assert any("proot -R" in n and "the server's filesystem is the folder" in n for n in s.notes), s.notes


def test_proot_without_a_working_directory_refuses_a_relative_model(tmp_path, model):
    argv = ["proot", "-r", str(tmp_path), "-b", f"{model.parent}:/models", *SERVER, "vllm", "serve", "./M"]
    with pytest.raises(ConfigError, match="relative and the server's working directory is not known"):
        settings(argv, environ={"HOME": "/h"})


def test_chroot_bwrap_and_unshare_roots(tmp_path, model):
    models = tmp_path / "r" / "models"
    shutil.copytree(model, models / "v2", copy_function=shutil.copy2)
    os.symlink("/models/v2", models / "current")  # an absolute link: the root's /models/v2, not this machine's
    s = settings(["chroot", "--userspec=vllm:vllm", str(tmp_path / "r"), "env", *SERVER,
                  "VLLM_EXL3_ONLINE_CACHE_DIR=/models", "vllm", "serve", "/models/current", "--quantization-config",
                  QC], environ={"HOME": "/h"})
    v = {k: x.value for k, x in s.settings.items()}
    assert (v["server_path"], v["server_path_resolved"]) == ("/models/current", "/models/v2")
    assert v["model_here"] == str(models / "v2") and s.cache_dir == str(models)
    # bwrap: an empty root, only its binds are this machine's; a path outside them is not here
    argv = ["bwrap", "--ro-bind", str(model), "/m", "--bind", str(tmp_path), "/c", "--tmpfs", "/tmp",
            "--setenv", "VLLM_EXL3_ONLINE_CACHE_DIR", "/c/x", "--unshare-pid", "--die-with-parent", "--clearenv",
            "--setenv", "HOME", "/h", *[a for w in SERVER for a in ("--setenv", *w.split("=", 1))],
            "vllm", "serve", "/m", "--quantization-config", QC]
    s = settings(argv, environ={"VLLM_EXL3_ONLINE_CACHE_DIR": "/not-after-clearenv"})
    assert s.cache_dir == str(tmp_path / "x") and s.settings["model_here"].value == str(model)
    with pytest.raises(ConfigError, match="not on a bind mount"):
        settings([*argv[:-4], "vllm", "serve", "/elsewhere/m", "--quantization-config", QC])
    s = settings(["unshare", "-Urm", f"--root={tmp_path / 'r'}", "--wd=/models", "env", *SERVER,
                  "VLLM_EXL3_ONLINE_CACHE_DIR=/models", "vllm", "serve", "./current", "--quantization-config", QC])
    assert s.settings["server_path"].value == "/models/current"
    assert s.settings["server_path_resolved"].value == "/models/v2"  # the link read in the root


@pytest.fixture()
def linked_root(tmp_path, model):
    """A guest root whose server paths are absolute links to a folder that this machine has too: followed here, each
    leads to this machine's folder (the false answer: a warm wrote there, `cache check` said hit); followed in the
    root, to the root's copy. The cache root /var/cachelink/x, the encoder /opt/enc -> /opt/enc-0.18 (its .py files
    hashed), the --config file /etc/vllm.yaml (TP 4 here, TP 2 in the root), the model copied in at /m."""
    root, host = tmp_path / "rootfs", tmp_path / "hostonly"
    inside = root / str(host).lstrip("/")
    for d in (root / "var", root / "etc", root / "opt" / "enc-0.18" / "modules", inside, host):
        d.mkdir(parents=True, exist_ok=True)
    shutil.copytree(model, root / "m")
    os.symlink(str(host), root / "var" / "cachelink")
    os.symlink("/opt/enc-0.18", root / "opt" / "enc")
    (root / "opt" / "enc-0.18" / "modules" / "quant.py").write_text("TOKEN = 'the root's encoder'\n")
    os.symlink(str(host / "vllm.yaml"), root / "etc" / "vllm.yaml")
    (host / "vllm.yaml").write_text("tensor_parallel_size: 4\n")
    (inside / "vllm.yaml").write_text("tensor_parallel_size: 2\n")
    env = ["VLLM_EXL3_ONLINE_TRELLIS_BITS=6", "VLLM_EXL3_ENCODER_SOURCE=/opt/enc", "VLLM_EXL3_ONLINE_CACHE_DIR=/var/cachelink/x"]
    serve = ["vllm", "serve", "/m", "--config", "/etc/vllm.yaml", "--quantization-config", QC]
    return dict(root=root, host=host, env=env, serve=serve)


@pytest.mark.parametrize("form", ["proot", "chroot", "unshare", "bwrap"])
def test_server_paths_resolve_in_the_servers_view_links_included(linked_root, form):
    """The cache root, the encoder root and the --config file are read as the model path is: their links in the
    server's view (``cache.serverfs.server_realpath``), never this machine's; decided by the real chroot."""
    from exl3tool.cache import server_identities
    from exl3tool.cache.hub import server_hub_cache
    from exl3tool.launch import LaunchInput, apply_launch
    from exl3tool.plan import ServerRequest

    from fake_server import in_server_view
    from helpers import server_encoder_identity

    root, env, serve = linked_root["root"], linked_root["env"], linked_root["serve"]
    wrapper = {"proot": ["proot", "-r", str(root), "env"], "chroot": ["chroot", str(root), "env"],
               "unshare": ["unshare", "-R", str(root), "env"], "bwrap": ["bwrap", "--bind", str(root), "/", "env"]}
    request, s, _ = apply_launch(ServerRequest(model=""), (), LaunchInput(argv=[*wrapper[form], *env, *serve]),
                                 environ={"HOME": "/h"})
    assert s.tp_size == 2  # the root's /etc/vllm.yaml, not the file its link names here
    marker = Path(s.cache_dir) / "written-here"
    marker.parent.mkdir(parents=True)
    marker.write_text("")
    assert in_server_view(root, {}, os.path.exists, "/var/cachelink/x/written-here"), s.cache_dir
    assert not (linked_root["host"] / "x").exists()
    ids = server_identities(request.model, server_path=request.server_path, encoder_root=request.encoder_root,
                            encoder_revision=request.encoder_revision, encoder_source=request.encoder_source,
                            environ={}, view=request.server_view)
    assert ids.encoder.identity == in_server_view(root, {}, server_encoder_identity, "/opt/enc")
    hub = server_hub_cache({"HF_HUB_CACHE": "/var/cachelink/hub"}, request.server_view)
    assert hub == Path(s.cache_dir).parent / "hub"  # the Hub cache too, through the same link in the root


def test_a_link_that_leaves_the_views_mounts_is_refused_naming_it(linked_root, tmp_path):
    """docker -v ROOT/var:/var: the cache root's link leads to a folder the container does not mount (its image's
    own): refused naming the link, never written to this machine's folder of the same name. And a .py link of the
    encoder that resolves elsewhere in the root than here is refused (its files would not be the server's)."""
    root = linked_root["root"]
    argv = ["docker", "run", "-v", f"{root}/var:/var", "-v", f"{root}/m:/m", "-e", "VLLM_EXL3_ONLINE_TRELLIS_BITS=6",
            "-e", "VLLM_EXL3_ENCODER_SOURCE=/opt/e", "-e", "VLLM_EXL3_ENCODER_REVISION=r1", "-e",
            "VLLM_EXL3_ONLINE_CACHE_DIR=/var/cachelink/x", "img", "serve", "/m", "--quantization-config", QC]
    with pytest.raises(ConfigError, match=f"the link /var/cachelink -> {linked_root['host']} leads to "):
        settings(argv)
    os.symlink("/srv/shared/trellis.py", root / "opt" / "enc-0.18" / "modules" / "trellis.py")
    (root / "srv" / "shared").mkdir(parents=True)
    (root / "srv" / "shared" / "trellis.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="the encoder's file /opt/enc-0.18/modules/trellis.py is a link"):
        settings(["proot", "-r", str(root), "env", *linked_root["env"], *linked_root["serve"]])
    assert not (linked_root["host"] / "x").exists()


def test_binds_whose_source_is_missing_follow_each_runner(tmp_path, model):
    """A bind of a host folder that does not exist: proot skips it (its root's folder is the server's, checked with
    proot 5.1.0: "can't sanitize binding"), bwrap refuses it unless -try, podman refuses every one and docker its
    --mount (the server never starts), docker's -v creates it. And proot installs a binding at its guest path
    resolved in the root: -b H:/root/.cache/vllm with /root/.cache -> /data/.cache in the root binds /data/.cache/vllm."""
    root, cache = tmp_path / "rootfs", tmp_path / "cache"
    (root / "data" / ".cache").mkdir(parents=True)
    (root / "root").mkdir()
    os.symlink("/data/.cache", root / "root" / ".cache")
    cache.mkdir()
    gone = tmp_path / "nothere"
    env = [*SERVER, "VLLM_EXL3_ONLINE_CACHE_DIR=/nothere/x"]
    s = settings(["proot", "-r", str(root), "-b", f"{model.parent}:/models", "-b", f"{gone}:/nothere", "env", *env,
                  "vllm", "serve", "/models/M", "--quantization-config", QC])
    assert s.cache_dir == str(root / "nothere" / "x") and not gone.exists()  # not ./nothere/x here
    assert any("skips that binding" in n and str(gone) in n for n in s.notes), s.notes
    s = settings(["proot", "-r", str(root), "-b", f"{model.parent}:/models", "-b", f"{cache}:/root/.cache/vllm",
                  "env", "HOME=/root", *SERVER, "vllm", "serve", "/models/M", "--quantization-config", QC])
    assert s.cache_dir == str(cache / "exl3_online")  # through /root/.cache -> /data/.cache, into the binding
    bwrap = ["bwrap", "--ro-bind", str(model), "/m", "--bind", str(gone), "/nothere", "env", *env, "vllm", "serve",
             "/m", "--quantization-config", QC]
    # the missing folder holds the cache root: a warm's first entry creates it, then the server starts (a warning)
    s = settings(bwrap)
    assert s.cache_dir == str(gone / "x") and any("bwrap refuses it" in w and "`cache warm` creates it" in w
                                                  for w in s.warnings), s.warnings
    with pytest.raises(ConfigError, match="bwrap --bind .* does not exist here, and bwrap refuses it.*never starts"):
        settings([*bwrap[:7], "--bind", str(tmp_path / "other"), "/other", *bwrap[7:]])  # nothing creates /other
    bwrap[4] = "--bind-try"
    with pytest.raises(ConfigError, match="cache root /nothere/x is not on a bind mount"):  # skipped: an empty root
        settings(bwrap)
    run = ["-v", f"{model.parent}:/models", *[a for w in env for a in ("-e", w)]]
    for runner, volume in (("podman", ["-v", f"{gone}:/nothere"]), ("docker", ["--mount", f"type=bind,src={gone},dst=/nothere"])):
        s = settings([runner, "run", *run, *volume, "img", "serve", "/models/M", "--quantization-config", QC])
        assert any(f"{runner} refuses to start the container" in w for w in s.warnings), s.warnings
        with pytest.raises(ConfigError, match=f"{runner} refuses to start the container.*never starts"):
            settings([runner, "run", *run, *volume, "--mount", f"type=bind,src={tmp_path / 'other'},dst=/other", "img", "serve", "/models/M",
                      "--quantization-config", QC])
        if runner == "docker":
            continue  # docker's -v creates the model's missing folder (empty): "does not exist here" as before
        with pytest.raises(ConfigError, match=f"{runner} refuses to start the container.*its model /models/M"):
            settings([runner, "run", *[w.replace(str(model.parent), str(gone / "m")) for w in run], *volume, "img",
                      "serve", "/models/M", "--quantization-config", QC])
    s = settings(["docker", "run", *run, "-v", f"{gone}:/nothere", "img", "serve", "/models/M", "--quantization-config", QC])
    assert s.cache_dir == str(gone / "x")  # docker -v creates the folder: the map holds


def test_binds_under_the_cache_root_and_folders_a_warm_cannot_make(tmp_path, model):
    """A hostile tester's false answers: a bind inside the cache root (the server reads entries under it from
    another folder: a warm wrote the outer one and check said hit), a missing cache bind through a dangling link or
    under a file (a warm cannot create it: the warning promised it would), and docker's -v of a missing model
    folder with MODEL given (docker creates it empty: the server never starts; check said all hit)."""
    outer, inner = tmp_path / "e1", tmp_path / "e2"
    outer.mkdir(), inner.mkdir()
    env = [a for w in (*SERVER, "VLLM_EXL3_ONLINE_CACHE_DIR=/c") for a in ("-e", w)]
    run = ["podman", "run", *env, "-v", f"{model.parent}:/models", "-v", f"{outer}:/c"]
    with pytest.raises(ConfigError, match=f"mounts {inner}:/c/v1 inside the server's cache root /c"):
        settings([*run, "-v", f"{inner}:/c/v1", "img", "serve", "/models/M", "--quantization-config", QC])
    same = outer / "v1"  # the same folder the outer bind gives: nothing differs
    same.mkdir()
    assert settings([*run, "-v", f"{same}:/c/v1", "img", "serve", "/models/M", "--quantization-config", QC]
                    ).cache_dir == str(outer)
    os.symlink(tmp_path / "nowhere", tmp_path / "lnk")
    (tmp_path / "afile").write_text("x")
    for source, why in ((tmp_path / "lnk", "create the link's target"), (tmp_path / "afile" / "sub", "is a file")):
        with pytest.raises(ConfigError, match=f"cannot create it: .*{why}"):
            settings(["podman", "run", *env, "-v", f"{model.parent}:/models", "-v", f"{source}:/c", "img", "serve",
                      "/models/M", "--quantization-config", QC])
    docker = ["docker", "run", *env, "-v", f"{outer}:/c", "-v", f"{tmp_path / 'nomodel'}:/model", "img", "serve",
              "/model", "--quantization-config", QC]
    with pytest.raises(ConfigError, match="docker creates it empty and the server finds no model at /model"):
        settings(docker)
    # MODEL given (a copy here): exl3tool may run on another host than the server (CI, docs/launch.md), so the
    # launch's host path is said, never taken for this host's: a warning, not a refusal
    s = resolve_launch(*load_launch(argv=docker, environ={}), Explicit(model=str(model)))
    assert any("docker creates it empty" in w and "if this is the server's host" in w for w in s.warnings), s.warnings


def test_apptainer_exec_binds_and_image_environment(tmp_path, model):
    sandbox = tmp_path / "img"
    (sandbox / "opt").mkdir(parents=True)
    base = ["apptainer", "exec", "--nv", "--bind", f"{model.parent}:/data,{tmp_path}:/scratch", "--cleanenv",
            "--env", "VLLM_EXL3_ONLINE_CACHE_DIR=/scratch/c"]
    s = settings([*base, str(sandbox), *SERVER, "vllm", "serve", "/data/M", "--quantization-config", QC],
                 environ={"HOME": "/home/u", "APPTAINERENV_HF_HOME": "/scratch/hf"})
    assert s.settings["model_here"].value == str(model) and s.cache_dir == str(tmp_path / "c")
    assert s.settings["hf_home"].value == "/scratch/hf"  # APPTAINERENV_X reaches the server as X
    # a .sif: its files and %environment are not read here; what the server needs must be given
    with pytest.raises(ConfigError, match="apptainer image vllm.sif is not a folder here"):
        settings([*base, "vllm.sif", "vllm", "serve", "/data/M", "--quantization-config", QC])


# --- followed: the environment and the user ------------------------------------------------------------------------

def test_env_i_u_and_chdir(model, tmp_path):
    env = {"HOME": "/h", **dict(w.split("=", 1) for w in SERVER), "VLLM_EXL3_ONLINE_CACHE_DIR": str(tmp_path)}
    s = settings(["env", "-u", "VLLM_EXL3_ENCODER_REVISION", "-C", str(model.parent), "vllm", "serve", "M",
                  "--quantization-config", QC], environ=env)
    assert s.settings["encoder_revision"].value is None and s.settings["model_here"].value == str(model)
    s = settings(["A=1", "env", "-i", "HOME=/h", *SERVER, f"VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}", *serve(model)],
                 environ={"VLLM_EXL3_ONLINE_CACHE_MODE": "off"})
    assert s.server_lookup and "A" not in s.environ  # env -i dropped the process's and the earlier A=1


def test_users_homes_come_from_this_machines_passwd(model):
    """sudo resets the environment and sets the target's HOME (sudoers' env_reset); -E keeps it; an unknown user's
    home is unknown, refused only where the answer depends on it."""
    env = {"HOME": "/caller", "VLLM_EXL3_ONLINE_CACHE_DIR": "/from-caller"}
    root = pwd.getpwnam("root").pw_dir
    s = settings(["sudo", *SERVER, *serve(model)], environ=env)
    assert s.settings["cache_dir"].value == f"{root}/.cache/vllm/exl3_online"  # reset: the caller's dir is gone
    assert any("resets the environment" in n for n in s.notes)
    s = settings(["sudo", "-E", *serve(model)], environ={**env, **dict(w.split("=", 1) for w in SERVER)})
    assert s.settings["cache_dir"].value == "/from-caller"
    s = settings(["runuser", "-u", "root", "--", *SERVER, *serve(model)], environ=env)
    assert s.settings["cache_dir"].value == "/from-caller"  # runuser keeps the environment, sets HOME
    with pytest.raises(ConfigError, match=r"`sudo -u no-such-user-x3t[^`]*`: the server runs as no-such-user-x3t, "
                                          r"whose home is not known here.*cache root is ~/.cache/vllm/exl3_online"):
        settings(["sudo", "-u", "no-such-user-x3t", *SERVER, *serve(model)], environ=env)
    s = settings(["sudo", "-u", "no-such-user-x3t", *SERVER, "VLLM_EXL3_ONLINE_CACHE_DIR=/c", *serve(model)])
    assert s.cache_dir == "/c"  # its home does not matter here: followed
    with pytest.raises(ConfigError, match="how gosu sets its HOME is not modelled"):
        settings(["gosu", "vllm", "env", *SERVER, *serve(model)], environ={"HOME": "/caller"})


def test_a_local_folder_is_served_as_is_when_offline(model, tmp_path):
    """HF_HUB_OFFLINE rewrites a Hub repo id to its snapshot folder, never an existing path (get_model_path)."""
    s = settings(["env", "HF_HUB_OFFLINE=1", *SERVER, f"VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path}", *serve(model)])
    assert s.settings["model_here"].value == str(model) and "hf_hub_offline" not in s.settings


# --- refused ----------------------------------------------------------------------------------------------------

REFUSED = [w for w in WRAPPERS if not w.follow and not w.subcommands]


@pytest.mark.parametrize("name", [w.names[0] for w in REFUSED] + ["docker", "kubectl", "apptainer"])
def test_unmodelled_wrappers_are_refused_naming_them(model, name):
    sub = {"docker": ["exec", "-it", "srv"], "kubectl": ["exec", "pod", "--"], "apptainer": ["run", "x.sif"]}
    argv = [name, *sub.get(name, ["gpu-node"]), *SERVER, *serve(model)]
    with pytest.raises(ConfigError) as err:
        settings(argv, environ={"HOME": "/h", "VLLM_EXL3_ONLINE_CACHE_DIR": "/c"})
    assert f"through `{name} " in str(err.value) and "exl3tool does not follow it" in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_options_of_followed_wrappers_are_refused(model):
    with pytest.raises(ConfigError, match="`proot --overlay-fs`: an option of proot exl3tool does not know"):
        settings(["proot", "--overlay-fs", "/x", *serve(model)])
    with pytest.raises(ConfigError, match="`env -S` is not followed"):
        settings(["env", "-S", "A=1 B=2", *serve(model)])


def test_the_table_and_its_page_agree():
    """Every wrapper is in docs/launch.md's table, and every row says what public file it is modelled on."""
    text = DOCS.read_text()
    for row in WRAPPERS:
        assert row.modelled_on, row.names
        for name in row.names:
            assert re.search(rf"`{re.escape(name)}`", text), f"docs/launch.md does not list {name}"
    for entry in ENTRYPOINT_PASS_THROUGH:
        assert f"`{entry}`" in text
    assert entrypoint_passes(["/usr/bin/tini", "-s", "--", "vllm", "serve"]) == (["vllm", "serve"], entrypoint_passes(
        ["tini", "--", "vllm"])[1])
    assert entrypoint_passes(["/opt/start.sh", "x"]) == (["/opt/start.sh", "x"], "")


# --- the sandbox: stand-ins, $0 and "$@" ------------------------------------------------------------------------

@sandboxed
def test_stand_ins_answer_queries_as_a_clean_host(tmp_path):
    probe = ("podman container exists old; echo exists=$?; docker inspect -f '{{.State.Running}}' x; echo inspect=$?;"
             " echo ps=[$(docker ps -q --filter name=x)]; podman image exists img; echo image=$?;"
             " kubectl get pods -n ns; echo list=$?; kubectl get pod p1; echo get=$?; docker rm -f old; echo rm=$?")
    run = run_launcher(["bash", "-c", probe], environ={"PATH": os.environ["PATH"]}, cwd=str(tmp_path))
    said = dict(line.split("=", 1) for line in run.stdout.split() if "=" in line)
    assert said == {"exists": "1", "inspect": "1", "ps": "[]", "image": "1", "list": "0", "get": "1", "rm": "0"}
    assert [r.answer for r in run.records if r.answer] == ["absent", "absent", "empty", "absent", "empty", "absent"]


@sandboxed
def test_absolute_paths_to_recorded_commands_are_recorded(tmp_path, model):
    """``/usr/bin/env -i PATH=... vllm serve`` (the form of ggrun.sh) and ``/usr/bin/ssh HOST ...``: an absolute path
    bypasses PATH, so before the sandbox ran this machine's env (its -i dropped the recorders: "exited 127 'vllm'")
    and ssh ("Could not resolve hostname"), never the wrapper table's rule. The recorders stand in for those files
    too; a ``#!/usr/bin/env bash`` launcher still runs (its shebang is env), and leaves no record of its own."""
    (tmp_path / "serve.sh").write_text(
        "#!/usr/bin/env bash\nset -e\n/bin/mkdir -p /tmp/logs\n"
        f"/usr/bin/env -i PATH=/usr/bin:/bin HOME=/h {' '.join(SERVER)} VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path} "
        f"vllm serve {model} -tp 2 --quantization-config '{QC}'\n")
    (tmp_path / "serve.sh").chmod(0o755)
    environ = {"PATH": os.environ["PATH"], "HOME": "/caller", "VLLM_EXL3_ONLINE_CACHE_MODE": "off"}
    launch, layers = load_launch(text="./serve.sh", environ=environ, cwd=str(tmp_path))
    s = resolve_launch(launch, layers, Explicit())
    assert (s.tp_size, s.cache_dir, s.server_lookup) == (2, str(tmp_path), True)  # env -i dropped the caller's "off"
    assert s.environ.get("HOME") == "/h" and not any("env bash" in n for n in s.notes), s.notes
    with pytest.raises(ConfigError, match="through `ssh gpu1`.*exl3tool does not follow it"):
        load_launch(text=f"/usr/bin/ssh gpu1 vllm serve {model}", environ=environ, cwd=str(tmp_path))


@sandboxed
def test_bash_c_gives_the_script_its_name_and_arguments():
    words = ["bash", "-lc", 'exec vllm serve "$@" --port "$0"', "8123", "/m", "-tp", "2"]
    start = find_server(words, {})
    assert list(start.words) == ["vllm", "serve", "/m", "-tp", "2", "--port", "8123"]
    start = find_server(["sh", "-c", 'exec vllm serve "$@"', "--", "/m", "--max-model-len", "8"], {})
    assert list(start.words)[2:] == ["/m", "--max-model-len", "8"]  # `--` is $0: the words after it are "$@"


@sandboxed
def test_an_entrypoint_script_in_a_root_folder_is_read_there(tmp_path, model):
    """``podman run --rootfs DIR ... /opt/start.sh``: the script is the root folder's, run in the container's view."""
    root = tmp_path / "root"
    (root / "opt").mkdir(parents=True)
    (root / "opt" / "start.sh").write_text(f"#!/bin/bash\nexport VLLM_EXL3_ONLINE_CACHE_DIR=/c\n"
                                          f"exec vllm serve /models/M --quantization-config '{QC}' \"$@\"\n")
    argv = ["podman", "run", "-v", f"{model.parent}:/models", "-v", f"{tmp_path}:/c",
            *[a for w in SERVER for a in ("-e", w)], "--rootfs", str(root), "/opt/start.sh", "-tp", "2"]
    s = settings(argv, environ={"HOME": "/h"})
    assert (s.tp_size, s.cache_dir, s.settings["model_here"].value) == (2, str(tmp_path), str(model))


def test_pid_of_a_server_under_proot_reads_proots_view(tmp_path, model):
    """proot traces its guest: /proc/PID/root of the server reads this machine's "/", so the guest's paths are read
    through its parent's proot command line (its root and binds), not here."""
    proc = tmp_path / "proc"
    cache = tmp_path / "cache"
    cache.mkdir()
    procs = {4300: (1, ["/var/tmp/proot", "-R", str(tmp_path / "rootfs"), "-b", f"{model.parent}:/models",
                        "-b", f"{cache}:/cache", "/usr/bin/env", "-i", "vllm", "serve", "/models/M"]),
             4301: (4300, ["/usr/bin/python3", "/opt/venv/bin/vllm", "serve", "/models/M", "--quantization-config",
                           QC])}
    for pid, (parent, argv) in procs.items():
        d = proc / str(pid)
        (d / "ns").mkdir(parents=True)
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (d / "stat").write_text(f"{pid} (x) S {parent} 1 1 0")
        os.symlink("/", d / "root")
        os.symlink("mnt:[4026531840]", d / "ns" / "mnt")
    env = {**dict(w.split("=", 1) for w in SERVER), "VLLM_EXL3_ONLINE_CACHE_DIR": "/cache/x", "HOME": "/root"}
    (proc / "4301" / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    (proc / "self" / "ns").mkdir(parents=True)
    os.symlink("mnt:[4026531840]", proc / "self" / "ns" / "mnt")
    launch, layers = load_launch(pid=4301, environ={}, proc=str(proc))
    s = resolve_launch(launch, layers, Explicit())
    assert s.cache_dir == str(cache / "x") and s.settings["model_here"].value == str(model)
    assert any("runs under proot (process 4300" in n for n in s.notes)


@sandboxed
def test_a_script_run_by_proot_runs_in_proots_binds(tmp_path, model):
    """``proot -R ROOT -b HOST:GUEST bash -lc SCRIPT``: the script sees the guest's paths (its binds), and what it
    exports and starts is read in the guest's view."""
    (tmp_path / "rootfs").mkdir()
    script = (f'test -f /models/M/config.json || exit 9; export VLLM_EXL3_ONLINE_CACHE_DIR=/cache/x 2>/dev/null; '
              f'exec vllm serve /models/M --quantization-config \'{QC}\' "$@"')
    argv = ["proot", "-R", str(tmp_path / "rootfs"), "-b", f"{model.parent}:/models", "-b", f"{tmp_path}:/cache",
            "/bin/bash", "-lc", script, "--", "-tp", "2"]
    s = settings(argv, environ={"HOME": "/h", **dict(w.split("=", 1) for w in SERVER)})
    assert (s.tp_size, s.cache_dir, s.settings["model_here"].value) == (2, str(tmp_path / "x"), str(model))


@sandboxed
def test_compose_entrypoint_and_command_lists_reach_the_script(tmp_path, model):
    """compose ``entrypoint: [bash, -lc, 'exec vllm serve "$@"', --]`` with ``command: [MODEL, -tp, 2]``."""
    compose = tmp_path / "docker-compose.yml"
    compose.write_text(
        "services:\n  vllm:\n    image: example/vllm:1\n"
        "    entrypoint: [\"bash\", \"-lc\", \"exec vllm serve \\\"$$@\\\"\", \"--\"]\n"
        f"    command: [\"/models/M\", \"-tp\", \"2\", \"--quantization-config\", {QC!r}]\n"
        f"    environment: [{', '.join(SERVER)}, VLLM_EXL3_ONLINE_CACHE_DIR=/c]\n"
        f"    volumes: [\"{model.parent}:/models\", \"{tmp_path}:/c\"]\n")
    launch, layers = load_launch(compose=str(compose), environ={})
    s = resolve_launch(launch, layers, Explicit())
    assert (s.tp_size, s.cache_dir, s.settings["model_here"].value) == (2, str(tmp_path), str(model))
