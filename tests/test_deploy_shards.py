"""docs/deploy.md's sharded warms, run as each scheduler would run them, on the CPU with the fake encoder.

* Kubernetes: the Indexed Job's manifest and the settings ConfigMap are parsed with PyYAML; each pod's command runs
  with the ConfigMap's environment (its paths moved under the volumes' stand-ins) and ``JOB_COMPLETION_INDEX`` set,
  all pods at once; then the check Job's command.
* Slurm: the array script runs once per task with ``SLURM_ARRAY_TASK_ID``/``_COUNT``/``_MIN`` set (an array
  numbered from 1), all tasks at once; then the check script; ``submit.sh`` runs with a stand-in ``sbatch`` that
  records what it was asked.
* GitHub Actions: the workflow is parsed; its ``${{ }}`` expressions are filled (an unknown one fails the test) and
  the ``run`` steps of the pin job, every matrix job (at once) and the check job run in order, at TP 1,2 (the
  tiny model's 4 heads do not divide by 8), with the shared cache, HF_HOME and the device (cpu) set by the test.

Each time the shards' reports together name every job of the unsharded plan once, every entry was encoded by one
shard, the cache holds exactly the plan's entries, and the final check says every look-up hits. ``exl3tool`` on
PATH is ``tests/fake_exl3tool.py`` (real planning and cache, instant encodes).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from exl3tool.checkpoint.tiny import write_tiny
from exl3tool.plan import ServerRequest, prepare

from helpers import ENC

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
DOC = REPO / "docs" / "deploy.md"
FAKE_CLI = Path(__file__).resolve().parent / "fake_exl3tool.py"
SHOWN = ("k8s/settings.yaml", "k8s/warm-indexed-job.yaml", "k8s/check-job.yaml", "slurm/warm-array.sbatch",
         "slurm/check.sbatch", "slurm/submit.sh", "ci/warm-shards.yml")


def _bin(tmp: Path) -> Path:
    """A folder with ``exl3tool`` (the fake-encoder CLI) to put first on PATH."""
    folder = tmp / "bin"
    folder.mkdir()
    tool = folder / "exl3tool"
    tool.write_text(f"#!/usr/bin/env bash\nexec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE_CLI))} \"$@\"\n")
    tool.chmod(0o755)
    return folder


def _base_env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB_COMPLETION", "VLLM_", "EXL3TOOL_"))}
    env["PATH"] = f"{_bin(tmp)}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _finish(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"{p.args} failed ({p.returncode}):\n{out[-1500:]}\n{err[-3000:]}"


def _plan_digests(model: Path, tp_sizes: str, quant_config: str | None, encoder: tuple[str, str],
                  revision: str | None = None) -> list[str]:
    """The unsharded plan's job digests (its keys: identities, layers, TP layouts), from the library."""
    request = ServerRequest(model=str(model), tp_sizes=tuple(int(t) for t in tp_sizes.split(",")), device="cpu",
                          quantization_config=quant_config, encoder_root=encoder[0], encoder_revision=encoder[1],
                          cache_dir="/nonexistent-cache", revision=revision)
    return sorted(j.digest for j in prepare(request)[1].jobs)


def _assert_union(reports: list[dict], plan: list[str], cache: Path, count: int) -> None:
    assert len(reports) == count and sorted(r["shard"]["index"] for r in reports) == list(range(count))
    assert {r["shard"]["count"] for r in reports} == {count}
    digests = sorted(e["digest"] for r in reports for e in r["entries"])
    assert digests == plan, "the shards' jobs are not the unsharded plan's, once each"
    encoded = [e["digest"] for r in reports for e in r["entries"] if e["status"] == "encoded"]
    assert all(e["status"] in ("encoded", "skipped") for r in reports for e in r["entries"])
    files = [p for p in (cache / "v1").rglob("*.safetensors")]
    assert len(encoded) == len(set(encoded)) == len(files) > 0


def _check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


# --- Kubernetes ------------------------------------------------------------------------------------------------------

def _manifest(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / "k8s" / name).read_text())


def _pod(job: dict, settings: dict, volumes: dict[str, Path], base: dict) -> tuple[list[str], dict]:
    """The container's argv and environment: the ConfigMap's values, paths under a mount moved to its stand-in."""
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert [ref["configMapRef"]["name"] for ref in container["envFrom"]] == [settings["metadata"]["name"]]
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    env = dict(base)
    for key, value in settings["data"].items():
        for mount, local in mounts.items():
            if value == mount or value.startswith(mount + "/"):
                value = str(local) + value[len(mount):]
        env[key] = value
    return container["command"] + container["args"], env


@pytest.mark.slow
def test_kubernetes_indexed_job_then_check(tmp_path):
    settings, warm_job, check_job = (_manifest(n) for n in ("settings.yaml", "warm-indexed-job.yaml", "check-job.yaml"))
    spec = warm_job["spec"]
    assert spec["completionMode"] == "Indexed"
    count = spec["completions"]
    argv, env = _pod(warm_job, settings, {"models": tmp_path / "models", "cache": tmp_path / "cache"},
                     _base_env(tmp_path))
    assert f"--shard-count {count}" in argv[-1], "--shard-count must equal spec.completions"
    model = write_tiny(Path(env["MODEL"]), "glm5", seed=8)  # MLA with the DSA indexer: shared encodes
    # the example's TP 2,4 is GLM-5's; the tiny one's experts (256) slice in 128-blocks at TP 1,2 only, so a TP 4
    # server of it would not start (cache check says so, exit 1): the ConfigMap's TP_SIZES as an operator sets it
    env["TP_SIZES"] = "1,2"
    env["EXL3TOOL_THREADS"] = "1"
    procs = [subprocess.Popen(argv, env={**env, "JOB_COMPLETION_INDEX": str(i)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(count)]
    _finish(procs)
    reports = [json.loads(p.read_text()) for p in sorted(Path(env["REPORTS_DIR"]).glob("warm-*.json"))]
    assert all("JOB_COMPLETION_INDEX" in r["shard"]["source"] for r in reports)
    plan = _plan_digests(model, env["TP_SIZES"], env["QUANT_CONFIG"], (env["ENCODER_ROOT"], env["ENCODER_REVISION"]))
    _assert_union(reports, plan, Path(env["CACHE_DIR"]), count)

    argv, env = _pod(check_job, settings, {"models": tmp_path / "models", "cache": tmp_path / "cache"}, env)
    env["TP_SIZES"] = "1,2"
    _check_ok(subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300))


# --- Slurm ---------------------------------------------------------------------------------------------------------

def _slurm_env(tmp: Path, model: Path) -> dict:
    return {**_base_env(tmp), "SLURM_SUBMIT_DIR": str(REPO), "MODEL": str(model), "ENCODER_ROOT": ENC["encoder_root"],
            "ENCODER_REVISION": ENC["encoder_revision"], "TP_SIZES": "1,2", "BITS": "6",
            "QUANT_CONFIG": '{"linear": {"weight": "mxfp8"}}', "CACHE_DIR": str(tmp / "shared" / "cache"),
            "REPORTS_DIR": str(tmp / "shared"), "DEVICE": "cpu", "EXL3TOOL_THREADS": "1"}


@pytest.mark.slow
def test_slurm_array_then_check(tmp_path):
    model = write_tiny(tmp_path / "models" / "glm", "glm5.3", seed=9)
    env = _slurm_env(tmp_path, model)
    (tmp_path / "shared").mkdir()
    tasks = range(1, 4)  # sbatch --array=1-3
    array = {"SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "3",
             "SLURM_ARRAY_TASK_STEP": "1"}
    procs = [subprocess.Popen(["bash", str(EXAMPLES / "slurm" / "warm-array.sbatch")], cwd=tmp_path,
                              env={**env, **array, "SLURM_ARRAY_TASK_ID": str(t)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for t in tasks]
    _finish(procs)
    reports = [json.loads((tmp_path / "shared" / f"warm-{t}.json").read_text()) for t in tasks]
    assert [r["shard"]["index"] for r in reports] == [0, 1, 2]
    assert all("SLURM_ARRAY_TASK_ID" in r["shard"]["source"] for r in reports)
    plan = _plan_digests(model, "1,2", env["QUANT_CONFIG"], (ENC["encoder_root"], ENC["encoder_revision"]))
    _assert_union(reports, plan, tmp_path / "shared" / "cache", 3)
    _check_ok(subprocess.run(["bash", str(EXAMPLES / "slurm" / "check.sbatch")], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300))


def test_slurm_submit_asks_for_the_array_then_the_check(tmp_path):
    log = tmp_path / "sbatch.log"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text(f'#!/usr/bin/env bash\necho "$*" >> {shlex.quote(str(log))}\necho "4242;cluster"\n')
    (fake / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "SHARDS": "6"}
    r = subprocess.run(["bash", str(EXAMPLES / "slurm" / "submit.sh")], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, second = log.read_text().splitlines()
    assert "--array=0-5" in first.split() and first.endswith("examples/slurm/warm-array.sbatch")
    assert "--dependency=afterok:4242" in second.split() and second.endswith("examples/slurm/check.sbatch")


# --- GitHub Actions --------------------------------------------------------------------------------------------------

_EXPR = re.compile(r"\$\{\{\s*([\w.-]+)\s*\}\}")


def _fill(text: str, context: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        assert m.group(1) in context, f"the test does not know ${{{{ {m.group(1)} }}}}"
        return context[m.group(1)]
    return _EXPR.sub(one, str(text))


def _run_job(job: dict, context: dict, env: dict, cwd: Path) -> list:
    """The job's ``run`` steps (installs and ``uses`` steps left out), as the runner's bash; the step outputs."""
    outputs: dict[str, str] = {}
    env = {**env, **{k: _fill(v, context) for k, v in job.get("env", {}).items()}}
    cmds = []
    for step in job["steps"]:
        if "uses" in step or step["run"].startswith("pip install"):
            continue
        out_file = cwd / f"output-{len(cmds)}"
        out_file.write_text("")
        step_env = {**env, **{k: _fill(v, context) for k, v in step.get("env", {}).items()},
                    "GITHUB_OUTPUT": str(out_file)}
        cmds.append((["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", _fill(step["run"], context)],
                     step_env, step.get("id"), out_file))
    return cmds, outputs


def _run_steps(cmds: list, cwd: Path, context: dict) -> None:
    for argv, env, step_id, out_file in cmds:
        _finish([subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)])
        for line in out_file.read_text().splitlines():
            key, _, value = line.partition("=")
            context[f"steps.{step_id}.outputs.{key}"] = value


@pytest.mark.slow
def test_github_actions_matrix_then_check(tmp_path):
    flow = yaml.safe_load((EXAMPLES / "ci" / "warm-shards.yml").read_text())
    model = write_tiny(tmp_path / "glm", "glm5.3", seed=10)
    inputs = flow[True]["workflow_dispatch"]["inputs"]  # PyYAML reads the key `on` as True
    context = {f"inputs.{k}": str(v.get("default", "")) for k, v in inputs.items()}
    context.update({"inputs.model": str(model), "vars.EXLLAMAV3_REVISION": ENC["encoder_revision"],
                    "secrets.HF_TOKEN": ""})
    env = {**_base_env(tmp_path), **{k: _fill(v, context) for k, v in flow["env"].items()}}
    env.update(CACHE_DIR=str(tmp_path / "mnt" / "cache"), HF_HOME=str(tmp_path / "hf"), DEVICE="cpu", TP_SIZES="1,2",
               ENCODER_ROOT=ENC["encoder_root"], EXL3TOOL_THREADS="1")
    jobs = flow["jobs"]
    assert jobs["warm"]["needs"] == "pin" and set(jobs["check"]["needs"]) == {"pin", "warm"}

    def workspace(name: str) -> Path:  # a checkout: the repository's examples, the job's own files
        ws = tmp_path / name
        ws.mkdir()
        (ws / "examples").symlink_to(EXAMPLES)
        return ws

    pin_ws = workspace("pin")
    cmds, _ = _run_job(jobs["pin"], context, env, pin_ws)
    _run_steps(cmds, pin_ws, context)
    for key, value in jobs["pin"]["outputs"].items():
        context[f"needs.pin.outputs.{key}"] = _fill(value, context)

    shards = jobs["warm"]["strategy"]["matrix"]["shard"]
    assert shards == list(range(len(shards)))
    procs, spaces = [], []
    for index, shard in enumerate(shards):
        ctx = {**context, "matrix.shard": str(shard), "strategy.job-index": str(index),
               "strategy.job-total": str(len(shards))}
        ws = workspace(f"warm-{shard}")
        cmds, _ = _run_job(jobs["warm"], ctx, env, ws)
        assert len(cmds) == 1  # the warm step
        argv, step_env, _, _ = cmds[0]
        procs.append(subprocess.Popen(argv, env=step_env, cwd=ws, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
        spaces.append(ws / f"warm-{shard}.json")
    _finish(procs)
    reports = [json.loads(p.read_text()) for p in spaces]
    assert all(r["shard"]["source"] == "--shard" for r in reports)
    revision = context["needs.pin.outputs.revision"]
    assert revision == "main"  # a local folder: the revision string as given, pinned once for every shard
    plan = _plan_digests(model, env["TP_SIZES"], env["QUANT_CONFIG"] or None,
                         (ENC["encoder_root"], ENC["encoder_revision"]), revision)
    _assert_union(reports, plan, tmp_path / "mnt" / "cache", len(shards))

    check_ws = workspace("check")
    cmds, _ = _run_job(jobs["check"], context, env, check_ws)
    _run_steps(cmds, check_ws, context)


# --- the page shows what runs ----------------------------------------------------------------------------------------

def test_docs_show_the_shard_examples_verbatim():
    text = DOC.read_text()
    blocks = {m.group(1): m.group(2) for m in re.finditer(r"<!-- examples/(\S+) -->\n```[a-z]*\n(.*?)```", text, re.S)}
    for name in SHOWN:
        assert name in blocks, f"docs/deploy.md does not show examples/{name}"
        assert blocks[name] == (EXAMPLES / name).read_text(), f"docs/deploy.md's copy of examples/{name} is out of date"
