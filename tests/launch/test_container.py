"""docker run / podman run: the container's environment, its volumes as a path map, and the server's words."""

from __future__ import annotations

import pytest

from exl3tool.errors import ConfigError
from exl3tool.launch import load_launch
from exl3tool.launch.container import PathMap, parse_run


def test_env_volumes_mounts_workdir(tmp_path):
    envfile = tmp_path / "server.env"
    envfile.write_text("# the image's settings\nVLLM_EXL3_ONLINE_TRELLIS_BITS=4\n\nFROM_HOST\nQUOTED=\"kept\"\n")
    enc = tmp_path / "enc"  # docker --mount refuses a bind source that does not exist (-v creates it)
    enc.mkdir()
    run = parse_run("docker", [
        "--rm", "-it", "--gpus", "all", "-e", "A=1", "-eB=2", "--env=C=3", "-e", "HOST_ONLY", "--env-file", str(envfile),
        "-v", "/srv/models/M:/models/M:ro", "--volume=/srv/cache:/cache/exl3-online", "-v", "named:/data",
        "--mount", f"type=bind,source={enc},target=/opt/exllamav3,readonly", "--mount", "type=tmpfs,target=/tmp",
        "-w", "/work", "--shm-size=16g", "--ipc=host", "img:tag", "serve", "/models/M",
    ], environ={"HOST_ONLY": "h", "FROM_HOST": "f"}, cwd=str(tmp_path))
    env = {k: v.value for k, v in run.env.items()}
    assert env == {"A": "1", "B": "2", "C": "3", "HOST_ONLY": "h", "VLLM_EXL3_ONLINE_TRELLIS_BITS": "4",
                   "FROM_HOST": "f", "QUOTED": '"kept"'}
    assert run.env["VLLM_EXL3_ONLINE_TRELLIS_BITS"].detail == f"{envfile}:2"
    assert (run.image, run.command, run.workdir) == ("img:tag", ("serve", "/models/M"), "/work")
    paths = run.paths
    assert paths.to_host("/models/M") == "/srv/models/M"
    assert paths.to_host("/models/M/config.json") == "/srv/models/M/config.json"
    assert paths.to_host("/cache/exl3-online/v1") == "/srv/cache/v1"
    assert paths.to_host("/opt/exllamav3") == str(enc)
    assert paths.to_host("/data/x") is None  # a named volume: docker decides where it lives
    assert paths.to_host("/usr/lib") is None  # inside the image
    assert paths.mount_for("/models/M/x").readonly and paths.mount_for("/opt/exllamav3").readonly


def test_deepest_mount_wins_and_process_root(tmp_path):
    run = parse_run("docker", ["-v", "/a:/models", "-v", "/b:/models/M", "img"])
    assert run.paths.to_host("/models/M/x") == "/b/x" and run.paths.to_host("/models/N") == "/a/N"
    root = str(tmp_path / "root")  # a process's root as seen from here (/proc/PID/root for --pid)
    assert PathMap(root=root + "/").to_host("/models/M") == root + "/models/M"
    assert PathMap().to_host("/x/../y") == "/y"


@pytest.mark.parametrize("after_image, entry, model", [
    (["vllm", "serve", "/models/M", "-tp", "2"], "vllm serve", "/models/M"),
    (["serve", "/models/M", "-tp", "2"], "vllm serve (the image's entrypoint: vllm)", "/models/M"),
    (["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/M"],
     "python -m vllm.entrypoints.openai.api_server", "/models/M"),
    (["--model", "/models/M", "-tp", "2"], "vllm serve (taken as the image's entrypoint)", "/models/M"),
    (["bash", "-c", "vllm serve /models/M -tp 2"], "vllm serve", "/models/M"),
])
def test_what_follows_the_image(after_image, entry, model):
    for runner in ("docker", "podman"):
        launch, _ = load_launch(argv=[runner, "run", "--rm", "-v", "/srv/M:/models/M", "img", *after_image],
                                environ={})
        assert launch.form == runner and launch.entry == entry
        assert launch.args.values["model"][0] == model


def test_entrypoint_option():
    launch, _ = load_launch(argv=["docker", "run", "--entrypoint", "vllm", "img", "serve", "/models/M"], environ={})
    assert launch.entry == "vllm serve" and launch.args.values["model"][0] == "/models/M"
    launch, _ = load_launch(argv=["docker", "run", "--entrypoint=python3", "img", "-m",
                                  "vllm.entrypoints.openai.api_server", "--model", "/m"], environ={})
    assert launch.entry.startswith("python -m")
    with pytest.raises(ConfigError, match="--entrypoint 'bash'"):
        load_launch(argv=["docker", "run", "--entrypoint", "bash", "img", "-c", "echo"], environ={})


def test_container_errors_name_the_option(tmp_path):
    with pytest.raises(ConfigError, match="--frobnicate"):
        parse_run("docker", ["--frobnicate", "x", "img"])
    assert parse_run("docker", ["--frobnicate=x", "img"]).image == "img"  # attached value: the image is clear
    with pytest.raises(ConfigError, match="-Z"):
        parse_run("docker", ["-Z", "img"])
    with pytest.raises(ConfigError, match="names no image"):
        parse_run("docker", ["--rm", "-e", "A=1"])
    with pytest.raises(ConfigError, match=r"--env-file .*missing\.env"):
        parse_run("docker", ["--env-file", str(tmp_path / "missing.env"), "img"])
    with pytest.raises(ConfigError, match="target="):
        parse_run("docker", ["--mount", "type=bind,source=/a", "img"])


def test_podman_env_host_takes_the_whole_environment():
    launch, layers = load_launch(argv=["podman", "run", "--env-host", "-e", "A=2", "img", "serve", "/m"],
                                 environ={"A": "1", "VLLM_EXL3_ENCODER_SOURCE": "/e"})
    assert layers.get("A").value == "2" and layers.get("VLLM_EXL3_ENCODER_SOURCE").source == "launch env"
