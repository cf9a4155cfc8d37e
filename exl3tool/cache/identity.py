"""Model and encoder identities exactly as the server derives them (spec §2.4, §2.5, §3).

The identities are hashes of JSON payloads whose separators differ by kind (Hub and single-file
payloads use ``json.dumps`` defaults, directory and encoder payloads are compact). A difference of one
byte means every server look-up misses, so each function returns the exact payload it hashed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from exl3tool.cache.hub import resolve_hub_revision
from exl3tool.errors import ConfigError, InputError

__all__ = [
    "ModelIdentity",
    "EncoderIdentity",
    "EncoderSettings",
    "resolve_model_identity",
    "resolve_encoder_identity",
    "encoder_settings",
    "model_payload_digest",
    "MARKER_FILES",
    "SHARD_SUFFIXES",
    "FILE_HASH_LIMIT",
]

MARKER_FILES = (
    "config.json",
    "quantization_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "tier_bitmap.json",
)
SHARD_SUFFIXES = (".safetensors", ".bin", ".gguf")
FILE_HASH_LIMIT = 16 * 1024 * 1024  # single-file checkpoints up to 16 MiB (inclusive) are content-hashed
_SNAPSHOT = re.compile(r"snapshots/([^/]+)/")
_FULL_HASH = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class ModelIdentity:
    """``identity`` = sha256 of ``payload``; ``kind`` hub|file|directory; ``derivation`` says how, for people."""

    identity: str
    kind: str
    payload: str
    revision: str | None
    derivation: str


@dataclass(frozen=True)
class EncoderIdentity:
    """``identity`` = sha256 of ``payload``; ``mode`` is ``revision`` or ``files``."""

    identity: str
    mode: str
    payload: str
    root: str


@dataclass(frozen=True)
class EncoderSettings:
    """The encoder root and revision the server will see, and where they came from."""

    root: str
    revision: str | None
    source: str


def _sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _default_json(payload: dict) -> str:
    return json.dumps(payload, sort_keys=True)  # ", " and ": " separators, ASCII escaping


def _compact_json(payload: dict) -> str:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"))


def model_payload_digest(payload: str) -> str:
    """The identity of a payload string (sha256 of its UTF-8 bytes)."""
    return _sha256_hex(payload.encode("utf-8"))


def _snapshot_hash(path: str) -> str | None:
    """transformers sets ``_commit_hash`` from a ``snapshots/<40-hex>/`` component of the config path."""
    match = _SNAPSHOT.search(os.path.join(path, "config.json"))
    if match and _FULL_HASH.match(match.group(1)):
        return match.group(1)
    return None


def _server_string(local: str, local_root: str, server_root: str | None) -> str:
    """``local`` as the server sees it: re-rooted under ``server_root`` when it lies inside ``local_root``."""
    if server_root is None:
        return local
    if local == local_root:
        return server_root
    if local.startswith(local_root.rstrip("/") + "/"):
        return server_root.rstrip("/") + "/" + os.path.relpath(local, local_root)
    return local


def _hub_identity(model: str, revision: str | None, commit_hash: str | None) -> ModelIdentity:
    if commit_hash:
        rev, how = commit_hash, "hf_config._commit_hash given by the caller (takes precedence over --revision)"
    else:
        resolved = resolve_hub_revision(model, revision)
        rev, how = resolved.sha, resolved.how
    payload = _default_json({"kind": "hub", "model": model, "revision": rev})
    return ModelIdentity(
        model_payload_digest(payload),
        "hub",
        payload,
        rev,
        f"'{model}' is not a local path, so it is a Hub repo id; revision {rev}: {how}.",
    )


def _file_identity(real: str, server: str) -> ModelIdentity:
    st = os.stat(real)
    payload_obj: dict = {"kind": "file", "path": server, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    hashed = st.st_size <= FILE_HASH_LIMIT
    if hashed:
        payload_obj["sha256"] = _file_sha256(real)
    payload = _default_json(payload_obj)
    return ModelIdentity(
        model_payload_digest(payload),
        "file",
        payload,
        None,
        f"single-file checkpoint {server}: path, size and mtime_ns"
        + (" plus its SHA-256 (16 MiB or smaller)." if hashed else " (larger than 16 MiB, so bytes are not hashed)."),
    )


def _directory_identity(real: str, server: str, rev: str | None, rev_how: str) -> ModelIdentity:
    markers = []
    for name in MARKER_FILES:
        path = os.path.join(real, name)
        if os.path.isfile(path):
            markers.append([name, _file_sha256(path)])
    names = os.listdir(real)
    shards = []
    for suffix in SHARD_SUFFIXES:
        for name in sorted(n for n in names if n.endswith(suffix)):  # hidden files and directories included
            target = os.path.realpath(os.path.join(real, name))
            try:
                st = os.stat(target)
            except OSError as exc:
                raise InputError(
                    f"{os.path.join(real, name)}: cannot stat shard ({exc.strerror}); the server would fail start-up too. "
                    "Fix or remove the broken file/link"
                ) from None
            shards.append([name, _server_string(target, real, server), st.st_size, st.st_mtime_ns])
    payload = _compact_json({"kind": "directory", "path": server, "revision": rev, "markers": markers, "shards": shards})
    return ModelIdentity(
        model_payload_digest(payload),
        "directory",
        payload,
        rev,
        f"local directory {server}: {len(markers)} marker file(s) hashed, {len(shards)} shard(s) by path, size and "
        f"mtime_ns (not content); revision {rev!r} ({rev_how}).",
    )


def resolve_model_identity(
    model: str,
    *,
    revision: str | None = None,
    server_path: str | None = None,
    commit_hash: str | None = None,
) -> ModelIdentity:
    """The server's ``model_identity`` for ``--model`` ``model`` (spec §2.4, revision precedence §3).

    A name that is not an existing path is a Hub repo id: its revision (default ``main``) is resolved to
    the full commit hash, as transformers' ``_commit_hash`` would be; ``commit_hash`` overrides it.
    A local checkpoint is identified by paths, sizes and ``st_mtime_ns`` *as the serving process sees
    them*: ``server_path`` is the server's absolute model path; shard targets inside the model directory
    are re-rooted under it. Caveat: sizes and mtimes are taken from our copy, so the copy must preserve
    mtimes (``cp -p``, ``rsync -t``) or the server computes a different identity and every look-up misses.
    """
    p = os.path.expanduser(model)
    if not os.path.exists(p):
        if server_path is not None:
            raise ConfigError(f"{model}: --server-path applies to a local checkpoint, but {model!r} does not exist here")
        return _hub_identity(model, revision, commit_hash)
    real = os.path.realpath(p)
    if server_path is not None:
        if not os.path.isabs(server_path):
            raise ConfigError(f"--server-path {server_path!r} must be absolute (the server's resolved model path)")
        server = os.path.normpath(server_path)
    else:
        server = real
    if os.path.isfile(real):
        return _file_identity(real, server)
    if commit_hash:
        rev, how = commit_hash, "hf_config._commit_hash given by the caller"
    elif _snapshot_hash(server_path if server_path is not None else p):
        rev, how = _snapshot_hash(server_path if server_path is not None else p), "the snapshots/<hash> folder name, as transformers sets _commit_hash"
    elif revision:
        rev, how = revision, "--revision as given"
    else:
        rev, how = None, "no commit hash and no --revision"
    return _directory_identity(real, server, rev, how)


def _walk_py_files(root: str) -> list[tuple[str, ...]]:
    """Relative component tuples of every ``*.py`` regular file under ``root``; symlinked dirs not descended.

    ``os.walk`` lists a symlink to a file among the files (kept) and a symlink to a directory among the
    directories (not descended): the same set as the server's ``rglob("*.py")`` filtered by ``is_file()``.
    """
    found = []
    for dirpath, _dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        parts = () if rel_dir == "." else tuple(rel_dir.split(os.sep))
        for name in filenames:
            if name.endswith(".py") and os.path.isfile(os.path.join(dirpath, name)):
                found.append(parts + (name,))
    return found


def resolve_encoder_identity(root: str, revision: str | None = None) -> EncoderIdentity:
    """The server's ``encoder_identity`` for ``VLLM_EXL3_ENCODER_SOURCE=root`` (spec §2.5).

    With a non-blank ``revision`` the payload is the resolved root string plus the stripped revision,
    and ``root`` need not exist here; the root string must still be the server's. Without one, every
    ``*.py`` file under ``root`` is hashed, ordered by path components.
    """
    real = os.path.realpath(os.path.expanduser(root))
    if revision is not None and revision.strip() != "":
        payload = _compact_json({"root": real, "revision": revision.strip()})
        return EncoderIdentity(model_payload_digest(payload), "revision", payload, real)
    if not os.path.isdir(real):
        what = "is not a directory" if os.path.exists(real) else "does not exist"
        raise ConfigError(f"EXL3 encoder source {real} {what} (its .py files are hashed: point --encoder-root or "
                          "VLLM_EXL3_ENCODER_SOURCE at the encoder's source, or pass --encoder-revision)")
    files = sorted(_walk_py_files(real))  # tuple order = component-wise order, as pathlib sorts
    if not files:
        raise ConfigError(f"EXL3 encoder source contains no Python files: {real} (pass --encoder-revision, or fix the root)")
    listing = [["/".join(parts), _file_sha256(os.path.join(real, *parts))] for parts in files]
    payload = _compact_json({"root": real, "files": listing})
    return EncoderIdentity(model_payload_digest(payload), "files", payload, real)


def encoder_settings(
    root: str | None = None, revision: str | None = None, environ: Mapping[str, str] | None = None
) -> EncoderSettings:
    """The encoder root/revision: explicit values first, then ``VLLM_EXL3_ENCODER_SOURCE`` / ``_REVISION``.

    Without a root there is no identity to compute (the server refuses to start too), so this raises
    instead of inventing one.
    """
    env = os.environ if environ is None else environ
    source = "options"
    if root is None or root.strip() == "":
        root = env.get("VLLM_EXL3_ENCODER_SOURCE")
        source = "environment"
        if root is None or root.strip() == "":
            raise ConfigError(
                "no encoder identity: pass --encoder-root (the server's VLLM_EXL3_ENCODER_SOURCE path) and "
                "--encoder-revision (its VLLM_EXL3_ENCODER_REVISION), or set VLLM_EXL3_ENCODER_SOURCE and "
                "VLLM_EXL3_ENCODER_REVISION"
            )
    if revision is None:
        revision = env.get("VLLM_EXL3_ENCODER_REVISION")
        if revision is not None and source == "options":
            source = "options and environment"
    return EncoderSettings(root=root, revision=revision, source=source)
