"""What the tests share: running exl3tool, tensors and entries without an encode, and an independent server.

* ``CliRunner`` (Typer's, stdout and stderr kept apart on every Click the pyproject allows) and ``run`` /
  ``exit_code`` / ``completed`` (``exl3tool ARGV`` through ``exl3tool.cli.main`` in this process, as the console
  script runs it, without a fresh interpreter's torch import: the process boundary has its own tests);
* ``make_encoded``, ``fake_encode`` and ``fake_warm``: tensors of the right shapes, deterministic in a seed, and the
  real ``warm()`` with that fake encoder (plan, pipeline and store are real; a re-encode writes the same bytes);
* ``server_lookup``, ``server_model_identity``, ``server_encoder_identity``: the server's look-up and identities
  written from docs/cache-format.md (§2, §4, §5.3) with json, hashlib, pathlib and safetensors' numpy reader
  only, never exl3tool's code, so they catch our library's mistakes; ``tree`` snapshots a folder;
* ``server_online_lookups`` and ``server_tp_load``: which layers of a checkpoint the fork encodes online, and which
  stored ones its loader fails to slice at a TP size, from the fork's storage and slicing rules.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import json
import math
import os
import zlib
from pathlib import Path
from typing import Any

import subprocess

import numpy as np
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner as _TyperRunner

from exl3tool.format.encoded import EncodedLinear
from exl3tool.plan import ServerRequest
from exl3tool.operations.warm import warm

# --- running exl3tool --------------------------------------------------------------------------------------------

# Click 8.2+ always keeps stdout and stderr apart; Click 8.1 (typer 0.15 with an external Click) mixes them unless asked.
_SEPARATE = {"mix_stderr": False} if "mix_stderr" in inspect.signature(_TyperRunner.__init__).parameters else {}


class CliRunner(_TyperRunner):
    def __init__(self, **kwargs) -> None:
        super().__init__(**{**_SEPARATE, **kwargs})


def exit_code(argv: list) -> int:
    """``exl3tool ARGV`` in this process (``exl3tool.cli.main``, as the console script runs it): its exit code."""
    from exl3tool.cli import main

    with pytest.raises(SystemExit) as exited:
        main([str(a) for a in argv])
        raise SystemExit(0)
    return exited.value.code or 0


def run(argv: list, capsys) -> tuple[int, str, str]:
    """``exl3tool ARGV`` in this process: (exit code, stdout, stderr), read through pytest's ``capsys``."""
    code = exit_code(argv)
    out, err = capsys.readouterr()
    return code, out, err


def completed(argv: list, env: dict | None = None) -> subprocess.CompletedProcess:
    """``exl3tool ARGV`` in this process, reported as ``subprocess.run(..., capture_output=True, text=True)`` would:
    exit code, stdout and stderr as text. ``env`` replaces the environment for the call (as ``subprocess.run``'s
    does); it is restored afterwards."""
    from exl3tool.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([str(a) for a in argv])
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["exl3tool", *map(str, argv)], code, out.getvalue(), err.getvalue())


# --- the encoder's outputs without an encode ---------------------------------------------------------------------

MODEL_ID = "c9ab4d59bf201df6de4427b12737f002314d556466aa257ac9767010c612fa95"
ENCODER_ID = "fe5e6fead00d1b22502edfa1da021d26132cb231d96346f10e51ead3eedc8326"


def make_encoded(k: int = 128, n: int = 256, bits: int = 6, seed: int = 0, proxy_error: float = 0.125) -> EncodedLinear:
    """Random but finite tensors of the right shapes; deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-32768, 32767, (k // 16, n // 16, 16 * bits), generator=g, dtype=torch.int32).to(torch.int16)
    suh = (torch.rand(k, generator=g) * 2 - 1).to(torch.float16)
    svh = (torch.rand(n, generator=g) * 2 - 1).to(torch.float16)
    return EncodedLinear(trellis=trellis, suh=suh, svh=svh, proxy_error=proxy_error, g_scale=1.0, bits=bits)


# --- the constants the tests share (a file that needs another value keeps its own and says why) -----------------

TINY = dict(hidden=256, heads=4, kv_heads=2, intermediate=512, layers=2, vocab=512)  # the tiny Llama
TINY_1 = {**TINY, "layers": 1}  # the tiny Llama with one decoder layer: half the jobs
TINY_REPO = "test-org/tiny-llama"  # its Hub repository id (write_llama_checkpoint's default)
ENC = dict(encoder_root="/encoders/exllamav3", encoder_revision="test-rev")  # ServerRequest's encoder settings
ENC_ARGS = ["--encoder-root", ENC["encoder_root"], "--encoder-revision", ENC["encoder_revision"]]  # the same as flags
LAUNCH_ENC = ("/opt/exllamav3", "v0.0.18")  # (root, revision): the server's encoder, as tests/data/launches name it
LINEAR = '{"linear": "mxfp8"}'  # the server's --quantization-config overlays: dense layers only,
LINEAR_WEIGHT = '{"linear": {"weight": "mxfp8"}}'  # the same in the long form,
BOTH = '{"linear": "mxfp8", "shared_experts": "mxfp8"}'  # and dense layers with the shared experts



def fake_encode(weight, bits, seed, device, progress=None):
    k, n = weight.shape
    g = torch.Generator().manual_seed(seed)
    return EncodedLinear(torch.randint(-32768, 32767, (k // 16, n // 16, 16 * bits), generator=g,
                                       dtype=torch.int32).to(torch.int16),
                         (torch.rand(k, generator=g) + 0.5).half(), (torch.rand(n, generator=g) + 0.5).half(), 0.1, 1.0,
                         bits)


def warm_one_layer(base: Path, layer: str, seed: int) -> tuple[Path, Path]:
    """A one-shard tiny Llama under ``base`` with ``layer`` really encoded (CPU) at TP 2: (model, cache)."""
    from exl3tool.checkpoint import write_llama_checkpoint

    model = write_llama_checkpoint(base / "model", **TINY, seed=seed, shards=1)
    summary = warm(ServerRequest(model=str(model), tp_sizes=(2,), layers=(layer,), cache_dir=str(base / "cache"),
                               device="cpu", **ENC))
    assert summary.counts["encoded"] == 2
    return model, base / "cache"


def refuse_encodes(monkeypatch) -> None:
    """Any encode fails the test: the command must stop before encoding."""
    import exl3tool.encode as enc

    def refuse(*a, **k):
        raise AssertionError("an encode ran")

    monkeypatch.setattr(enc, "encode_linear", refuse)


def fake_warm(request: ServerRequest, monkeypatch, calls: list | None = None):
    """``warm(request)`` with ``fake_encode``; ``calls`` collects the (in, out) shape of every encode."""
    import exl3tool.operations.warm.run as req

    real = getattr(req.run_plan, "__wrapped__", req.run_plan)  # the real one, also on a second call in one test

    def encode(weight, bits, seed, device, progress=None):
        if calls is not None:
            calls.append((seed, tuple(weight.shape)))
        return fake_encode(weight, bits, seed, device)

    def run_plan(*args, **kwargs):
        kwargs["encode"] = encode
        return real(*args, **kwargs)

    run_plan.__wrapped__ = real
    monkeypatch.setattr(req, "run_plan", run_plan)
    return warm(request)


# --- the server, written from the spec (no exl3tool code) ---------------------------------------------------


def server_key_json(model_identity, encoder_identity, prefix, bits, world, rank, k, n) -> str:
    key = {
        "model_identity": model_identity,
        "encoder_identity": encoder_identity,
        "prefix": prefix,
        "bits": bits,
        "seed": zlib.crc32(prefix.encode("utf-8")) & 0x7FFFFFFF,
        "tp_world_size": world,
        "tp_rank": rank,
        "input_size": k,
        "output_size": n,
        "codebook": "mcg",
        "apply_out_scales": True,
        "schema": 1,
    }
    return json.dumps(key, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def server_path(root, model_identity, world, rank, key_json) -> Path:
    digest = hashlib.sha256(key_json.encode("utf-8")).hexdigest()
    return Path(root) / "v1" / model_identity[:20] / f"tp{world}-rank{rank}" / f"{digest}.safetensors"


def server_lookup(root, model_identity, encoder_identity, prefix, bits, world, rank, k, n):
    """The server's unlocked path, re-implemented: returns (tensors, proxy_error) on a hit, else None."""
    key_json = server_key_json(model_identity, encoder_identity, prefix, bits, world, rank, k, n)
    path = server_path(root, model_identity, world, rank, key_json)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="np") as fh:
            meta = fh.metadata() or {}
            if meta.get("cache_key") != key_json:
                return None
            if set(fh.keys()) != {"trellis", "suh", "svh"}:
                return None
            t = {name: fh.get_tensor(name) for name in fh.keys()}
    except Exception:
        return None
    want = {"trellis": (np.int16, (k // 16, n // 16, 16 * bits)), "suh": (np.float16, (k,)), "svh": (np.float16, (n,))}
    for name, (dtype, shape) in want.items():
        if t[name].dtype != dtype or t[name].shape != shape:
            return None
    if not (np.isfinite(t["suh"]).all() and np.isfinite(t["svh"]).all()):
        return None
    pe = meta.get("proxy_error", "")
    if pe != "":
        try:
            pe = float(pe)
        except ValueError:
            return None
        if not math.isfinite(pe):
            return None
    else:
        pe = None
    return t, pe


def tree(root) -> dict[str, tuple]:
    """Every path under ``root`` with its type, mode, size, mtime and content hash (files)."""
    out = {}
    root = Path(root)
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else None
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


def server_model_identity(model_name: str, revision: str | None = None, commit_hash: str | None = None) -> str:
    """The server's model identity (docs/cache-format.md §2.4), re-implemented with pathlib as the serving process runs it.

    Run it on the *server's* tree: paths, links, sizes and mtimes are read from the filesystem here.
    """
    rev = commit_hash or revision
    p = Path(model_name).expanduser()
    if not p.exists():
        assert rev, "the server fails closed without a revision"
        payload = {"kind": "hub", "model": model_name, "revision": rev}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    p = p.resolve()
    if p.is_file():
        st = p.stat()
        payload = {"kind": "file", "path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        if st.st_size <= 16 * 1024 * 1024:
            payload["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    markers = []
    for name in ("config.json", "quantization_config.json", "model.safetensors.index.json",
                 "pytorch_model.bin.index.json", "tier_bitmap.json"):
        if (p / name).is_file():
            markers.append((name, hashlib.sha256((p / name).read_bytes()).hexdigest()))
    shards = []
    for pattern in ("*.safetensors", "*.bin", "*.gguf"):
        for shard in sorted(p.glob(pattern)):
            target = shard.resolve()
            st = target.stat()
            shards.append((shard.name, str(target), st.st_size, st.st_mtime_ns))
    payload = {"kind": "directory", "path": str(p), "revision": rev, "markers": markers, "shards": shards}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def transformers_commit_hash(model_path: str) -> str | None:
    """What transformers sets as ``_commit_hash`` for a local folder: a ``snapshots/<40-hex>/`` component."""
    import re

    m = re.search(r"snapshots/([^/]+)/", os.path.join(model_path, "config.json"))
    return m.group(1) if m and re.fullmatch(r"[0-9a-f]{40}", m.group(1)) else None


def server_encoder_identity(package_root: str, revision: str | None = None) -> str:
    """The server's encoder identity (docs/cache-format.md §2.5), with pathlib's ``rglob`` as the serving process runs it."""
    root = Path(package_root).expanduser().resolve()
    if revision and revision.strip():
        payload = {"root": str(root), "revision": revision.strip()}
    else:
        files = [(str(f.relative_to(root)), hashlib.sha256(f.read_bytes()).hexdigest())
                 for f in sorted(root.rglob("*.py")) if f.is_file()]
        assert files, "the server refuses an encoder source without .py files"
        payload = {"root": str(root), "files": files}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# --- the fork's view of a stored EXL3 layer, from docs/layer-plan.md §2 and docs/hydrate.md (no exl3tool code) ---

MCG_MARKER = -877912083  # 0xCBAC1FED as int32: the fork checks the stored mcg sentinel's value


def fork_spellings(prefix: str) -> list[str]:
    """The names the fork tries for ``prefix`` in tensor_storage: itself, ``model.`` toggled, and every ``model`` /
    ``language_model`` segment collapsed (each also with ``model.`` added or removed)."""
    out = [prefix, prefix[len("model."):] if prefix.startswith("model.") else "model." + prefix]
    parts = prefix.split(".")
    for removable in ("model", "language_model"):
        for i in range(len(parts) - 1):
            if parts[i] == removable:
                collapsed = ".".join(parts[:i] + parts[i + 1:])
                out += [collapsed, "model." + collapsed]
                if collapsed.startswith("model."):
                    out.append(collapsed[len("model."):])
    return list(dict.fromkeys(out))


def _checkpoint_tensors(root: Path) -> dict[str, np.ndarray]:
    """Every tensor but BF16 ones (numpy has no bfloat16; the EXL3 tensors are int16, fp16 and int32)."""
    tensors: dict[str, np.ndarray] = {}
    for shard in sorted(Path(root).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                if t.dtype != torch.bfloat16:
                    tensors[name] = t.numpy()
    return tensors


def server_online_lookups(root, modules: dict[str, tuple[str, ...]]) -> list[str]:
    """Of ``modules`` (vLLM prefix -> its packed source leaves; () for an unfused module), the ones a server of the
    checkpoint at ``root`` encodes online: those not stored as EXL3. A module is stored when every source has an
    ``exl3`` record under one of its spellings whose trellis / suh / svh / mcg tensors are in the shards with the
    fork's dtypes, shapes and mcg sentinel; a record without its tensors fails the test (the server would not load)."""
    root = Path(root)
    qc_file = root / "quantization_config.json"
    storage = json.loads(qc_file.read_text()).get("tensor_storage", {}) if qc_file.is_file() else {}
    inline = json.loads((root / "config.json").read_text()).get("quantization_config", {}).get("tensor_storage")
    storage = inline or storage
    tensors = _checkpoint_tensors(root)
    online = []
    for prefix, leaves in modules.items():
        base = prefix.rsplit(".", 1)[0]
        sources = [f"{base}.{leaf}" for leaf in leaves] or [prefix]
        records = [next((storage[s] for s in fork_spellings(src) if s in storage), None) for src in sources]
        stored = [r is not None and r.get("quant_format") == "exl3" for r in records]
        assert all(stored) or not any(stored), f"{prefix}: partly stored, the server refuses the checkpoint"
        if not all(stored):
            online.append(prefix)
            continue
        for rec in records:
            names = {n.rsplit(".", 1)[-1]: n for n in rec["stored_tensors"]}
            assert {"trellis", "suh", "svh", "mcg"} <= set(names), f"{prefix}: record {sorted(names)}"
            tr, suh, svh, mcg = (tensors[names[s]] for s in ("trellis", "suh", "svh", "mcg"))
            assert tr.dtype == np.int16 and tr.ndim == 3 and tr.shape[2] % 16 == 0
            assert suh.dtype == np.float16 and suh.shape == (tr.shape[0] * 16,) and (tr.shape[0] * 16) % 128 == 0
            assert svh.dtype == np.float16 and svh.shape == (tr.shape[1] * 16,) and (tr.shape[1] * 16) % 128 == 0
            assert mcg.dtype == np.int32 and mcg.size == 1 and int(mcg.reshape(())) == MCG_MARKER
    return online


def served_linear(style: str, in_features: int, parts: tuple[int, ...] = (), leaves: tuple[str, ...] = (),
                  shards: tuple[tuple[int, ...], ...] = (), kv_heads: int = 0) -> dict:
    """One linear module as the server builds it, for ``server_tp_load``: its parallel style ("row", "column",
    "qkv"), full input width, full output rows of each part (vLLM's ``output_sizes``), the packed source leaves
    (() unfused) and which parts each source holds (the fork's shard ids: one part each, or ``in_proj_qkvz``'s
    ``(0, 1, 2)``), and for "qkv" the KV head count (ranks beyond it replicate k and v)."""
    return {"style": style, "in": in_features, "parts": parts, "leaves": leaves,
            "shards": shards or tuple((j,) for j in range(max(1, len(parts)))), "kv": kv_heads}


def served_experts(intermediate: int) -> dict:
    """A layer's routed experts as the server builds them (``FusedMoE``), for ``server_tp_load``: the prefix is the
    checkpoint's ``...mlp.experts`` (expert ``e``'s projections under ``.{e}.gate_proj``), ``intermediate`` vLLM's
    ``intermediate_size`` (each rank gets ``intermediate / W``)."""
    return {"style": "experts", "intermediate": intermediate}


def server_tp_load(root, modules: dict[str, dict], tp: int) -> dict[str, str]:
    """Of ``modules`` (vLLM prefix -> ``served_linear``, or a checkpoint's experts prefix -> ``served_experts``), the
    ones stored as EXL3 in the checkpoint at ``root`` that a server at TP ``tp`` fails to load, each with the error
    the fork raises, written from the fork's ``Exl3LinearMethod._shard_tensors_for_tensor_parallel`` and
    ``Exl3MoEMethod._shard_tensors_for_tensor_parallel`` (exl3.py, docs/hydrate.md rule 5), not exl3tool's code:
    every rank narrows a row-parallel module's input at ``rank * K/W`` and a column-parallel source's part at
    ``shard_rank * size`` (k, v: ``rank // replicas``; a source holding several parts: its part's offset plus
    ``rank * size``), every routed expert's intermediate rows at ``rank * I/W``, each start and size a multiple of
    128, ranks in order. Modules not stored load as in SOURCE."""
    root = Path(root)
    qc_file = root / "quantization_config.json"
    storage = json.loads(qc_file.read_text()).get("tensor_storage", {}) if qc_file.is_file() else {}
    storage = json.loads((root / "config.json").read_text()).get("quantization_config", {}).get("tensor_storage") or storage
    tensors = _checkpoint_tensors(root)
    failed: dict[str, str] = {}
    for prefix, m in modules.items():
        if m["style"] == "experts":  # Exl3MoEMethod._shard_tensors_for_tensor_parallel: every expert at rank * I/W
            stored = [next((storage[s] for s in fork_spellings(f"{prefix}.0.{p}") if s in storage), None)
                      for p in ("gate_proj", "up_proj", "down_proj")]
            if tp == 1 or not all(r is not None and r.get("quant_format") == "exl3" for r in stored):
                continue
            size = m["intermediate"] // tp
            bad = [(r * size, size) for r in range(tp) if (r * size) % 128 or size % 128]
            if bad:
                failed[prefix] = f"EXL3 TP output slice must be 128-aligned, got start={bad[0][0]}, size={bad[0][1]}"
            continue
        base = prefix.rsplit(".", 1)[0]
        sources = [f"{base}.{leaf}" for leaf in m["leaves"]] or [prefix]
        records = [next((storage[s] for s in fork_spellings(src) if s in storage), None) for src in sources]
        if not all(r is not None and r.get("quant_format") == "exl3" for r in records):
            continue
        shapes = []
        for rec in records:
            name = next(n for n in rec["stored_tensors"] if n.endswith(".trellis"))
            tr = tensors[name]
            shapes.append((tr.shape[0] * 16, tr.shape[1] * 16))  # full K, N as stored
        assert all(k == m["in"] for k, _ in shapes), (prefix, shapes)
        if tp == 1:
            continue
        if m["style"] == "row":
            size = m["in"] // tp
            bad = [(r * size, size) for r in range(tp) if (r * size) % 128 or size % 128]
            if bad:
                failed[prefix] = f"EXL3 TP input slice must be 128-aligned, got start={bad[0][0]}, size={bad[0][1]}"
            continue
        if m["style"] == "qkv":
            head_dim = m["parts"][1] // m["kv"]
            kv_r = max(1, m["kv"] // tp) * head_dim
            local = (m["parts"][0] // tp, kv_r, kv_r)
            replicas = max(1, tp // m["kv"])
        else:
            local, replicas = tuple(n // tp for n in m["parts"]), 1
        for r in range(tp):
            for (_, n_full), group in zip(shapes, m["shards"]):
                offset = 0
                for j in group:
                    size = local[j]
                    rank = r // replicas if m["style"] == "qkv" and j in (1, 2) else r
                    start = (offset if len(group) > 1 else 0) + rank * size
                    offset += m["parts"][j]
                    if start + size > n_full:
                        failed.setdefault(prefix, f"start ({start}) + length ({size}) exceeds dimension size ({n_full}).")
                    elif start % 128 or size % 128:
                        failed.setdefault(prefix, f"EXL3 TP output slice must be 128-aligned, got start={start}, "
                                                  f"size={size}")
    return failed


def spec_dequantize(trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray, bits: int) -> np.ndarray:
    """An MCG-codebook EXL3 layer's (in, out) weight in float64, decoded with numpy from the format spec as
    restated in docs/format.md (§4.3 words, §4.5 state extraction, §3.3 MCG, §5.2 positions,
    §1.4 W = diag(suh) B_k Q B_n diag(svh)); no exl3tool code."""
    k_bits = bits
    tk, tn, width = trellis.shape
    assert width == 16 * k_bits
    t16 = trellis.reshape(tk * tn, width).view(np.uint16).astype(np.uint64)
    words = t16[:, 0::2] | (t16[:, 1::2] << np.uint64(16))  # U[m] = T[2m] | T[2m+1] << 16
    nw = 8 * k_bits
    i = np.arange(256)
    b0 = i * k_bits + k_bits - 16 + 256 * k_bits
    b1 = b0 + 16
    w0, w1 = (b0 // 32) % nw, ((b1 - 1) // 32) % nw
    shift = (32 * ((b1 - 1) // 32 + 1) - b1).astype(np.uint64)
    states = (((words[:, w0] << np.uint64(32)) | words[:, w1]) >> shift) & np.uint64(0xFFFF)
    x = (states * np.uint64(0xCBAC1FED)) & np.uint64(0xFFFFFFFF)
    x = (x & np.uint64(0x8FFF8FFF)) ^ np.uint64(0x3B603B60)
    lo = (x & np.uint64(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (x >> np.uint64(16)).astype(np.uint16).view(np.float16).astype(np.float64)
    values = (lo + hi).astype(np.float16).astype(np.float64).reshape(tk, tn, 256)
    p = np.arange(256)
    t, j = p // 8, p % 8
    row, col = 2 * (t % 4) + (j & 1) + 8 * ((j >> 1) & 1), t // 4 + 8 * (j >> 2)
    q = np.zeros((tk, 16, tn, 16))
    q[:, row, :, col] = values.transpose(2, 0, 1)  # (256, tk, tn) -> the (row, col) of each position
    q = q.reshape(tk * 16, tn * 16)
    h = np.array([[(-1) ** bin(a & b).count("1") for b in range(128)] for a in range(128)], dtype=np.float64)
    hn = h / np.sqrt(128.0)
    k, n = q.shape
    q = np.einsum("ab,ibn->ian", hn, q.reshape(k // 128, 128, n)).reshape(k, n)  # B_k Q
    q = np.einsum("kjb,bc->kjc", q.reshape(k, n // 128, 128), hn).reshape(k, n)  # (B_k Q) B_n
    return suh.astype(np.float64)[:, None] * q * svh.astype(np.float64)[None, :]
# The fork's releases, independently of exl3tool.releases: which version of exl3_online_cache.py each ships
# (blackwell-llm-docker patches/releases/<release>/vllm/integration.patch): "older" (Gilded Gnosis r20..r33),
# "newer" (Gilded Gnosis r34, Infernal Invocation r5..r18).
def server_cache_module(release: str) -> str:
    line, _, n = release.rpartition("-r")
    if line == "gilded-gnosis":
        return "newer" if int(n) >= 34 else "older"
    assert line == "infernal-invocation" and int(n) >= 5, release
    return "newer"


def server_cache_root(environ: dict, module: str = "newer") -> Path:
    """The server's cache root (docs/cache-format.md §1.4) written from the two versions of its cache module, with
    ``os.path.expanduser`` under ``environ``'s HOME: the older reads ``VLLM_CACHE_ROOT`` or a literal
    ``~/.cache/vllm`` (``XDG_CACHE_HOME`` never), the newer vLLM's ``envs.VLLM_CACHE_ROOT``."""
    def expand(p: str) -> str:
        if p == "~" or p.startswith("~/"):
            return environ.get("HOME", os.path.expanduser("~")) + p[1:]
        return p

    configured = environ.get("VLLM_EXL3_ONLINE_CACHE_DIR")
    if configured and configured.strip():
        return Path(expand(configured))
    if module == "older":
        return Path(expand(environ.get("VLLM_CACHE_ROOT", "~/.cache/vllm"))) / "exl3_online"
    base = environ.get("XDG_CACHE_HOME", os.path.join(expand("~"), ".cache"))
    return Path(expand(environ.get("VLLM_CACHE_ROOT", os.path.join(base, "vllm")))) / "exl3_online"


@contextlib.contextmanager
def viterbi_memo():
    """The CPU Viterbi (numba) remembered by its exact inputs, for tests that encode the same weight twice to show
    that something else (torch's thread count, the pipeline's overlap, the fork's call) changes no byte: a later
    encode reuses the states of an earlier call whose inputs were the same bits, and runs the kernel wherever they
    differ, so the test fails exactly as without it (the kernel is a function of its inputs; its own results:
    tests/encode/test_viterbi.py). Not for tests about the kernel's threads or concurrency. Yields the counts
    {"hit": n, "miss": n}."""
    import exl3tool.kernels.viterbi_numba as vn

    real = vn.quantize_tiles_numba
    seen: dict[tuple, Any] = {}
    counts = {"hit": 0, "miss": 0}

    def memo(tiles, bits, table, *args, **kwargs):
        key = (bits, tiles.dtype.str, tiles.shape, hashlib.blake2b(tiles.tobytes()).digest(),
               hashlib.blake2b(table.tobytes()).digest(), args, tuple(sorted(kwargs.items())))
        if key in seen:
            counts["hit"] += 1
        else:
            counts["miss"] += 1
            seen[key] = real(tiles, bits, table, *args, **kwargs)
        return seen[key].copy()

    vn.quantize_tiles_numba = memo
    try:
        yield counts
    finally:
        vn.quantize_tiles_numba = real
