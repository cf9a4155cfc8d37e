"""docs/deploy.md's scripts, run end to end on the CPU: warm a tiny synthetic model in a "CI" tree, export, import
into a "server" tree where model and encoder were copied (mtimes kept) to other absolute paths, and the tests'
independent server look-up, run with the server's paths, hits every entry.

The docs show these scripts verbatim (checked here), so the documented commands are the ones this test runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from exl3tool.checkpoint import write_llama_checkpoint

from helpers import TINY, server_encoder_identity, server_lookup, server_model_identity

REPO_ROOT = Path(__file__).resolve().parent.parent
CI = REPO_ROOT / "examples" / "ci"
DOC = REPO_ROOT / "docs" / "deploy.md"
SCRIPTS = ("common.sh", "identity-key.sh", "warm.sh", "export.sh", "import.sh", "check.sh", "warm-and-bundle.yml",
           "warm-shards.yml")  # warm-shards.yml: run by tests/test_deploy_shards.py
NARROW = {**TINY, "hidden": 128, "intermediate": 256}  # the tiny Llama at half its width, 4 heads of HD: a quarter
HD = 32  # of the tiles to encode (qkv_proj: 128 + 2 x 64); nothing the scripts do depends on the size
TP_SIZES = (1, 2)
LAYERS = "model.layers.0.self_attn.*"  # qkv_proj and o_proj of layer 0
QUANT_CONFIG = '{"linear": {"weight": "mxfp8"}, "ignore": ["re:.*o_proj$"]}'  # the server's: o_proj stays BF16


def expected_jobs():
    """(prefix, W, R, K_r, N_r) of layer 0's qkv_proj at each TP size, from the slicing rules (docs/layer-plan.md §4);
    o_proj is ignored by QUANT_CONFIG, as the server started with it would."""
    heads, kv, hidden = NARROW["heads"], NARROW["kv_heads"], NARROW["hidden"]
    for w in TP_SIZES:
        kv_r = max(1, kv // w)
        for r in range(w):
            yield "model.layers.0.self_attn.qkv_proj", w, r, hidden, (heads // w + 2 * kv_r) * HD


def _run(script: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    r = subprocess.run(["bash", str(CI / script)], env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{script} failed ({r.returncode}):\n{r.stderr}"
    return r


@pytest.mark.slow
def test_scripts_warm_export_import_and_every_entry_hits(tmp_path):
    ci, srv = tmp_path / "ci", tmp_path / "server"
    model = write_llama_checkpoint(ci / "models" / "tiny", **NARROW, head_dim=HD, seed=11, shards=2)
    encoder = ci / "exllamav3"
    (encoder / "modules" / "quant" / "exl3_lib").mkdir(parents=True)
    (encoder / "__init__.py").write_text("__version__ = 'test'\n")
    (encoder / "modules" / "quant" / "exl3_lib" / "quantize.py").write_text("def quantize_exl3(*a, **k): ...\n")
    (srv / "models").mkdir(parents=True)
    (srv / "opt").mkdir()
    subprocess.run(["cp", "-a", str(model), str(srv / "models" / "tiny")], check=True)  # mtimes kept
    subprocess.run(["cp", "-a", str(encoder), str(srv / "opt" / "exllamav3")], check=True)

    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               MODEL=str(model), SERVER_MODEL_PATH=str(srv / "models" / "tiny"),
               ENCODER_ROOT=str(srv / "opt" / "exllamav3"), ENCODER_SOURCE=str(encoder),
               TP_SIZES=",".join(map(str, TP_SIZES)), BITS="6", LAYERS=LAYERS, QUANT_CONFIG=QUANT_CONFIG, DEVICE="cpu",
               CACHE_DIR=str(ci / "cache"), BUNDLE=str(ci / "exl3-bundle.tar"), IDENTITY_JSON=str(ci / "identity.json"))
    for name in ("VLLM_EXL3_ENCODER_SOURCE", "VLLM_EXL3_ENCODER_REVISION", "REVISION", "ENCODER_REVISION", "NPROC"):
        env.pop(name, None)

    key = _run("identity-key.sh", env, ci).stdout.strip()
    _run("warm.sh", env, ci)
    warm = json.loads((ci / "warm.json").read_text())
    assert warm["counts"] == {"hit": 0, "encoded": 3, "skipped": 0, "failed": 0}
    assert warm["quantization_config"]["ignore"] == ["re:.*o_proj$"] and warm["server_lookup"] is True
    _run("export.sh", env, ci)

    node = dict(env, CACHE_DIR=str(srv / "cache"))  # the node needs only BUNDLE and CACHE_DIR
    _run("import.sh", node, srv)

    model_id = server_model_identity(str(srv / "models" / "tiny"))
    encoder_id = server_encoder_identity(str(srv / "opt" / "exllamav3"))
    assert key == f"exl3-{model_id[:20]}-{encoder_id[:20]}-k6"
    for prefix, w, r, k, n in expected_jobs():
        hit = server_lookup(srv / "cache", model_id, encoder_id, prefix, 6, w, r, k, n)
        assert hit is not None, f"{prefix} tp{w}-rank{r} ({k} x {n}) misses on the server"
    # check.sh on the node, with the server's view (its paths; no SERVER_MODEL_PATH, no ENCODER_SOURCE): all hit
    view = dict(node, MODEL=str(srv / "models" / "tiny"))
    for name in ("SERVER_MODEL_PATH", "ENCODER_SOURCE"):
        view.pop(name)
    _run("check.sh", view, srv)
    shard = sorted((srv / "models" / "tiny").glob("*.safetensors"))[0]
    before = shard.stat()
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns + 2_000_000_000))  # as a copy without -p would
    r = subprocess.run(["bash", str(CI / "check.sh")], env=view, cwd=srv, capture_output=True, text=True, timeout=900)
    assert r.returncode == 1 and f"{shard.name} mtime" in r.stdout and "cp -p" in r.stdout, r.stdout + r.stderr
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    files = [p for p in (srv / "cache").rglob("*.safetensors")]
    assert len(files) == 3 and all(p.stat().st_mode & 0o777 == 0o644 for p in files)
    o_proj = [h for w in TP_SIZES for r in range(w) for h in [server_lookup(
        srv / "cache", model_id, encoder_id, "model.layers.0.self_attn.o_proj", 6, w, r, NARROW["hidden"] // w,
        NARROW["hidden"])] if h is not None]
    assert not o_proj, "o_proj is ignored by the server's overlay and must not be warmed"


def _doc_blocks() -> dict[str, str]:
    """``<!-- examples/ci/NAME -->`` followed by a fenced block: the block's text by file name."""
    text = DOC.read_text()
    pattern = re.compile(r"<!-- examples/ci/(\S+) -->\n```[a-z]*\n(.*?)```", re.S)
    return {m.group(1): m.group(2) for m in pattern.finditer(text)}


def test_docs_show_the_scripts_verbatim_and_run_only_tested_ones():
    blocks = _doc_blocks()
    assert set(blocks) == set(SCRIPTS), "docs/deploy.md must show every script of examples/ci"
    for name, body in blocks.items():
        assert body == (CI / name).read_text(), f"docs/deploy.md's copy of examples/ci/{name} is out of date"
    invoked = set(re.findall(r"bash examples/ci/([\w-]+\.sh)", DOC.read_text()))
    assert invoked == {"identity-key.sh", "warm.sh", "export.sh", "import.sh", "check.sh"}  # each run by the test above


def test_workflow_runs_the_scripts_and_keys_the_artifact():
    wf = yaml.safe_load((CI / "warm-and-bundle.yml").read_text())
    job = wf["jobs"]["warm"]
    assert job["env"]["TP_SIZES"] == "1,2,4,8"
    assert job["env"]["QUANT_CONFIG"] == "${{ inputs.quantization_config }}"
    runs = "\n".join(step.get("run", "") for step in job["steps"])
    for script in ("identity-key.sh", "warm.sh", "export.sh"):
        assert f"bash examples/ci/{script}" in runs
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["with"]["name"] == "${{ steps.key.outputs.key }}"


@pytest.mark.slow
def test_export_refuses_a_key_written_for_another_model_and_a_failed_identity_keeps_the_key(tmp_path):
    """identity-key.sh's IDENTITY_JSON names the bundle; export.sh must not write another model's entries under it,
    and an identity that fails must not leave an error document where the key was."""
    a = write_llama_checkpoint(tmp_path / "a", **TINY, seed=1, shards=1)
    b = write_llama_checkpoint(tmp_path / "b", **TINY, seed=2, shards=1)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", MODEL=str(a),
               ENCODER_ROOT="/opt/exllamav3", ENCODER_REVISION="v-test", CACHE_DIR=str(tmp_path / "cache"),
               BUNDLE=str(tmp_path / "b.tar"), IDENTITY_JSON=str(tmp_path / "identity.json"))
    for name in ("VLLM_EXL3_ENCODER_SOURCE", "VLLM_EXL3_ENCODER_REVISION", "REVISION", "ENCODER_SOURCE",
                 "SERVER_MODEL_PATH", "QUANT_CONFIG"):
        env.pop(name, None)
    (tmp_path / "cache").mkdir()
    _run("identity-key.sh", env, tmp_path)
    key = (tmp_path / "identity.json").read_text()
    bad = subprocess.run(["bash", str(CI / "identity-key.sh")], env=dict(env, MODEL=str(tmp_path / "missing")),
                         cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode != 0 and (tmp_path / "identity.json").read_text() == key
    other = subprocess.run(["bash", str(CI / "export.sh")], env=dict(env, MODEL=str(b)), cwd=tmp_path,
                           capture_output=True, text=True)
    assert other.returncode == 2 and "rerun identity-key.sh" in other.stderr, other.stderr
    assert not (tmp_path / "b.tar").exists()
    same = subprocess.run(["bash", str(CI / "export.sh")], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert "rerun identity-key.sh" not in same.stderr  # same model: past the check (an empty cache exports nothing)
