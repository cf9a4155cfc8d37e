"""``--pid``: a real child process started as a server would be (a ``vllm`` console script run by Python, with its
own environment) is read back from /proc, including through a renamed vLLM child (``VLLM::EngineCore``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from exl3tool.checkpoint import write_llama_checkpoint
from exl3tool.errors import ConfigError
from exl3tool.launch import Explicit, load_launch, resolve_launch
from exl3tool.launch.proc import read_process
from helpers import LINEAR as QC, TINY_1 as TINY

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")



@pytest.fixture()
def fake_server(tmp_path):
    """Start ``python <tmp>/vllm serve MODEL -tp 2 ...`` with a server environment; it spawns a child renamed
    ``VLLM::EngineCore`` (as vLLM's engine process is) and prints that child's pid."""
    model = write_llama_checkpoint(tmp_path / "M", **TINY)
    script = tmp_path / "bin" / "vllm"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\nimport subprocess, sys, time\n"
                      "child = subprocess.Popen(['bash', '-c', 'exec -a VLLM::EngineCore sleep 60'])\n"
                      "print(child.pid, flush=True)\ntime.sleep(60)\n")
    script.chmod(0o755)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "VLLM_EXL3_ENCODER_SOURCE": "/opt/exllamav3",
           "VLLM_EXL3_ENCODER_REVISION": "live-rev", "VLLM_EXL3_ONLINE_TRELLIS_BITS": "4",
           "VLLM_EXL3_ONLINE_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, str(script), "serve", "M", "-tp", "2", "--quantization-config", QC],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until bash has exec'd under its new name
            with open(f"/proc/{child}/cmdline", "rb") as fh:
                if fh.read().startswith(b"VLLM::"):
                    break
            time.sleep(0.05)
        yield proc.pid, child, model, tmp_path
    finally:
        subprocess.run(["kill", str(child)], check=False)
        proc.kill()
        proc.wait()


def test_pid_reads_argv_environment_and_cwd(fake_server):
    pid, child, model, home = fake_server
    info = read_process(pid)
    assert info.argv[1:] == (str(home / "bin" / "vllm"), "serve", "M", "-tp", "2", "--quantization-config", QC)
    assert info.environ["VLLM_EXL3_ENCODER_REVISION"] == "live-rev" and info.cwd == str(home)
    launch, layers = load_launch(pid=pid, environ={"VLLM_EXL3_ONLINE_TRELLIS_BITS": "8"})
    s = resolve_launch(launch, layers, Explicit())
    # the model's relative path is taken from the server's working directory; the process environment of exl3tool
    # is not a layer (the server's own environment is complete)
    assert (s.model, s.tp_size, s.bits, s.encoder_revision) == (str(model), 2, 4, "live-rev")
    assert s.settings["bits"].detail.startswith(f"VLLM_EXL3_ONLINE_TRELLIS_BITS (/proc/{pid}/environ")
    assert s.cache_dir == str(home / "cache") and s.launch.pid == pid


def test_pid_of_a_renamed_vllm_child_leads_to_the_server(fake_server):
    pid, child, _, _ = fake_server
    launch, _ = load_launch(pid=child, environ={})
    assert launch.pid == pid and launch.args.values["tp_size"] == ("2", "-tp")


def test_pid_cli_matches_the_launch_line(fake_server, cli):
    pid, _, model, home = fake_server
    code, out, err = cli("cache", "warm", "--dry-run", "--json", "--pid", str(pid))
    assert code == 0, err
    by_pid = json.loads(out)
    code, out, err = cli("cache", "warm", "--dry-run", "--json", str(model), "--tp-size", "2", "--bits", "4",
                         "--encoder-root", "/opt/exllamav3", "--encoder-revision", "live-rev", "--cache-dir",
                         str(home / "cache"), "--quantization-config", QC)
    flags = json.loads(out)
    assert by_pid.pop("launch")["pid"] == pid and by_pid.pop("settings")["bits"]["value"] == 4
    assert by_pid == flags


def test_pid_errors():
    with pytest.raises(ConfigError, match="no such process"):
        read_process(999999999)
    with pytest.raises(ConfigError, match="not a vllm server"):
        load_launch(pid=os.getpid(), environ={})
    with pytest.raises(ConfigError, match="not a process id"):
        read_process(0)
