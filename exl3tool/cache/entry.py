"""Reading, validating and writing one entry file (docs/cache-format.md §5, §4.3).

``judge_entry`` is the one rule every command applies to an entry (valid, unchecked or invalid, with the reason):
the server's checks (§5.3), then exl3tool's checksums over what exl3tool wrote (tensors, key and metadata).
``validate_entry`` is the same rule raising on the first failure. Writing goes through a temporary file in the
entry's directory, ``fsync`` and ``os.replace``, so a reader sees either no file or a complete one, whatever happens to the writer.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import safe_open
from safetensors.torch import save as _st_save

from exl3tool.version import __version__
from exl3tool.cache.key import CacheKey
from exl3tool.cache.paths import layout_parts
from exl3tool.jsontext import loads_json

__all__ = [
    "Exl3OnlineNonFiniteError",
    "InvalidEntryError",
    "EntryContents",
    "TENSOR_NAMES",
    "expected_layout",
    "entry_bytes",
    "tensor_sha256",
    "file_tensor_sha256",
    "key_sha256",
    "checksum_problem",
    "checksum_covers",
    "describe_unreadable",
    "read_entry",
    "validate_entry",
    "check_fresh_encode",
    "Verdict",
    "judge_entry",
    "metadata_sha256",
    "META_SHA_FIELD",
    "parse_proxy_error",
    "write_entry",
    "atomic_write",
]

TENSOR_NAMES = frozenset({"trellis", "suh", "svh"})
_ST_DTYPES = {"I16": torch.int16, "F16": torch.float16}
_MAX_HEADER = 100_000_000  # safetensors' own limit on the header length


class Exl3OnlineNonFiniteError(ValueError):
    """NaN or Inf in ``suh``/``svh`` or the proxy error: never published, never a hit (the server's error)."""


class InvalidEntryError(ValueError):
    """An entry the server would refuse; the message is the reason."""


@dataclass(frozen=True)
class EntryContents:
    """What a file holds: tensors on the CPU, parsed proxy error and the raw metadata."""

    tensors: dict[str, torch.Tensor]
    proxy_error: float | None
    metadata: dict[str, str]


def expected_layout(key: CacheKey) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Safetensors dtype and shape of each tensor for ``key`` (docs/cache-format.md §5.1)."""
    k, n = key.input_size, key.output_size
    return {
        "trellis": ("I16", (k // 16, n // 16, 16 * key.bits)),
        "suh": ("F16", (k,)),
        "svh": ("F16", (n,)),
    }


_ITEM_BYTES = {"I16": 2, "F16": 2}
_LONGEST_PROXY_ERROR = repr(-2.2250738585072014e-308)  # no float's repr is longer


def entry_bytes(key: CacheKey, platform: str | None = None) -> int:
    """The size of ``key``'s entry as ``write_entry`` writes it, at most (the proxy error's text may be shorter).

    What a warm checks free space against before its first encode: the tensors' bytes plus the header, built as
    ``write_entry`` builds it with the longest proxy error text (and ``platform``, the encoder's, when it records one).
    """
    layout = expected_layout(key)
    metadata = {
        "cache_key": key.canonical_json(), "proxy_error": _LONGEST_PROXY_ERROR, "exl3tool_version": __version__,
        "exl3tool_sha256": "0" * 64, "exl3tool_key_sha256": "0" * 64, META_SHA_FIELD: "0" * 64}
    if platform:
        metadata["exl3tool_platform"] = platform
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in sorted(layout):
        dtype, shape = layout[name]
        size = math.prod(shape) * _ITEM_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return 8 + len(text) + (-len(text) % 8) + offset


def _sha_line(name: str, dtype: str, shape: list[int]) -> bytes:
    return f"{name}:{dtype}:{shape}\n".encode()


def tensor_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over name, dtype, shape and raw bytes of each tensor in name order (our own integrity check)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(_sha_line(name, str(t.dtype).removeprefix("torch."), list(t.shape)))
        if t.numel():
            h.update(t.view(torch.uint8).numpy().data)  # the buffer itself, no copy
    return h.hexdigest()


def key_sha256(cache_key_json: str, tensors_digest: str) -> str:
    """``exl3tool_key_sha256``: SHA-256 of the entry's canonical ``cache_key`` and its ``exl3tool_sha256``.

    Binds the key to the tensors, so that another entry's file (tensors and checksum) under this key's
    ``cache_key`` is refused. One hash of a few hundred bytes: the tensor bytes are hashed once, for both.
    Not a signature: whoever writes a file can compute both (``docs/deploy.md`` says what an import proves).
    """
    return hashlib.sha256(f"cache_key:{cache_key_json}\nexl3tool_sha256:{tensors_digest}\n".encode()).hexdigest()


META_SHA_FIELD = "exl3tool_meta_sha256"


def metadata_sha256(metadata: dict[str, str]) -> str:
    """``exl3tool_meta_sha256``: SHA-256 of every other metadata field (sorted-key compact JSON, ASCII).

    Covers what the server reads (``cache_key``, ``proxy_error``) and everything else exl3tool wrote, among it
    ``exl3tool_sha256`` (so the tensors too): a field edited, added or removed after publish breaks it.
    """
    body = {k: v for k, v in metadata.items() if k != META_SHA_FIELD}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()).hexdigest()


def checksum_problem(metadata: dict[str, str], tensors_digest: str) -> str | None:
    """Why an entry's checksums do not hold, given the digest of its tensors (``tensor_sha256``); None if they hold.

    ``exl3tool_sha256`` must match the tensors (not compared when ``tensors_digest`` is ""); ``exl3tool_key_sha256``
    (on entries written since the key binding) must match the stored ``cache_key`` and that digest;
    ``exl3tool_meta_sha256`` (since the metadata checksum) must match every other metadata field. Any ``exl3tool_*``
    field without ``exl3tool_sha256`` is a removed checksum. Entries written before the metadata checksum are still
    accepted when their ``proxy_error`` is exactly what ``write_entry`` writes (``repr`` of a finite float): missing,
    ``""`` or another spelling (``'1_0'``) is an edit, and such an entry is invalid (a warm re-encodes it).
    """
    want = metadata.get("exl3tool_sha256")
    bound = metadata.get("exl3tool_key_sha256")
    if want is None:
        ours = sorted(k for k in metadata if k.startswith("exl3tool_"))
        return f"{', '.join(ours)} without exl3tool_sha256 (exl3tool's checksum removed after publish)" if ours else None
    if tensors_digest and tensors_digest != want:
        return "tensor bytes differ from exl3tool_sha256 (changed after publish)"
    if bound is not None and bound != key_sha256(metadata.get("cache_key", ""), want):
        return ("exl3tool_key_sha256 does not match the cache_key and tensors (another entry's file under this key, "
                "or a cache_key edited after publish)")
    meta = metadata.get(META_SHA_FIELD)
    if meta is not None:
        if meta != metadata_sha256(metadata):
            return (f"{META_SHA_FIELD} does not match the metadata (proxy_error or another field edited, added or "
                    "removed after publish)")
        return None
    text = metadata.get("proxy_error")
    if text is None or text != _written_form(text):
        return (f"proxy_error {'missing' if text is None else repr(text)} is not as exl3tool writes it (repr of a "
                f"finite float) on an entry without {META_SHA_FIELD} (written before it): edited after publish")
    return None


def _written_form(text: str) -> str | None:
    """``text`` as ``write_entry`` would have written its value: ``repr(float(text))``; None if not a finite float."""
    try:
        value = float(text)
    except ValueError:
        return None
    return repr(value) if math.isfinite(value) else None


def checksum_covers(metadata: dict[str, str]) -> str:
    """What exl3tool's checksums cover on an entry: ``all`` (tensors, key and every metadata field), ``tensors+key``
    or ``tensors`` (entries written before those fields; proxy_error then checked by its written form), ``none``."""
    if "exl3tool_sha256" not in metadata:
        return "none"
    if META_SHA_FIELD in metadata:
        return "all"
    return "tensors+key" if "exl3tool_key_sha256" in metadata else "tensors"


def _read_header(fh) -> tuple[int, dict]:
    """(header length, header dict) of an open safetensors file; ValueError if it does not parse."""
    head = fh.read(8)
    if len(head) < 8:
        raise ValueError("no header length")
    n = struct.unpack("<Q", head)[0]
    if n > _MAX_HEADER:
        raise ValueError(f"header length {n} is implausible")
    return n, loads_json(fh.read(n))


def file_tensor_sha256(path: str | Path) -> str:
    """``tensor_sha256`` of an entry's tensors, hashed straight from the file (mapped, no tensor copies).

    What a warm's plan checks hits with: the same digest as ``tensor_sha256(read_entry(path).tensors)`` for
    ``I16``/``F16`` tensors, at hashing speed (about 2 GB/s per core with SHA extensions).
    """
    names = {"I16": "int16", "F16": "float16"}
    with open(path, "rb") as fh:
        n, header = _read_header(fh)
        h = hashlib.sha256()
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                for name in sorted(k for k in header if k != "__metadata__"):
                    rec = header[name]
                    start, stop = rec["data_offsets"]
                    h.update(_sha_line(name, names.get(rec["dtype"], rec["dtype"]), [int(d) for d in rec["shape"]]))
                    h.update(view[8 + n + start:8 + n + stop])
            finally:
                view.release()
    return h.hexdigest()


def describe_unreadable(path: str | Path, exc: BaseException) -> str:
    """Why safetensors could not open ``path``, in words: above all, a file shorter than its header promises.

    >>> describe_unreadable(truncated_entry, exc)   # doctest: +SKIP
    'file is 4086 bytes, shorter than the 4096 bytes its header promises (truncated, e.g. an interrupted copy)'
    """
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"file is {size} bytes, shorter than the 8-byte header length a safetensors file starts with"
            n = struct.unpack("<Q", head)[0]
            if n > _MAX_HEADER:
                return f"not a safetensors file (its first 8 bytes claim a {n}-byte header)"
            if 8 + n > size:
                return f"file is {size} bytes, shorter than its header promises ({8 + n} bytes for the header alone; truncated)"
            try:
                header = loads_json(fh.read(n))
                end = max((int(r["data_offsets"][1]) for k, r in header.items() if k != "__metadata__"), default=0)
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                return f"not a safetensors file (its header is not valid safetensors JSON: {exc})"
    except OSError as err:
        return f"unreadable ({err.strerror or err})"
    if 8 + n + end > size:
        return (f"file is {size} bytes, shorter than the {8 + n + end} bytes its header promises "
                "(truncated, e.g. an interrupted copy)")
    return f"not a valid safetensors file ({exc})"


def parse_proxy_error(text: str | None) -> float | None:
    """The server's reading of ``proxy_error``: missing or ``""`` is None, else ``float()`` and must be finite."""
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        raise InvalidEntryError(f"proxy_error {text!r} is not a number") from None
    if not math.isfinite(value):
        raise Exl3OnlineNonFiniteError(f"non-finite proxy_error {text!r}")
    return value


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    if not bool(torch.isfinite(tensor).all()):
        raise Exl3OnlineNonFiniteError(f"non-finite values in {name}")


def read_entry(path: str | Path) -> EntryContents:
    """Open ``path`` as safetensors on the CPU without any checks beyond the format itself."""
    with safe_open(str(path), framework="pt", device="cpu") as fh:
        metadata = dict(fh.metadata() or {})
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    return EntryContents(tensors, None, metadata)


@dataclass(frozen=True)
class Verdict:
    """What ``judge_entry`` decided about one entry file; every command reports this.

    ``status``: ``valid`` (the server loads it and exl3tool's checksums hold), ``unchecked`` (the server loads it;
    it carries no exl3tool field at all, e.g. server-written: only an exact re-encode can check its weights) or
    ``invalid`` (the server would not load it, or exl3tool's checksums fail: a warm re-encodes it). ``loadable``:
    whether the server would load it. ``sha256_ok``: whether its tensor bytes match ``exl3tool_sha256`` and the key
    binding ``exl3tool_key_sha256`` (when present) holds (None when not compared). ``covers``: ``checksum_covers``. ``contents`` (loadable entries): tensors (suh and svh only
    without the trellis), parsed proxy error and metadata.
    """

    status: str
    reason: str
    loadable: bool
    key: CacheKey | None = None
    sha256_ok: bool | None = None
    covers: str = "none"
    contents: EntryContents | None = None
    metadata: dict[str, str] | None = None
    nonfinite: bool = False  # invalid for NaN/Inf data: the server raises Exl3OnlineNonFiniteError

    @property
    def ok(self) -> bool:
        """A hit for exl3tool: valid or unchecked."""
        return self.status != "invalid"


def _path_problem(path: Path, key: CacheKey) -> str | None:
    """Why ``path`` is not where the server looks ``key`` up (file name, model and TP folders), or None."""
    if path.name != f"{key.digest()}.safetensors":
        return "file name is not the digest of the stored cache_key"
    if (path.parent.parent.name, path.parent.name) != layout_parts(key.model_identity, key.tp_world_size, key.tp_rank)[1:]:
        return "entry sits in the wrong model or tp directory for its key"
    return None


def _own_key(path: Path) -> CacheKey:
    """The key stored in ``path``'s header, which must be canonical; raises InvalidEntryError why not."""
    if not path.is_file():
        raise InvalidEntryError("not a regular file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            stored = (fh.metadata() or {}).get("cache_key")
    except Exception as exc:
        raise InvalidEntryError(describe_unreadable(path, exc)) from None
    if stored is None:
        raise InvalidEntryError("no cache_key metadata")
    try:
        key = CacheKey.from_json(stored)
    except Exception as exc:
        raise InvalidEntryError(f"cache_key is not a valid key ({exc})") from None
    if key.canonical_json() != stored:
        raise InvalidEntryError("cache_key is not in canonical form; the server never matches it")
    return key


def _server_load(path: Path, key: CacheKey, load_trellis: bool) -> EntryContents:
    """The server's checks (§5.3) of ``path`` for ``key``; raises InvalidEntryError or Exl3OnlineNonFiniteError."""
    if not path.is_file():
        raise InvalidEntryError("not a regular file")
    try:
        fh_ctx = safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:
        raise InvalidEntryError(describe_unreadable(path, exc)) from None
    with fh_ctx as fh:
        metadata = dict(fh.metadata() or {})
        stored = metadata.get("cache_key")
        if stored != key.canonical_json():
            raise InvalidEntryError("metadata cache_key differs from the expected key" if stored else "no cache_key metadata")
        names = set(fh.keys())
        if names != TENSOR_NAMES:
            raise InvalidEntryError(f"tensors are {sorted(names)}, expected ['suh', 'svh', 'trellis']")
        for name, (dtype, shape) in expected_layout(key).items():
            sl = fh.get_slice(name)
            got_dtype, got_shape = sl.get_dtype(), tuple(sl.get_shape())
            if got_dtype != dtype or got_shape != shape:
                raise InvalidEntryError(f"{name} is {got_dtype}{list(got_shape)}, expected {dtype}{list(shape)}")
        names = ("trellis", "suh", "svh") if load_trellis else ("suh", "svh")
        tensors = {name: fh.get_tensor(name) for name in names}
    _check_finite("suh", tensors["suh"])
    _check_finite("svh", tensors["svh"])
    return EntryContents(tensors, parse_proxy_error(metadata.get("proxy_error")), metadata)


def judge_entry(
    path: str | Path, key: CacheKey | None = None, *, load_trellis: bool = True, hash_tensors: bool = True
) -> Verdict:
    """The one rule for an entry file: valid, unchecked or invalid, with the reason (see ``Verdict``).

    ``key``: the key it is looked up for (the store, a warm, an import); None takes the file's own key, which must
    be canonical and match the file's name and folders (a scan of the cache). Then exl3tool's checksums
    (``checksum_problem``). ``load_trellis=False`` never loads the trellis into a tensor; its bytes are hashed
    straight from the file (``file_tensor_sha256``). ``hash_tensors=False`` skips only the tensor bytes against
    ``exl3tool_sha256`` (what the server's own check never reads); every other rule still applies.
    Failures of this host rather than the file (out of memory, EIO) propagate.
    """
    path = Path(path)
    try:
        if key is None:
            key = _own_key(path)
            problem = _path_problem(path, key)
            if problem:
                raise InvalidEntryError(problem)
        contents = _server_load(path, key, load_trellis)
    except (InvalidEntryError, Exl3OnlineNonFiniteError) as exc:
        return Verdict("invalid", str(exc), False, key, nonfinite=isinstance(exc, Exl3OnlineNonFiniteError))
    metadata = contents.metadata
    covers = checksum_covers(metadata)
    if not any(k.startswith("exl3tool_") for k in metadata):
        return Verdict("unchecked", "the server would load it, but it carries no exl3tool checksum (written by the "
                       "server?), so its weights are unchecked", True, key, None, covers, contents, metadata)
    digest = ""
    if hash_tensors and "exl3tool_sha256" in metadata:
        digest = tensor_sha256(contents.tensors) if load_trellis else file_tensor_sha256(path)
    problem = checksum_problem(metadata, digest)
    bound = metadata.get("exl3tool_key_sha256")
    sha_ok = None if not digest else (digest == metadata["exl3tool_sha256"] and (
        bound is None or bound == key_sha256(metadata.get("cache_key", ""), metadata["exl3tool_sha256"])))
    if problem:
        return Verdict("invalid", problem, True, key, sha_ok, covers, contents, metadata)
    return Verdict("valid", "", True, key, sha_ok, covers, contents, metadata)


def validate_entry(
    path: str | Path, key: CacheKey, *, verify_checksum: bool = True, load_trellis: bool = True
) -> EntryContents:
    """``judge_entry`` raising on an invalid entry: InvalidEntryError with the reason (Exl3OnlineNonFiniteError
    for non-finite data, as the server raises); returns the contents of a valid or unchecked entry.

    ``verify_checksum=False`` is the server's checks (§5.3) alone: e.g. a flipped trellis byte, or another layer's
    tensors under this key, pass as long as shapes and finiteness hold.
    """
    path = Path(path)
    if not verify_checksum:
        return _server_load(path, key, load_trellis)
    verdict = judge_entry(path, key, load_trellis=load_trellis)
    if verdict.status == "invalid":
        if verdict.nonfinite:
            raise Exl3OnlineNonFiniteError(verdict.reason)
        raise InvalidEntryError(verdict.reason)
    assert verdict.contents is not None
    return verdict.contents


def check_fresh_encode(key: CacheKey, tensors: dict[str, torch.Tensor], proxy_error: float | None) -> None:
    """The server's checks on a fresh encode: exact tensors, dtypes and shapes, all finite."""
    if set(tensors) != TENSOR_NAMES:
        raise ValueError(f"{key.prefix}: encoder returned tensors {sorted(tensors)}, expected ['suh', 'svh', 'trellis']")
    for name, (dtype, shape) in expected_layout(key).items():
        t = tensors[name]
        if t.dtype != _ST_DTYPES[dtype] or tuple(t.shape) != shape:
            raise ValueError(
                f"{key.prefix}: encoder returned {name} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}, "
                f"expected {str(_ST_DTYPES[dtype]).removeprefix('torch.')}{list(shape)}"
            )
    try:
        _check_finite("suh", tensors["suh"])
        _check_finite("svh", tensors["svh"])
        if proxy_error is not None and not math.isfinite(proxy_error):
            raise Exl3OnlineNonFiniteError(f"non-finite proxy_error {proxy_error!r}")
    except Exl3OnlineNonFiniteError as exc:
        raise Exl3OnlineNonFiniteError(f"{key.prefix}: encoder produced {exc}; nothing published") from None


def _serialize(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, memoryview]:
    """safetensors' own serialization with the header's keys in sorted order: ``(size + header, data)``.

    safetensors writes the metadata map in hash order, which changes from one call to the next; sorting the
    header makes the same inputs give the same bytes. The data section is safetensors' unchanged.
    """
    raw = _st_save(tensors, metadata=metadata)
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.dumps(json.loads(raw[8:8 + n]), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    header += b" " * (-len(header) % 8)  # keep the data 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(header)) + header, memoryview(raw)[8 + n:]


def write_entry(
    path: str | Path, key: CacheKey, tensors: dict[str, torch.Tensor], proxy_error: float | None, *,
    file_mode: int = 0o600, platform: str = "",
) -> Path:
    """Publish atomically (§4.3): mkstemp ``.<digest>.safetensors.<random>.tmp``, write, fsync, ``os.replace``.

    The temporary file is unlinked in every case. ``file_mode`` 0o600 matches the server; pass 0o644 when
    the server runs as another user. Metadata beyond the server's two keys (which it ignores, docs/cache-format.md §5.2):
    ``exl3tool_version``, ``exl3tool_sha256`` (the tensors), ``exl3tool_key_sha256`` (key and tensors, see
    ``key_sha256``), when given ``exl3tool_platform`` (where the encode ran; what an exact re-check needs), and
    ``exl3tool_meta_sha256`` over all of them (``metadata_sha256``: proxy_error included).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    digest = tensor_sha256(cpu)
    metadata = {
        "cache_key": key.canonical_json(),
        "proxy_error": "" if proxy_error is None else repr(float(proxy_error)),
        "exl3tool_version": __version__,
        "exl3tool_sha256": digest,
        "exl3tool_key_sha256": key_sha256(key.canonical_json(), digest),
    }  # no timestamp: the same inputs must give the same bytes (the file's mtime records when)
    if platform:
        metadata["exl3tool_platform"] = platform
    metadata[META_SHA_FIELD] = metadata_sha256(metadata)  # last: it covers every field above
    head, data = _serialize(cpu, metadata)

    def write(fh) -> None:
        fh.write(head)
        fh.write(data)

    return atomic_write(path, write, file_mode=file_mode)


def atomic_write(
    path: str | Path,
    write: Callable[[BinaryIO], None],
    *,
    file_mode: int = 0o600,
    check: Callable[[Path], None] | None = None,
) -> Path:
    """The publish protocol of §4.3 for any bytes: ``write`` fills a temp file in ``path``'s directory
    (``.<name>.<random>.tmp``), ``check`` may inspect it (raise to abandon the publish), then fsync and
    ``os.replace`` onto ``path``. The temp file is unlinked in every case; ``path`` is either untouched or
    replaced whole.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with open(tmp, "wb") as fh:
            write(fh)
        if file_mode != 0o600:
            os.chmod(tmp, file_mode)
        if check is not None:
            check(Path(tmp))
        rfd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(rfd)
        finally:
            os.close(rfd)
        os.replace(tmp, path)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    return path
