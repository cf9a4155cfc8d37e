"""What the tests share: running exl3tool, tensors and entries without an encode, and an independent server.

* ``CliRunner`` (Typer's, stdout and stderr kept apart on every Click the pyproject allows) and ``run`` /
  ``exit_code`` / ``completed`` (``exl3tool ARGV`` through ``exl3tool.cli.main`` in this process, as the console
  script runs it, without a fresh interpreter's torch import: the process boundary has its own tests);
* ``make_encoded``, ``fake_encode`` and ``fake_warm``: tensors of the right shapes, deterministic in a seed, and the
  real ``warm()`` with that fake encoder (plan, pipeline and store are real; a re-encode writes the same bytes);
* ``server_lookup``, ``server_model_identity``, ``server_encoder_identity``: the server's look-up and identities
  written from docs/cache-format.md (§2, §4, §5.3) with json, hashlib, pathlib and safetensors' numpy reader
  only, never exl3tool's code, so they catch our library's mistakes; ``tree`` snapshots a folder.
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

import subprocess

import numpy as np
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner as _TyperRunner

from exl3tool.format.encoded import EncodedLinear
from exl3tool.plan import WarmRequest
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
ENC = dict(encoder_root="/encoders/exllamav3", encoder_revision="test-rev")  # WarmRequest's encoder settings
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
    summary = warm(WarmRequest(model=str(model), tp_sizes=(2,), layers=(layer,), cache_dir=str(base / "cache"),
                               device="cpu", **ENC))
    assert summary.counts["encoded"] == 2
    return model, base / "cache"


def refuse_encodes(monkeypatch) -> None:
    """Any encode fails the test: the command must stop before encoding."""
    import exl3tool.encode as enc

    def refuse(*a, **k):
        raise AssertionError("an encode ran")

    monkeypatch.setattr(enc, "encode_linear", refuse)


def fake_warm(request: WarmRequest, monkeypatch, calls: list | None = None):
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
