"""Model and encoder identities exactly as the server derives them (docs/cache-format.md §2.4, §2.5, §3).

The identities are hashes of JSON payloads whose separators differ by kind (Hub and single-file
payloads use ``json.dumps`` defaults, directory and encoder payloads are compact). A difference of one
byte means every server look-up misses, so each function returns the exact payload it hashed.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from huggingface_hub.utils import HFValidationError, validate_repo_id

from exl3tool.cache.hub import resolve_hub_revision
from exl3tool.cache.serverfs import ServerView, host_path, server_realpath
from exl3tool.errors import ConfigError, InputError
from exl3tool.text import plural

__all__ = [
    "ModelIdentity",
    "EncoderIdentity",
    "EncoderSettings",
    "encoder_json",
    "ServerIdentities",
    "server_identities",
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
_QUANTIZE_PY = ("modules", "quant", "exl3_lib", "quantize.py")  # what the server loads from the encoder source


@dataclass(frozen=True)
class ModelIdentity:
    """``identity`` = sha256 of ``payload``; ``kind`` hub|file|directory; ``derivation`` says how, for people."""

    identity: str
    kind: str
    payload: str
    revision: str | None
    derivation: str
    revision_from: str = ""  # hub-resolved | commit-hash | snapshot | option | none | n/a
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class EncoderIdentity:
    """``identity`` = sha256 of ``payload``; ``mode`` is ``revision`` or ``files``.

    ``root`` is the server's root string in the payload; ``files_from`` the local folder whose ``.py`` files were
    hashed (files mode; the same folder unless ``--encoder-source`` named a copy).
    """

    identity: str
    mode: str
    payload: str
    root: str
    files_from: str | None = None


@dataclass(frozen=True)
class EncoderSettings:
    """The encoder root and revision the server will see, where they came from, and the local copy to hash."""

    root: str
    revision: str | None
    source: str
    source_dir: str | None = None  # --encoder-source: hash this folder's .py files, key them with ``root``


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


def _hub_repo_folder(model_dir: str) -> str | None:
    """The repo folder (``models--org--name``) when ``model_dir`` is a Hub-cache ``snapshots/<name>`` folder."""
    parent = os.path.dirname(model_dir)
    return os.path.dirname(parent) if os.path.basename(parent) == "snapshots" else None


def _outside_shard_on_server(real: str, name: str, target: str, server: str) -> tuple[str, str | None]:
    """Where the server resolves shard ``name`` whose target lies outside our model folder ``real``, and a warning.

    A Hub-cache snapshot's shards are relative links into ``../../blobs/``: mounted elsewhere, they resolve
    beside the *server's* ``snapshots/`` folder, so the target is mapped there when the server's path is a
    snapshot folder too. Anything the server's filesystem decides and we cannot see is refused (ConfigError)
    with the two ways to make it knowable. Other links keep our absolute target, with a warning.
    """
    repo = _hub_repo_folder(real)
    if repo is None or not target.startswith(os.path.join(repo, "blobs") + os.sep):
        return target, (f"{name} links outside the model folder to {target}; the identity uses that path, so the "
                        f"server must see the shard at exactly {target} (or copy the checkpoint with the links "
                        "dereferenced and mtimes kept: cp -rL --preserve=timestamps)")
    link_path = os.path.join(real, name)
    link = os.readlink(link_path) if os.path.islink(link_path) else ""
    how = (f"mount the whole repo folder {os.path.basename(repo)} (blobs/ beside snapshots/) and pass --server-path "
           f"<mount>/snapshots/{os.path.basename(real)}, or copy the snapshot with its links dereferenced and mtimes "
           f"kept (cp -rL --preserve=timestamps {real} DEST) and warm DEST with --server-path")
    if not link or os.path.isabs(link) or os.path.normpath(os.path.join(real, link)) != target:
        why = f"an absolute link to {link}" if link and os.path.isabs(link) else f"a chain of links to {target}"
        raise ConfigError(f"{link_path}: this Hub-cache shard is {why}; the server resolves it in its own "
                          f"filesystem, which exl3tool cannot see from here. To warm for --server-path {server}: {how}")
    mapped = os.path.normpath(os.path.join(server, link))
    server_repo = _hub_repo_folder(server)
    if server_repo is None or not mapped.startswith(os.path.join(server_repo, "blobs") + os.sep):
        raise ConfigError(f"{link_path}: this Hub-cache shard is a link to {link}; with --server-path {server} "
                          f"(not a snapshots/<hash> folder) the server would look for it at {mapped}, outside any "
                          f"mounted repo folder, and fail to start. Either {how}")
    return mapped, None


def _hub_identity(model: str, revision: str | None, commit_hash: str | None,
                  environ: Mapping[str, str] | None = None, view: ServerView | None = None) -> ModelIdentity:
    if commit_hash:
        rev, how, src = commit_hash, "hf_config._commit_hash given by the caller (takes precedence over --revision)", "commit-hash"
    else:
        resolved = resolve_hub_revision(model, revision, environ=environ, view=view)
        rev, how, src = resolved.sha, resolved.how, "hub-resolved"
    payload = _default_json({"kind": "hub", "model": model, "revision": rev})
    return ModelIdentity(
        model_payload_digest(payload),
        "hub",
        payload,
        rev,
        f"'{model}' is not a local path, so it is a Hub repo id; revision {rev}: {how}.",
        src,
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
        "n/a",
    )


def _missing_index_shards(real: str) -> list[str]:
    """A warning per shard that model.safetensors.index.json names and the folder lacks (the server fails to load).

    The identity is still the server's (it hashes the shards present), but no server starts on this checkpoint;
    an index that cannot be read is left to the commands that read it.
    """
    try:
        with open(os.path.join(real, "model.safetensors.index.json"), encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map")
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(weight_map, dict):
        return []
    named = sorted({f for f in weight_map.values() if isinstance(f, str)})
    return [f"{os.path.join(real, f)}: shard named in model.safetensors.index.json is missing; the server would fail "
            "to load this checkpoint (and exl3tool cache warm / verify refuse it): download that file"
            for f in named if not os.path.isfile(os.path.join(real, f))]


def _in_view(view: ServerView | None, server: str, name: str) -> tuple[str, str]:
    """(the server's resolved path of ``server/name``, where that is here), resolved in the server's filesystem."""
    assert view is not None
    target = server_realpath(view, posixpath.join(server, name), "the model's file")
    return target, host_path(view, target, f"the model's file {posixpath.join(server, name)} resolves to")


def _directory_identity(real: str, server: str, rev: str | None, rev_how: str, rev_from: str,
                        view: ServerView | None = None) -> ModelIdentity:
    """``view`` given: ``server`` is the server's resolved path, every marker and shard is resolved in its
    filesystem (its links read through the view); else links are resolved here and re-rooted under ``server``."""
    markers = []
    for name in MARKER_FILES:
        path = _in_view(view, server, name)[1] if view is not None else os.path.join(real, name)
        if os.path.isfile(path):
            markers.append([name, _file_sha256(path)])
    names = os.listdir(real)
    shards = []
    warnings = []
    mapped = 0
    for suffix in SHARD_SUFFIXES:
        for name in sorted(n for n in names if n.endswith(suffix)):  # hidden files and directories included
            if view is not None:
                on_view, target = _in_view(view, server, name)
            else:
                target = os.path.realpath(os.path.join(real, name))
            try:
                st = os.stat(target)
            except OSError as exc:
                raise InputError(
                    f"{os.path.join(real, name)}: cannot stat shard ({exc.strerror}); the server would fail start-up too. "
                    "Fix or remove the broken file/link"
                ) from None
            on_server = on_view if view is not None else _server_string(target, real, server)
            if view is None and server != real and on_server == target and not target.startswith(real.rstrip("/") + "/"):
                on_server, warning = _outside_shard_on_server(real, name, target, server)
                mapped += warning is None
                if warning:
                    warnings.append(warning)
            shards.append([name, on_server, st.st_size, st.st_mtime_ns])
            if st.st_size == 0:  # hashed as the server hashes it, but a checkpoint shard is never empty
                warnings.append(f"{os.path.join(real, name)} is empty (0 bytes): surely a broken or unfinished copy; "
                                "the server hashes it as it is, and cannot load the model from it: copy the shard "
                                "again (cp -p / rsync -t) before warming")
    warnings += _missing_index_shards(real)
    payload = _compact_json({"kind": "directory", "path": server, "revision": rev, "markers": markers, "shards": shards})
    blobs = f"; {plural(mapped, 'Hub-cache blob link')} mapped beside the server's snapshots/ folder" if mapped else ""
    return ModelIdentity(
        model_payload_digest(payload),
        "directory",
        payload,
        rev,
        f"local directory {server}: {plural(len(markers), 'marker file')} hashed, {plural(len(shards), 'shard')} by path, size and "
        f"mtime_ns (not content){blobs}; " + (f"revision {rev!r}" if rev is not None else "no revision") + f" ({rev_how}).",
        rev_from,
        tuple(warnings),
    )


def resolve_model_identity(
    model: str,
    *,
    revision: str | None = None,
    server_path: str | None = None,
    commit_hash: str | None = None,
    view: ServerView | None = None,
    environ: Mapping[str, str] | None = None,
) -> ModelIdentity:
    """The server's ``model_identity`` for ``--model`` ``model`` (docs/cache-format.md §2.4, revision precedence §3).

    ``view`` (a launch's filesystem map): ``server_path`` is the model path exactly as the server holds it (after
    vLLM's HF_HUB_OFFLINE rewrite), resolved here in the server's filesystem, links read through its mounts;
    ``environ`` is the server's environment, whose Hub cache answers a Hub revision offline.

    A name that is not an existing path is a Hub repo id: its revision (default ``main``) is resolved to
    the full commit hash, as transformers' ``_commit_hash`` would be; ``commit_hash`` overrides it.
    A local checkpoint is identified by paths, sizes and ``st_mtime_ns`` *as the serving process sees
    them*: ``server_path`` is the server's absolute model path; shard targets inside the model directory
    are re-rooted under it, and a Hub-cache snapshot's links into ``../../blobs/`` are mapped beside the
    server's ``snapshots/`` folder (or refused when the server's path is not one). Caveat: sizes and mtimes
    are taken from our copy, so the copy must preserve mtimes (``cp -p``, ``rsync -t``) or the server
    computes a different identity and every look-up misses. Commands call ``server_identities``.
    """
    if view is not None and server_path is not None:
        return _model_in_view(server_path, view, revision, commit_hash)
    p = os.path.expanduser(model)
    if not os.path.exists(p):
        if server_path is not None:
            raise ConfigError(f"MODEL {model!r} does not exist here: it is the local copy of the checkpoint the server "
                              f"serves as {server_path}; give the path of that copy (or a Hub repo id)")
        try:
            validate_repo_id(model)
        except HFValidationError:
            raise InputError(f"{model!r}: no such local path, and not a valid Hub repo id (expected 'org/name')") from None
        return _hub_identity(model, revision, commit_hash, environ if view is not None else None, view)
    real = os.path.realpath(p)
    if server_path is not None:
        if not os.path.isabs(server_path):
            raise ConfigError(f"--server-path {server_path!r} must be absolute (the server's resolved model path)")
        server = os.path.normpath(server_path)
    else:
        server = real
    if os.path.isfile(real):
        return _file_identity(real, server)
    return _directory_identity(real, server, *_local_revision(server_path if server_path is not None else p,
                                                               revision, commit_hash))


def _local_revision(given: str, revision: str | None, commit_hash: str | None) -> tuple[str | None, str, str]:
    """(revision, how, source) of a local checkpoint: transformers' ``_commit_hash`` is taken from the path as
    vLLM holds it (``given``, before any link is resolved), then ``--revision``."""
    snapshot = _snapshot_hash(given)
    if commit_hash:
        return commit_hash, "hf_config._commit_hash given by the caller", "commit-hash"
    if snapshot:
        return snapshot, "the snapshots/<hash> folder name of the server's path, as transformers sets _commit_hash", "snapshot"
    if revision:
        return revision, "--revision as given", "option"
    return None, "no commit hash and no --revision", "none"


def _model_in_view(given: str, view: ServerView, revision: str | None, commit_hash: str | None) -> ModelIdentity:
    """The identity of the server's model path ``given``, resolved in the server's filesystem (``view``)."""
    resolved = server_realpath(view, given, "the model")
    here = host_path(view, resolved, f"the model {given} resolves to")
    if not os.path.exists(here):
        raise ConfigError(f"the model {given} (in the server's filesystem {resolved}, here {here}) does not exist: "
                          "the server could not load it; fix the path or the mounts")
    mid = _file_identity(here, resolved) if os.path.isfile(here) else _directory_identity(
        here, resolved, *_local_revision(given, revision, commit_hash), view=view)
    if resolved != posixpath.normpath(given):
        mid = replace(mid, derivation=f"{given} resolves in the server's filesystem to {resolved} (the server keys "
                                      f"the resolved path); {mid.derivation}")
    return mid


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


def resolve_encoder_identity(root: str, revision: str | None = None, *, source: str | None = None,
                             view: ServerView | None = None) -> EncoderIdentity:
    """The server's ``encoder_identity`` for ``VLLM_EXL3_ENCODER_SOURCE=root`` (docs/cache-format.md §2.5).

    With a non-blank ``revision`` the payload is the resolved root string plus the stripped revision,
    and ``root`` need not exist here; the root string must still be the server's. Without one, every
    ``*.py`` file is hashed, ordered by path components: the files of ``source`` (a local copy of the
    server's encoder, e.g. an installed exllamav3 package) when given, else those under ``root``; the
    payload always names ``root``, resolved as the server resolves it: in ``view`` (a launch's filesystem: its
    links read there, never this machine's; a folder inside the image taken as written) when given.

    >>> resolve_encoder_identity("/opt/exllamav3", source="venv/lib/python3.12/site-packages/exllamav3")  # doctest: +SKIP
    """
    if view is not None and posixpath.isabs(root):  # a launch's server: the root resolves in its own filesystem
        real = server_realpath(view, root, "VLLM_EXL3_ENCODER_SOURCE", unseen="keep")
    else:
        real = os.path.realpath(os.path.expanduser(root))
    if revision is not None and revision.strip() != "":
        payload = _compact_json({"root": real, "revision": revision.strip()})
        return EncoderIdentity(model_payload_digest(payload), "revision", payload, real)
    files_dir = real if source is None else os.path.realpath(os.path.expanduser(source))
    if not os.path.isdir(files_dir):
        what = "is not a directory" if os.path.exists(files_dir) else "does not exist"
        if source is not None:
            raise ConfigError(f"--encoder-source {files_dir} {what} (it is the local copy of the server's encoder "
                              "whose .py files are hashed)")
        raise ConfigError(f"EXL3 encoder source {real} {what} (its .py files are hashed: point --encoder-root or "
                          "VLLM_EXL3_ENCODER_SOURCE at the encoder's source, name a local copy with --encoder-source, "
                          "or pass --encoder-revision)")
    files = sorted(_walk_py_files(files_dir))  # tuple order = component-wise order, as pathlib sorts
    if not files:
        raise ConfigError(f"EXL3 encoder source contains no Python files: {files_dir} (pass --encoder-revision, or fix "
                          f"{'--encoder-source' if source is not None else 'the root'})")
    listing = [["/".join(parts), _file_sha256(os.path.join(files_dir, *parts))] for parts in files]
    payload = _compact_json({"root": real, "files": listing})
    return EncoderIdentity(model_payload_digest(payload), "files", payload, real, files_dir)


def encoder_settings(
    root: str | None = None,
    revision: str | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    source_dir: str | None = None,
) -> EncoderSettings:
    """The encoder root/revision: explicit values first, then ``VLLM_EXL3_ENCODER_SOURCE`` / ``_REVISION``.

    Without a root there is no identity to compute (the server refuses to start too), so this raises
    instead of inventing one. ``source_dir`` (``--encoder-source``) is the local copy to hash in files mode.
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
    if source_dir is not None and source_dir.strip() == "":
        source_dir = None
    return EncoderSettings(root=root, revision=revision, source=source, source_dir=source_dir)


@dataclass(frozen=True)
class ServerIdentities:
    """Both identities a server started as described will compute, what to start it with, and warnings."""

    model: ModelIdentity
    encoder: EncoderIdentity
    encoder_settings: EncoderSettings
    server_revision: str | None  # the --revision to start the server with (None: without one, or it does not matter)
    revision_note: str
    warnings: tuple[str, ...] = ()

    def as_json(self, name: str, *, source_detail: str, quantization_config: dict | None) -> dict:
        """The `identity --json` document (docs/cache.md) of model ``name``: ``source_detail`` says where the
        encoder's settings came from, ``quantization_config`` is the overlay shown beside them (``as_json()``)."""
        mid = self.model
        return {
            "model": {
                "name": name,
                "identity": mid.identity,
                "kind": mid.kind,
                "revision": mid.revision,
                "revision_from": mid.revision_from,
                "server_revision": self.server_revision,
                "server_revision_note": self.revision_note,
                "payload": mid.payload,
                "derivation": mid.derivation,
            },
            "encoder": {**encoder_json(self.encoder, self.encoder_settings), "source_detail": source_detail},
            "quantization_config": quantization_config,
            "warnings": list(self.warnings),
        }


def encoder_json(eid: EncoderIdentity, settings: EncoderSettings) -> dict:
    """An encoder identity as `identity --json` gives it (with or without a model)."""
    return {"identity": eid.identity, "mode": eid.mode, "root": eid.root, "files_from": eid.files_from,
            "payload": eid.payload, "source": settings.source}


def _revision_advice(mid: ModelIdentity, given: str | None) -> tuple[str | None, str, tuple[str, ...]]:
    """Which ``--revision`` the server must be started with for ``mid``, a sentence saying so, and warnings."""
    if mid.kind == "hub":
        sha = mid.revision
        note = f"start the server with --revision {sha} (the full commit hash is always safe)"
        if given is not None and given == sha:
            return sha, note, ()
        what = f"--revision {given!r} is a branch, tag or short hash" if given else "no --revision: the default branch 'main'"
        return sha, note, (
            f"{what} resolved to {sha} now; a server started with a branch or tag resolves it again when it starts, "
            f"and if it has moved by then every look-up misses: start the server with --revision {sha}",)
    if mid.kind == "file":
        return None, "the server's --revision does not enter a single-file checkpoint's identity", ()
    if mid.revision_from == "snapshot":
        return None, ("the server takes the revision from the snapshots/<hash> folder of its model path "
                      "(transformers' _commit_hash); its --revision does not change the identity"), ()
    if mid.revision_from == "commit-hash":
        return mid.revision, f"the server's config must carry _commit_hash {mid.revision}", ()
    if mid.revision_from == "option":
        return mid.revision, (f"start the server with --revision {mid.revision} exactly: a local folder's identity "
                              "hashes the string as given (fork versions that do not pass --revision to the cache "
                              "need a warm without --revision)"), ()
    return None, "start the server without --revision (a local folder's identity then has revision null)", ()


def server_encoder_identity(
    encoder_root: str | None = None,
    encoder_revision: str | None = None,
    encoder_source: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[EncoderIdentity, EncoderSettings, tuple[str, ...]]:
    """The encoder identity alone, as ``server_identities`` derives it: (identity, settings, warnings).

    For an encoder source directory checked before any model is chosen (``exl3tool identity --encoder-root DIR``).
    """
    settings = encoder_settings(encoder_root, encoder_revision, environ, source_dir=encoder_source)
    eid = resolve_encoder_identity(settings.root, settings.revision, source=settings.source_dir)
    return eid, settings, _encoder_warnings(eid, settings)


def _encoder_warnings(eid: EncoderIdentity, settings: EncoderSettings) -> tuple[str, ...]:
    tilde: tuple[str, ...] = ()
    if settings.root.startswith("~"):  # every release (exl3tool.releases: encoder_source_tilde_expanded_for_import)
        tilde = (f"VLLM_EXL3_ENCODER_SOURCE={settings.root} starts with ~: the server's identity expands it, its "
                 "encoder import does not (Path(...).resolve()), so any miss fails the server's start; give the "
                 "absolute path (the identity stays the same)",)
    if eid.mode == "revision":
        if settings.source_dir is not None:
            return tilde + ("--encoder-source is not used for the identity: with an encoder revision the server hashes no "
                            "files (a warm runs it as the local copy of the server's encoder in its encoder parity probe)",)
        return tilde
    if eid.files_from and not os.path.isfile(os.path.join(eid.files_from, *_QUANTIZE_PY)):
        return tilde + (f"{eid.files_from} holds no {'/'.join(_QUANTIZE_PY)}: the server's VLLM_EXL3_ENCODER_SOURCE is the "
                "exllamav3 package folder (the one holding modules/); a different folder hashes a different file set "
                "and cannot load the encoder on a miss",)
    return tilde


def server_identities(
    model: str,
    *,
    revision: str | None = None,
    server_path: str | None = None,
    encoder_root: str | None = None,
    encoder_revision: str | None = None,
    encoder_source: str | None = None,
    hub_commit: str | None = None,
    environ: Mapping[str, str] | None = None,
    view: ServerView | None = None,
) -> ServerIdentities:
    """The one function that decides the identities for ``identity``, ``encode``, ``cache warm`` and ``verify``.

    ``hub_commit`` is the commit of the snapshot a command downloaded for a Hub repo id, so the key names the
    weights that were read; it never applies to a local checkpoint, whose revision is what the *server* derives:
    the ``snapshots/<hash>`` folder of its path (``server_path`` when given, not our copy's), else ``revision``.
    ``view`` (from a launch): ``server_path`` is resolved in the server's filesystem (``resolve_model_identity``).

    Args:
        model: the checkpoint as exl3tool reads it (a directory, a file or a Hub repo id).
        revision, server_path: the server's ``--revision`` and its path to the model (None: ``model``).
        encoder_root, encoder_revision, encoder_source: the server's encoder (``VLLM_EXL3_ENCODER_*``).
        hub_commit, environ, view: as described above (None ``environ``: ``os.environ``).

    Returns:
        ``ServerIdentities``: the model and encoder identities, how each was derived, and warnings.

    >>> server_identities("./m", server_path="/models/m", encoder_root="/opt/exllamav3", encoder_revision="v1")  # doctest: +SKIP
    """
    local = os.path.exists(os.path.expanduser(model))
    mid = resolve_model_identity(model, revision=revision, server_path=server_path,
                                 commit_hash=None if local else hub_commit, view=view, environ=environ)
    settings = encoder_settings(encoder_root, encoder_revision, environ, source_dir=encoder_source)
    eid = resolve_encoder_identity(settings.root, settings.revision, source=settings.source_dir, view=view)
    server_rev, note, rev_warnings = _revision_advice(mid, revision)
    if local and os.path.isdir(os.path.expanduser(model)) and not os.path.isfile(
            os.path.join(os.path.expanduser(model), "config.json")):
        rev_warnings = (*rev_warnings, f"{model} has no config.json: the server cannot load it as a model (is this "
                                       "the checkpoint folder?)")
    return ServerIdentities(mid, eid, settings, server_rev, note,
                            mid.warnings + rev_warnings + _encoder_warnings(eid, settings))
