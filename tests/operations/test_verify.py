"""`exl3tool verify` on a freshly warmed synthetic model (CPU path), and every way an entry can be wrong.

One module-scoped warm encodes layer 1's o_proj at TP 2 (two entries); each test works on its own copy.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from exl3tool.cache.entry import write_entry
from exl3tool.operations.verify import default_quant_err, verify_plan
from exl3tool.plan import ServerRequest, prepare

from helpers import ENC, completed, warm_one_layer
from seeds import fresh_seed

# every test here shares a module fixture that encodes on the CPU (30-100 s on 2 shared cores, --durations):
# the full suite only (issue 44)
pytestmark = pytest.mark.slow

LAYER = "model.layers.1.self_attn.o_proj"


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    return warm_one_layer(tmp_path_factory.mktemp("verify"), LAYER, fresh_seed(24))


@pytest.fixture
def copy(warmed, tmp_path):
    """A private copy of the warmed model and cache (same absolute model path, so the identity holds)."""
    model, cache = warmed
    dst = tmp_path / "cache"
    shutil.copytree(cache, dst)
    return model, dst


def _verify(model, cache, layers=(LAYER,), **kw):
    request = ServerRequest(model=str(model), tp_sizes=(2,), layers=layers, cache_dir=str(cache), mode="readonly",
                          device="cpu", **ENC)
    checkpoint, plan, store = prepare(request)
    return verify_plan(plan, checkpoint, store, rows=(1, 16), seed=5, device=torch.device("cpu"), **kw)


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*.safetensors") if not p.name.startswith("."))


def _tree(cache: Path) -> dict[str, bytes]:
    return {str(p.relative_to(cache)): p.read_bytes() for p in sorted(cache.rglob("*")) if p.is_file()}


def test_verify_passes_on_fresh_warm_and_never_writes(copy):
    model, cache = copy
    before = _tree(cache)
    report = _verify(model, cache)
    assert report.ok, [c.reason for c in report.layers]
    assert "GPU kernel not run" in report.gemm
    for c in report.layers:
        assert c.kernel_err < 1e-3 and 0.005 < c.quant_err < default_quant_err(6)
        assert c.proxy_error is not None and c.weight_rel_err < 0.03
    assert _tree(cache) == before


def test_missing_entry_fails_by_name(copy):
    model, cache = copy
    report = _verify(model, cache, layers=(LAYER, "model.layers.0.self_attn.o_proj"))
    failed = {c.prefix for c in report.failed}
    assert failed == {"model.layers.0.self_attn.o_proj"}
    assert all("no cache entry" in c.reason for c in report.failed)


def test_corrupt_entry_fails(copy):
    model, cache = copy
    path = _entries(cache)[0]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    report = _verify(model, cache)
    assert len(report.failed) == 1 and "invalid entry" in report.failed[0].reason


def test_swapped_entry_files_fail(copy):
    """Each file sits under the other's digest: its cache_key no longer matches, as the server would see."""
    model, cache = copy
    a, b = _entries(cache)
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    report = _verify(model, cache)
    assert len(report.failed) == 2 and all("invalid entry" in c.reason for c in report.failed)


def test_wrong_tp_slice_fails_on_quantization_error(copy):
    """Well-formed entries with the right keys but each other's tensors: only the numbers can tell."""
    model, cache = copy
    request = ServerRequest(model=str(model), tp_sizes=(2,), layers=(LAYER,), cache_dir=str(cache), mode="readonly", **ENC)
    _, plan, store = prepare(request)
    found = [store.lookup(j.key) for j in plan.jobs]
    for job, other in zip(plan.jobs, reversed(found)):
        write_entry(job.path, job.key, other.tensors, other.proxy_error)
    report = _verify(model, cache)
    assert len(report.failed) == 2
    for c in report.failed:
        assert "quantization error" in c.reason and c.quant_err > 0.5 and c.kernel_err < 1e-3


def test_checkpoint_changed_after_warm_fails(copy, tmp_path):
    """Weights replaced in place with size and mtime kept (the identity caveat of the spec): verify catches it."""
    model, cache = copy
    moved = tmp_path / "model-orig"
    shutil.copytree(model, moved)
    f = model / "model.safetensors"
    st = f.stat()
    try:
        header_len = int.from_bytes(f.read_bytes()[:8], "little")
        header = json.loads(f.read_bytes()[8:8 + header_len])
        start, end = header[LAYER + ".weight"]["data_offsets"]
        rows = header[LAYER + ".weight"]["shape"][0]
        with open(f, "r+b") as fh:  # shuffle the rows of that tensor in place: same size, same header
            fh.seek(8 + header_len + start)
            data = bytearray(fh.read(end - start))
            row = len(data) // rows
            perm = torch.randperm(rows).tolist()
            shuffled = b"".join(bytes(data[i * row:(i + 1) * row]) for i in perm)
            fh.seek(8 + header_len + start)
            fh.write(shuffled)
        assert f.stat().st_size == st.st_size
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        report = _verify(model, cache)
        assert len(report.failed) == 2 and all("quantization error" in c.reason for c in report.failed)
    finally:
        shutil.copy2(moved / "model.safetensors", f)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_wrong_decode_is_caught_as_kernel_error(copy, monkeypatch):
    """A GEMM that decodes a perturbed trellis disagrees with dequantize(): the kernel-error check fires."""
    import exl3tool.operations.verify as verify_mod
    from exl3tool.kernels.gemm import trellis_matmul_reference

    def broken(device):
        def gemm(x, trellis, suh, svh, bits):
            bad = trellis.clone()
            bad.view(-1)[:: 7] ^= 0x0101  # flip low bits of every 7th word
            return trellis_matmul_reference(x, bad, suh, svh, bits=bits, codebook="mcg")

        return gemm, "deliberately broken"

    monkeypatch.setattr(verify_mod, "pick_gemm", broken)
    model, cache = copy
    report = _verify(model, cache)
    assert len(report.failed) == 2 and all("kernel error" in c.reason for c in report.failed)


def test_cli_exit_codes_json_and_markdown_report(copy, tmp_path):
    model, cache = copy
    base = ["verify", str(model), "--tp-size", "2", "--layers", LAYER,
            "--cache-dir", str(cache), "--rows", "1,3", "--device", "cpu", "--encoder-root", ENC["encoder_root"],
            "--encoder-revision", ENC["encoder_revision"]]
    r = completed([*base, "--json", "--report", str(tmp_path / "r.md")])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["counts"] == {"pass": 2, "fail": 0} and doc["rows"] == [1, 3]
    assert "| model.layers.1.self_attn.o_proj |" in (tmp_path / "r.md").read_text()
    r = completed([*base, "--layers", "model.layers.0.mlp.down_proj"])
    assert r.returncode == 1 and "no cache entry" in r.stdout + r.stderr
    r = completed([*base, "--rows", "x"])
    assert r.returncode == 2
