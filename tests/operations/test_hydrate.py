"""`exl3tool hydrate` on tiny checkpoints of four served families: OUT makes no online look-up (the tests' own model
of the fork's storage rules), stored layers are the TP 1 cache entries `cache warm` writes, every other tensor and
file is SOURCE's byte for byte, a killed run resumes to the same bytes, bad inputs are one line and leave nothing."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from exl3tool.checkpoint.synthetic import write_llama_checkpoint
from exl3tool.checkpoint.tiny import TINY_FAMILIES, write_tiny
from exl3tool.format.encoded import EncodedLinear
from exl3tool.operations.hydrate import TEMP_SUFFIX, hydrate, lock_file, plan_hydrate
from exl3tool.plan import ServerRequest

from helpers import (ENC, run, server_encoder_identity, server_lookup, server_model_identity, server_online_lookups,
                     spec_dequantize, tree)
from seeds import fresh_seed

HERE = Path(__file__).resolve().parents[1]


def weight_encode(weight, bits, seed, device, progress=None, **_):
    """A fast stand-in encoder whose every byte depends on the weight it gets and the seed (a wrong slice, dtype,
    orientation or seed changes the output), with the shapes and dtypes of the real one."""
    k, n = weight.shape
    digest = hashlib.sha256(weight.contiguous().numpy().tobytes()).digest()
    g = torch.Generator().manual_seed((seed ^ int.from_bytes(digest[:4], "little")) & 0x7FFFFFFF)
    trellis = torch.randint(-32768, 32767, (k // 16, n // 16, 16 * bits), generator=g, dtype=torch.int32).to(torch.int16)
    return EncodedLinear(trellis, (weight[:, 0] + 1).half(), (weight[0, :] + 1).half(), 0.1, 1.0, bits)


# What a TP 1 server of each tiny family encodes online, written from the model files (docs/layer-plan.md §5) and
# the builders' docstrings: vLLM prefix -> packed source leaves (() for an unfused module).
def _llama():
    out = {}
    for i in range(2):
        p = f"model.layers.{i}"
        out.update({f"{p}.self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), f"{p}.self_attn.o_proj": (),
                    f"{p}.mlp.gate_up_proj": ("gate_proj", "up_proj"), f"{p}.mlp.down_proj": ()})
    return out


QWEN = "language_model.model.layers"
GLM = "language_model.model.layers"
ONLINE = {
    "llama": _llama(),
    # layer 0's MLP and layer 2's GDN projections ship BF16, layer 3 is full attention; in_proj_ba is ignored
    "qwen3.5": {f"{QWEN}.0.mlp.gate_up_proj": ("gate_proj", "up_proj"), f"{QWEN}.0.mlp.down_proj": (),
                f"{QWEN}.2.linear_attn.in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), f"{QWEN}.2.linear_attn.out_proj": (),
                f"{QWEN}.3.self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), f"{QWEN}.3.self_attn.o_proj": ()},
    # MLA: fused_qkv_a_proj is 320 rows (not 128-aligned: no look-up); layer 1's q_b_proj is stored already
    "deepseek-v3": {"model.layers.0.self_attn.q_b_proj": (), "model.layers.0.self_attn.kv_b_proj": (),
                    "model.layers.0.self_attn.o_proj": (), "model.layers.0.mlp.gate_up_proj": ("gate_proj", "up_proj"),
                    "model.layers.0.mlp.down_proj": (), "model.layers.1.self_attn.kv_b_proj": (),
                    "model.layers.1.self_attn.o_proj": ()},
    # GLM-5.3: KDA layers 0-2 (f_b, g_a, g_b, o; the fused q/k/v/b/f_a input is not 128-aligned), layer 0's dense MLP
    "glm5.3": {**{f"{GLM}.{i}.self_attn.{m}": () for i in range(3) for m in ("f_b_proj", "g_a_proj", "g_b_proj", "o_proj")},
               f"{GLM}.0.mlp.gate_up_proj": ("gate_proj", "up_proj"), f"{GLM}.0.mlp.down_proj": ()},
}
FAMILIES = tuple(ONLINE)


def _tensors(root: Path) -> dict[str, bytes]:
    out = {}
    for shard in sorted(root.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as fh:
            out.update({n: fh.get_tensor(n).reshape(-1).view(torch.uint8).numpy().tobytes() for n in fh.keys()})
    return out


def _request(src: Path, family: str, **kw) -> ServerRequest:
    return ServerRequest(model=str(src), quantization_config=TINY_FAMILIES[family].overlay, device="cpu", **kw)


@pytest.fixture(scope="module", params=FAMILIES)
def hydrated(request, tmp_path_factory):
    family = request.param
    base = tmp_path_factory.mktemp(family.replace(".", "_"))
    src = write_tiny(base / "src", family, seed=fresh_seed())
    plan = plan_hydrate(_request(src, family), base / "out")
    report = hydrate(plan, device="cpu", encode=weight_encode)
    return family, src, base / "out", plan, report


def test_out_makes_no_online_lookup(hydrated):
    family, src, out, plan, report = hydrated
    assert server_online_lookups(src, ONLINE[family]) == list(ONLINE[family])  # SOURCE: every one encoded online
    assert server_online_lookups(out, ONLINE[family]) == []
    assert report.encoded == len(plan.modules) and not report.noop


def test_every_other_tensor_and_file_is_source_bytes(hydrated):
    family, src, out, plan, _ = hydrated
    before, after = _tensors(src), _tensors(out)
    removed = {n for n in before if n not in after}
    added = {n for n in after if n not in before}
    assert removed == {m.source.weight for m in plan.modules}
    assert added == {f"{m.module}.{s}" for m in plan.modules for s in ("trellis", "suh", "svh", "mcg")}
    assert all(before[n] == after[n] for n in before if n in after)
    for f in sorted(p.name for p in src.iterdir()):
        if f.endswith(".safetensors") and any(m.shard == f for m in plan.modules) or f in (
                "quantization_config.json", "model.safetensors.index.json"):
            continue
        assert (src / f).read_bytes() == (out / f).read_bytes()
        assert os.stat(src / f).st_ino == os.stat(out / f).st_ino  # hard-linked (same filesystem)
    index = out / "model.safetensors.index.json"
    if index.is_file():  # the index names exactly the tensors of the shards
        wm = json.loads(index.read_text())["weight_map"]
        assert set(wm) == set(after)
        for name, shard in wm.items():
            with safe_open(str(out / shard), framework="np") as fh:
                assert name in fh.keys()
    qc_src = json.loads((src / "quantization_config.json").read_text())
    qc_out = json.loads((out / "quantization_config.json").read_text())
    assert {k: v for k, v in qc_out["tensor_storage"].items() if k in qc_src["tensor_storage"]} == qc_src["tensor_storage"]
    assert {k: v for k, v in qc_out.items() if k not in ("tensor_storage", "exl3tool_hydrate")} == \
        {k: v for k, v in qc_src.items() if k != "tensor_storage"}


def test_unfused_layers_equal_the_tp1_cache_entries(hydrated, tmp_path, monkeypatch):
    family, src, out, plan, _ = hydrated
    import exl3tool.operations.warm.run as run_mod
    from exl3tool.operations.warm import warm

    real = run_mod.run_plan
    monkeypatch.setattr(run_mod, "run_plan", lambda *a, **k: real(*a, **{**k, "encode": weight_encode}))
    cache = tmp_path / "cache"
    warm(ServerRequest(model=str(src), tp_sizes=(1,), quantization_config=TINY_FAMILIES[family].overlay,
                     cache_dir=str(cache), device="cpu", **ENC))
    model_id = server_model_identity(str(src))
    enc_id = server_encoder_identity(ENC["encoder_root"], ENC["encoder_revision"])
    stored = _tensors(out)
    unfused = [layer for layer in plan.layers if len(layer.modules) == 1]
    assert unfused
    for layer in unfused:
        m = layer.modules[0]
        hit = server_lookup(cache, model_id, enc_id, layer.prefix, 6, 1, 0, m.source.in_features, m.source.out_features)
        assert hit is not None, layer.prefix
        for name in ("trellis", "suh", "svh"):
            assert hit[0][name].tobytes() == stored[f"{m.module}.{name}"], (layer.prefix, name)


def test_rehydrating_out_is_a_noop(hydrated, tmp_path, capsys):
    family, _, out, _, _ = hydrated
    before = tree(out)
    ov = TINY_FAMILIES[family].overlay
    code, stdout, err = run(["hydrate", out, tmp_path / "again", "--json"]
                            + (["--quantization-config", ov] if ov else []), capsys)
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["noop"] is True and doc["already_stored"].startswith("every online layer is stored")
    assert not (tmp_path / "again").exists() and tree(out) == before


def test_dry_run_json_is_the_plan_and_writes_nothing(tmp_path, capsys):
    src = write_tiny(tmp_path / "src", "llama", seed=fresh_seed())
    code, stdout, err = run(["hydrate", src, tmp_path / "out", "--dry-run", "--json", "--tp-size", "1"], capsys)
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc == plan_hydrate(ServerRequest(model=str(src)), tmp_path / "out").as_json()
    assert doc["modules"] == 14 and doc["bytes"]["after"] < doc["bytes"]["before"]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(f".*{TEMP_SUFFIX}"))


def _nothing_left(tmp_path: Path, out: Path) -> None:
    assert not out.exists()
    assert not [p for p in tmp_path.rglob("*") if TEMP_SUFFIX in p.name or p.name.endswith(".hydrate.lock")]


def _one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_inputs_are_one_line_and_leave_nothing(tmp_path, capsys, monkeypatch):
    src = write_tiny(tmp_path / "src", "llama", seed=fresh_seed())
    bf16 = write_llama_checkpoint(tmp_path / "bf16", hidden=128, heads=4, kv_heads=2, intermediate=256, layers=1,
                                  vocab=64, shards=1, exl3_lm_head=False)
    out = tmp_path / "out"
    cases = [
        (["hydrate", bf16, out], "not an EXL3 checkpoint"),
        (["hydrate", src, src / "inner"], "is inside SOURCE"),
        (["hydrate", src, out], "nothing to hydrate for TP 1,2,4"),  # tiny: TP 4 slices no layer in 128-blocks
        (["hydrate", src, out, "--tp-size", "3"], "not divisible by tensor-parallel size 3"),
    ]
    for argv, want in cases:
        code, _, err = run(argv, capsys)
        assert code == 2 and want in _one_line(err), (argv, err)
        _nothing_left(tmp_path, out)
    out.mkdir()
    code, _, err = run(["hydrate", src, out, "--tp-size", "1"], capsys)
    assert code == 2 and "exists" in _one_line(err)
    out.rmdir()
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    code, _, err = run(["hydrate", src, out, "--tp-size", "1"], capsys)
    assert code == 2 and "free on its filesystem" in _one_line(err)
    _nothing_left(tmp_path, out)


def test_layers_a_tp_size_cannot_slice_are_left_bf16_and_listed(tmp_path, capsys, monkeypatch):
    src = write_tiny(tmp_path / "src", "llama", seed=fresh_seed())
    monkeypatch.setattr("exl3tool.encode.encode_linear", lambda w, **k: weight_encode(w, k["bits"], k["seed"], "cpu"))
    code, stdout, err = run(["hydrate", src, tmp_path / "out", "--tp-size", "1,2", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(stdout)
    assert [(d["prefix"], d["tp_sizes"]) for d in doc["left_bf16"]] == [
        (f"model.layers.{i}.self_attn.qkv_proj", [2]) for i in range(2)]
    assert "left BF16 (as in SOURCE): model.layers.0.self_attn.qkv_proj" in err
    online = server_online_lookups(tmp_path / "out", ONLINE["llama"])
    assert online == [f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)]


def test_read_only_source_is_read_only(tmp_path, capsys, monkeypatch):
    src = write_tiny(tmp_path / "src", "llama", seed=fresh_seed())
    before = tree(src)
    monkeypatch.setattr("exl3tool.encode.encode_linear", lambda w, **k: weight_encode(w, k["bits"], k["seed"], "cpu"))
    for p in [src, *src.iterdir()]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        code, _, err = run(["hydrate", src, tmp_path / "out", "-q", "--tp-size", "1"], capsys)
    finally:
        src.chmod(0o755)
    assert code == 0, err
    assert tree(src) == {k: v for k, v in tree(src).items()} and {k: v[1:] for k, v in tree(src).items()} == \
        {k: v[1:] for k, v in before.items()}  # same sizes, mtimes and bytes (only our chmod changed the modes)
    assert server_online_lookups(tmp_path / "out", ONLINE["llama"]) == []
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if os.access(locked, os.W_OK):  # root writes anywhere: nothing to show
        return
    code, _, err = run(["hydrate", src, locked / "out", "--tp-size", "1"], capsys)
    assert code == 2 and "cannot create" in _one_line(err)
    _nothing_left(locked, locked / "out")


CHILD = """
import sys, time
sys.path.insert(0, {tests!r})
import exl3tool.encode as enc
from hydrate_child import slow_encode
enc.encode_linear = slow_encode
from exl3tool.cli import main
main({argv!r})
"""


def _child_setup(tmp_path: Path) -> tuple[Path, Path, Path, list[str]]:
    """A tiny Qwen3.5 SOURCE, a clean hydrate of it to compare with, OUT, and the command a child runs into OUT."""
    src = write_tiny(tmp_path / "src", "qwen3.5", seed=fresh_seed())
    clean = tmp_path / "clean"
    hydrate(plan_hydrate(_request(src, "qwen3.5"), clean), device="cpu", encode=weight_encode)
    out = tmp_path / "out"
    argv = ["hydrate", str(src), str(out), "--quantization-config", TINY_FAMILIES["qwen3.5"].overlay, "--device", "cpu",
            "--tp-size", "1"]
    return src, clean, out, argv


def _start_child(argv: list[str]) -> subprocess.Popen:
    """``exl3tool`` with ``argv`` in a child process whose encoder is the tests' slow stand-in (stderr piped)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), str(HERE / "operations")])}
    return subprocess.Popen([sys.executable, "-c", CHILD.format(tests=str(HERE / "operations"), argv=argv)],
                            env=env, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_killed_and_resumed_gives_the_same_bytes(tmp_path, monkeypatch):
    src, clean, out, argv = _child_setup(tmp_path)
    rng = random.Random(fresh_seed())
    for attempt in range(2):  # killed twice at random points, then resumed to the end
        child = _start_child(argv)
        layers = 0
        want = rng.randint(1, 4)
        assert child.stderr is not None
        for line in child.stderr:
            if line.startswith("["):
                layers += 1
                if layers >= want + attempt * 3:
                    break
        time.sleep(rng.random() * 0.3)
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert not out.exists() or attempt == 1  # the partial checkpoint is never visible as OUT
    monkeypatch.setattr("exl3tool.encode.encode_linear", lambda w, **k: weight_encode(w, k["bits"], k["seed"], "cpu"))
    if not out.exists():
        report = hydrate(plan_hydrate(_request(src, "qwen3.5"), out), device="cpu")
        assert report.reused >= 1
    assert {k: v[3] for k, v in tree(out).items()} == {k: v[3] for k, v in tree(clean).items()}
    assert not list(tmp_path.glob(f".*{TEMP_SUFFIX}"))


def test_a_second_hydrate_into_the_same_out_is_refused_while_the_first_runs(tmp_path, capsys):
    """Two hydrates into one OUT: the second is refused at once by name (it used to write into the first one's
    temporary folder and fail with an internal error); the first finishes with the bytes of a run alone."""
    _, clean, out, argv = _child_setup(tmp_path)
    first = _start_child(argv)
    assert first.stderr is not None
    for line in first.stderr:  # its first module done: it holds OUT's lock
        if line.startswith("["):
            break
    code, _, err = run(argv, capsys)
    line = _one_line(err)  # names the lock file, the process holding it and the fix
    assert code == 2 and "another hydrate into it is running" in line, err
    assert f"pid {first.pid} " in line and f"kill {first.pid}" in line and str(lock_file(out)) in line, line
    rest = first.stderr.read()
    assert first.wait(timeout=120) == 0, rest
    assert {k: v[3] for k, v in tree(out).items()} == {k: v[3] for k, v in tree(clean).items()}
    assert not [p for p in tmp_path.iterdir() if TEMP_SUFFIX in p.name or p.name.endswith(".hydrate.lock")]


# one unfused layer per family (and a fused one: GLM-5.3's dense gate/up), each a few seconds of CPU encode
REAL = {"llama": "model.layers.0.self_attn.o_proj", "qwen3.5": f"{QWEN}.3.self_attn.o_proj",
        "deepseek-v3": "model.layers.0.self_attn.o_proj", "glm5.3": f"{GLM}.0.mlp.gate_up_proj"}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_real_encode_decodes_within_k6_error_and_equals_the_warm_entry(family, viterbi_memo, tmp_path, capsys):
    """The real CPU encoder: each stored module decodes (the tests' numpy decoder from the spec) to SOURCE's weight
    within the K6 error; an unfused layer's bytes are the TP 1 entry `cache warm` writes; `verify --against` passes
    on SOURCE and fails on other weights. (The warm's Viterbi reuses the hydrate's states where its tiles are the
    same bits: conftest's viterbi_memo.)"""
    from safetensors.torch import load_file

    from exl3tool.operations.warm import warm

    src = write_tiny(tmp_path / "src", family, seed=fresh_seed())
    layer = REAL[family]
    plan = plan_hydrate(_request(src, family, layers=(layer,)), tmp_path / "out")
    report = hydrate(plan, device="cpu")
    assert report.encoded == len(plan.modules) >= 1
    stored, before = {}, {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        stored.update(load_file(f))
    for f in src.glob("*.safetensors"):
        before.update(load_file(f))
    for m in plan.modules:
        t = {s: stored[f"{m.module}.{s}"] for s in ("trellis", "suh", "svh", "mcg")}
        got = spec_dequantize(t["trellis"].numpy(), t["suh"].numpy(), t["svh"].numpy(), 6)
        w = before[m.source.weight].float().t().double().numpy()
        rel = float(np.sqrt(((got - w) ** 2).mean() / (w ** 2).mean()))
        assert rel < 0.03, (m.module, rel)  # K6 trellis: about 1.8 % RMS on a Gaussian weight
        assert int(t["mcg"]) == -877912083 and t["mcg"].shape == ()
    ov = TINY_FAMILIES[family].overlay
    if len(plan.modules) == 1:
        m = plan.modules[0]
        cache = tmp_path / "cache"
        warm(ServerRequest(model=str(src), tp_sizes=(1,), layers=(layer,), cache_dir=str(cache), device="cpu",
                         quantization_config=ov, **ENC))
        hit = server_lookup(cache, server_model_identity(str(src)),
                            server_encoder_identity(ENC["encoder_root"], ENC["encoder_revision"]), layer, 6, 1, 0,
                            m.source.in_features, m.source.out_features)
        assert hit is not None
        for name in ("trellis", "suh", "svh"):
            assert hit[0][name].tobytes() == stored[f"{m.module}.{name}"].numpy().tobytes()
    quant = ["--quantization-config", ov] if ov else []
    code, stdout, err = run(["verify", tmp_path / "out", "--against", src, "--device", "cpu", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["counts"] == {"pass": len(plan.modules), "fail": 0} and doc["gemm"].startswith("reference")
    assert "no CUDA" in err
    other = write_tiny(tmp_path / "other", family, seed=fresh_seed())
    assert run(["verify", tmp_path / "out", "--against", other, "--device", "cpu"], capsys)[0] == 1
    code, stdout, err = run(["hydrate", tmp_path / "out", tmp_path / "again", "--layers", layer, *quant], capsys)
    assert code == 0 and "nothing to do" in stdout and not (tmp_path / "again").exists(), err  # the same globs again


def test_seed_of_a_fused_source_is_its_own_name(hydrated):
    _, _, _, plan, _ = hydrated
    for layer in plan.layers:
        if len(layer.modules) > 1:
            base = layer.prefix.rsplit(".", 1)[0]
            for m in layer.modules:
                leaf = m.source.module.rsplit(".", 1)[-1]
                assert m.seed == zlib.crc32(f"{base}.{leaf}".encode()) & 0x7FFFFFFF
        else:
            assert layer.modules[0].seed == zlib.crc32(layer.prefix.encode()) & 0x7FFFFFFF
    assert np.int32(-877912083) == np.int32(np.uint32(0xCBAC1FED).view(np.int32))


def test_cache_check_on_out_says_every_online_layer_is_stored(hydrated, tmp_path, capsys):
    """From the server's launch: OUT makes zero look-ups, and says why (exit 0); SOURCE's check misses them all."""
    family, src, out, plan, _ = hydrated
    from exl3tool.checkpoint import DEFAULT_OVERLAY_JSON

    quant = f" --quantization-config '{TINY_FAMILIES[family].overlay or DEFAULT_OVERLAY_JSON}'"
    launch = (f"VLLM_EXL3_ONLINE_TRELLIS_BITS=6 VLLM_EXL3_ENCODER_SOURCE={ENC['encoder_root']} "
              f"VLLM_EXL3_ENCODER_REVISION={ENC['encoder_revision']} VLLM_EXL3_ONLINE_CACHE_DIR={tmp_path / 'cache'} "
              "vllm serve MODEL -tp 1" + quant)
    code, stdout, err = run(["cache", "check", "--launch", launch.replace("MODEL", str(out)), "--json"], capsys)
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["lookups"] == 0 and doc["ok"] is True and doc["stored_only"].startswith("every online layer is stored")
    code, stdout, _ = run(["cache", "check", "--launch", launch.replace("MODEL", str(src))], capsys)
    assert code == 1 and f"{len(plan.layers)} look-ups: 0 hit" in stdout


def test_verify_against_source_fails_a_layer_that_is_not_sources(hydrated, capsys):
    """The stand-in encoder's trellis is noise, not the weight: verify --against catches every module."""
    _, src, out, plan, _ = hydrated
    code, stdout, err = run(["verify", out, "--against", src, "--device", "cpu", "--rows", "1", "--json"], capsys)
    assert code == 1, err
    doc = json.loads(stdout)
    assert doc["counts"]["fail"] == len(plan.modules) and "quantization error" in doc["layers"][0]["reason"]


@pytest.mark.gpu
def test_gpu_hydrate_verifies_through_the_triton_gemm(tmp_path, capsys):
    """On a GPU: a real hydrate of the tiny Qwen3.5's layers, each stored layer through the Triton trellis GEMM
    against SOURCE's FP32 weight (`verify OUT --against SOURCE`), and OUT makes no online look-up."""
    src = write_tiny(tmp_path / "src", "qwen3.5", seed=fresh_seed())
    ov = TINY_FAMILIES["qwen3.5"].overlay
    code, _, err = run(["hydrate", src, tmp_path / "out", "--quantization-config", ov, "--tp-size", "1", "--device",
                        "cuda"], capsys)  # TP 1: every layer stored (the default TP 1,2 leaves 5 BF16)
    assert code == 0, err
    assert server_online_lookups(tmp_path / "out", ONLINE["qwen3.5"]) == []
    code, stdout, err = run(["verify", tmp_path / "out", "--against", src, "--device", "cuda", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["gemm"] == "triton" and doc["counts"] == {"pass": 10, "fail": 0}


@pytest.mark.slow
def test_torchrun_two_workers_split_the_modules_and_write_the_same_bytes(tmp_path):
    """Two gloo workers on the CPU share the modules (each stderr names only its own), worker 0 writes OUT: the
    bytes of a one-process hydrate."""
    src = write_tiny(tmp_path / "src", "llama", seed=fresh_seed())
    clean = tmp_path / "clean"
    hydrate(plan_hydrate(_request(src, "llama"), clean), device="cpu", encode=weight_encode)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), str(HERE / "operations")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "operations" / "hydrate_child.py"), "hydrate", str(src), str(tmp_path / "out"), "--device", "cpu",
           "--json", "--tp-size", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["encoded"] == 14 and doc["modules_stored"] == 14
    assert r.stderr.count("[1/7]") == 2  # two shares of 7 modules each
    assert {k: v[3] for k, v in tree(tmp_path / "out").items()} == {k: v[3] for k, v in tree(clean).items()}


def test_inline_storage_and_a_hub_snapshot_source(tmp_path):
    """tensor_storage inline in config.json gets the records there; a Hub-cache snapshot (files are links into
    blobs/) gives OUT real files, never links that point back into the cache."""
    snap = write_llama_checkpoint(tmp_path / "plain", hidden=128, heads=4, kv_heads=2, head_dim=64, intermediate=256,
                                  layers=1, vocab=512, shards=2, hub_cache=tmp_path / "hub", seed=fresh_seed())
    out = tmp_path / "out"
    hydrate(plan_hydrate(ServerRequest(model=str(snap)), out), device="cpu", encode=weight_encode)
    online = {k: v for k, v in _llama().items() if ".layers.0." in k}
    assert server_online_lookups(snap, online) == list(online) and server_online_lookups(out, online) == []
    assert not [p for p in out.rglob("*") if p.is_symlink()]
    src = tmp_path / "inline"
    shutil.copytree(tmp_path / "plain", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["tensor_storage"] = json.loads((src / "quantization_config.json").read_text())["tensor_storage"]
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "quantization_config.json").unlink()
    plan = plan_hydrate(ServerRequest(model=str(src)), tmp_path / "out2")
    assert plan.storage_file == "config.json"
    hydrate(plan, device="cpu", encode=weight_encode)
    assert server_online_lookups(tmp_path / "out2", online) == []
    assert "model.layers.0.self_attn.o_proj" in json.loads((tmp_path / "out2" / "config.json").read_text())[
        "quantization_config"]["tensor_storage"]


def test_launch_gives_bits_overlay_and_tp_size(tmp_path, capsys):
    """From the server's launch: its VLLM_EXL3_ONLINE_TRELLIS_BITS, overlay and TP size make the plan."""
    src = write_tiny(tmp_path / "src", "llama", seed=fresh_seed())
    launch = (f"VLLM_EXL3_ENCODER_SOURCE=/opt/exllamav3 VLLM_EXL3_ONLINE_TRELLIS_BITS=5 vllm serve {src} -tp 2 "
              "--quantization-config '{\"linear\": \"mxfp8\", \"ignore\": [\"re:.*down_proj$\"]}'")
    code, stdout, err = run(["hydrate", src, tmp_path / "out", "--dry-run", "--json", "--leave-unaligned",
                             "--launch", launch], capsys)
    assert code == 0, err
    # an option of earlier versions that now does nothing: accepted, said in one line, absent from the help
    [said] = [line for line in err.splitlines() if "--leave-unaligned" in line]
    assert said.startswith("warning: --leave-unaligned has no effect"), err
    assert "--leave-unaligned" not in run(["hydrate", "--help"], capsys)[1]
    doc = json.loads(stdout)
    assert doc["bits"] == 5 and doc["tp_sizes"] == [2] and doc["settings"]
    stored = {m["module"] for layer in doc["layers"] for m in layer["modules"]}
    assert stored == {f"model.layers.{i}.{m}" for i in range(2)
                      for m in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")}  # down_proj ignored, qkv left
    assert [d["prefix"] for d in doc["left_bf16"]] == [f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)]


def test_inexpressible_kinds_are_refused_with_why(tmp_path, capsys):
    """A rank-sliced routed-expert checkpoint and a GLM-5.3 routed-only scope: the fork never reads a tensor_storage
    record for them, so hydrate refuses, saying why and what to do instead."""
    from exl3tool.checkpoint.tiny import write_mla

    model = write_mla(tmp_path / "m", seed=fresh_seed())
    cfg = json.loads((model / "config.json").read_text())
    cfg["hybrid_tr3_tail"] = {"format": "exl3-trellis", "bits": 4, "codebook": "mcg", "experts_per_layer": 4,
                              "moe_layers": [1, 1], "tp": 2,
                              "tensor_schema": "model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}"}
    cfg["quantization_config"]["tensor_storage"] = json.loads((model / "quantization_config.json").read_text())[
        "tensor_storage"]
    (model / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(["hydrate", model, tmp_path / "out", "--tp-size", "2"], capsys)
    assert code == 2 and "a rank_sliced checkpoint cannot be hydrated" in _one_line(err)
    _nothing_left(tmp_path, tmp_path / "out")
    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    from fleet_models import write_model  # the GLM-5.3-Flash geometry the scope accepts, header-only shards

    scoped = write_model(tmp_path / "scoped", "glm53-flash", real_layers=())
    code, _, err = run(["hydrate", scoped, tmp_path / "out", "--tp-size", "2"], capsys)
    assert code == 2 and "a glm53_routed_experts_only checkpoint cannot be hydrated" in _one_line(err), err
    _nothing_left(tmp_path, tmp_path / "out")


# a full disk's line: the file, then the free and the needed bytes
NO_SPACE = r"^error: /\S+: no space left on its filesystem \([\d,.]+ (MiB|bytes) free; the rest of the run needs about [\d,.]+ (MiB|bytes)"


def test_disk_filling_during_the_run_keeps_the_results_and_resumes(tmp_path, capsys, monkeypatch):
    """ENOSPC at the third module: one error line naming the file, the free and needed bytes and where the results
    are kept, no OUT; the same command then reuses the two kept modules and writes OUT."""
    import errno

    import exl3tool.operations.hydrate as hy

    src = write_tiny(tmp_path / "src", "llama", seed=fresh_seed())
    monkeypatch.setattr("exl3tool.encode.encode_linear", lambda w, **k: weight_encode(w, k["bits"], k["seed"], "cpu"))
    real, saved = hy._save_result, []

    def save(path, tensors, fingerprint):
        if len(saved) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        saved.append(path)
        real(path, tensors, fingerprint)

    monkeypatch.setattr(hy, "_save_result", save)
    out = tmp_path / "out"
    code, _, err = run(["hydrate", src, out, "--device", "cpu", "--tp-size", "1"], capsys)
    line = _one_line(err)
    assert code == 2 and re.search(NO_SPACE, line), err
    assert str(saved[-1].parent) in line and "2 modules encoded so far are kept in" in line  # names file and where
    assert not out.exists()
    monkeypatch.setattr(hy, "_save_result", real)
    code, stdout, err = run(["hydrate", src, out, "--device", "cpu", "--json", "--tp-size", "1"], capsys)
    assert code == 0, err
    doc = json.loads(stdout)
    assert doc["reused"] == 2 and doc["encoded"] == 12
    assert server_online_lookups(out, ONLINE["llama"]) == []


def test_unchanged_files_are_copied_where_links_fail(tmp_path, monkeypatch):
    """No hard links (another filesystem): the unchanged files are copied, same bytes and times."""
    import errno

    src = write_tiny(tmp_path / "src", "deepseek-v3", seed=fresh_seed())

    def no_link(a, b):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    plan = plan_hydrate(_request(src, "deepseek-v3"), tmp_path / "out")
    report = hydrate(plan, device="cpu", encode=weight_encode)
    assert report.linked == 0 and report.copied == len(plan.unchanged_files) >= 1
    for rel in plan.unchanged_files:
        a, b = src / rel, tmp_path / "out" / rel
        assert a.read_bytes() == b.read_bytes() and a.stat().st_mtime_ns == b.stat().st_mtime_ns
        assert a.stat().st_ino != b.stat().st_ino
