"""Open a checkpoint (local directory, one .safetensors file, or a Hub repo id) and read it lazily.

Only headers are parsed up front; tensors are read one at a time (or one slice at a time) through
safetensors' memory-mapped ``safe_open``, so the whole model is never in memory. A Hub model is
resolved through ``huggingface_hub.snapshot_download`` restricted to the files we read, which also
yields the 40-hex commit hash that the server's ``model_identity`` uses (docs/cache-format.md §2.4, §3).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import safe_open

from exl3tool.errors import InputError
from exl3tool.jsontext import loads_json, read_json_object

__all__ = ["Checkpoint", "TensorInfo", "FetchInfo", "open_checkpoint", "hub_cache_dir", "serving_dtype",
           "QUANT_CONFIG", "Selector", "ST_ITEMSIZE", "tensor_nbytes", "span_problem"]

# The only files a Hub download fetches: what we read, nothing else (no .bin, no tokenizer); with an index,
# only the shards it names. quantization_config.json says which layers an EXL3 checkpoint already stores
# quantized (the server never encodes those online, docs/layer-plan.md §2).
INDEX_NAME = "model.safetensors.index.json"
QUANT_CONFIG = "quantization_config.json"
SMALL_FILES = ["config.json", INDEX_NAME, QUANT_CONFIG]
_HEX40 = re.compile(r"[0-9a-f]{40}")
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header

# safetensors dtype codes -> torch dtypes (the ones a checkpoint can hold)
_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _code, _name in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _name):
        _ST_DTYPES[_code] = getattr(torch, _name)


# bytes per element of each safetensors dtype code (safetensors' Dtype), torch's own dtype or not
ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def tensor_nbytes(shape, code: str) -> int:
    """The bytes a tensor of safetensors dtype ``code`` and ``shape`` holds."""
    n = 1
    for d in shape:
        n *= int(d)
    return n * ST_ITEMSIZE[code]


def span_problem(name: str, code: Any, shape: Any, offsets: tuple[int, int]) -> Optional[str]:
    """Why a header's record of tensor ``name`` is wrong, or None: its shape is not a list of sizes, or its
    ``data_offsets`` (``[begin, end]``) do not span its dtype's size times its shape (a dtype exl3tool does not know
    is not counted). The one check of every shard exl3tool opens (``_read_header``) and of every tensor a hydrate
    copies (``checkpoint.hydrated.write_shard``).

    >>> span_problem("w", "BF16", [2, 3], (0, 12)) is None, span_problem("w", "F32", [2, 3], (0, 12))
    (True, "tensor 'w' is F32 [2, 3] (24 bytes) but its data_offsets [0, 12] span 12 bytes")
    """
    if not isinstance(shape, list) or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
        return f"tensor {name!r} has shape {shape!r}, not a list of sizes"
    if code not in ST_ITEMSIZE:
        return None
    want, have = tensor_nbytes(shape, code), offsets[1] - offsets[0]
    if want != have:
        return (f"tensor {name!r} is {code} {shape} ({want:,} bytes) but its data_offsets {list(offsets)} span "
                f"{have:,} bytes")
    return None


class TensorInfo:
    """Where one tensor lives and what it is, from the shard's header (no data read)."""

    __slots__ = ("name", "file", "dtype_code", "shape")

    def __init__(self, name: str, file: Path, dtype_code: str, shape: tuple[int, ...]) -> None:
        self.name, self.file, self.dtype_code, self.shape = name, file, dtype_code, shape

    @property
    def is_float(self) -> bool:
        """True for plain floating-point storage (F16/BF16/F32/F64), the only kind we encode.

        FP8 weights are excluded: without their scales a cast would give wrong values.
        """
        return self.dtype_code in ("F16", "BF16", "F32", "F64")

    def __repr__(self) -> str:
        return f"TensorInfo({self.name!r}, {self.file.name!r}, {self.dtype_code}, {list(self.shape)})"


def _read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header ourselves so a corrupt file fails here, naming the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise InputError(f"{path}: not a safetensors file (only {size} bytes); re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise InputError(
                    f"{path}: corrupt safetensors header (declares {n} header bytes in a {size}-byte file); "
                    "re-download or re-save the file"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise InputError(f"{path}: file not found; the checkpoint is incomplete, download the missing file") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = loads_json(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        out: dict[str, TensorInfo] = {}
        spans: list[tuple[int, int, str]] = []
        for name, rec in header.items():
            if name == "__metadata__":
                continue
            code, offs = rec["dtype"], rec["data_offsets"]
            if len(offs) == 2 and isinstance(offs[1], int) and offs[1] > size - 8 - n >= 0:
                truncated = max(8 + n + o[1] for o in (r["data_offsets"] for k, r in header.items()
                                                       if k != "__metadata__") if isinstance(o[1], int))
                raise _Truncated(f"{path}: truncated: its header places tensors up to byte {truncated:,}, the file "
                                 f"has {size:,} bytes (an interrupted copy or download?); copy or download it again")
            if code not in _ST_DTYPES or len(offs) != 2 or not all(isinstance(o, int) for o in offs) or not (
                    0 <= offs[0] <= offs[1] <= size - 8 - n):
                raise ValueError(f"bad record for tensor {name!r}")
            problem = span_problem(name, code, rec["shape"], tuple(offs))
            if problem:
                raise ValueError(problem)
            spans.append((offs[0], offs[1], name))
            out[name] = TensorInfo(name, path, code, tuple(rec["shape"]))
        spans.sort()
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise ValueError(f"tensors {first!r} and {second!r} overlap (bytes {start:,} to {end:,})")
    except _Truncated as e:
        raise InputError(str(e)) from None
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path}: corrupt safetensors header ({e}); re-download or re-save the file") from None
    return out


class _Truncated(Exception):
    """A shard shorter than its own header says (a cut copy), not a corrupt header."""


def _config_dtype(config: dict[str, Any], config_path: Path) -> torch.dtype | None:
    """The checkpoint's declared dtype: config ``torch_dtype`` (or newer ``dtype``), None when absent."""
    value = config.get("torch_dtype") or config.get("dtype")
    if value is None:
        text = config.get("text_config")
        if isinstance(text, dict):
            value = text.get("torch_dtype") or text.get("dtype")
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(f"{config_path}: torch_dtype {value!r} is not a floating-point torch dtype")
    return dtype


def serving_dtype(config_dtype: torch.dtype | None) -> torch.dtype:
    """vLLM's ``--dtype auto`` on a current GPU: the config dtype, except float32 (or none) -> bfloat16.

    vLLM downcasts float32 models to its preferred 16-bit type (bfloat16 on sm80+; float16 for pooling
    models); a config with no dtype counts as float32 (unless vLLM can ask the Hub API for the weights'
    dtypes: an all-F16 checkpoint then serves as float16). Pass ``dtype=`` to ``rank_local_weight`` when the
    server runs with an explicit ``--dtype`` or in those cases.
    """
    return torch.bfloat16 if config_dtype in (None, torch.float32, torch.float64) else config_dtype


# Given the snapshot folder (small files present), config.json and every tensor name of the index: the names the
# plan will read. A Hub download then fetches only the shards that hold them.
Selector = Callable[[Path, dict, list[str]], "set[str] | None"]


@dataclass(frozen=True)
class FetchInfo:
    """What a Hub download fetched: shard files, their bytes, and the index's total (all tensors of the repo)."""

    shards: tuple[str, ...]
    shards_total: int
    bytes_fetched: int
    index_total_bytes: Optional[int]

    def line(self) -> str:
        total = f" of {self.index_total_bytes / 2**30:.2f} GiB" if self.index_total_bytes else ""
        return (f"fetched {len(self.shards)} of {self.shards_total} shards: "
                f"{self.bytes_fetched / 2**30:.2f} GiB{total} (only shards holding planned tensors)")


class Checkpoint:
    """A resolved local checkpoint: config plus a name -> shard map; tensors are read on demand."""

    def __init__(self, model: str, root: Path, config: dict[str, Any], commit_hash: str | None,
                 tensors: dict[str, TensorInfo], config_path: Path | None = None, revision: str | None = None,
                 index_names: list[str] | None = None, fetch: FetchInfo | None = None) -> None:
        self.model = model
        # As given (--revision). For a local path it selects nothing, but the server's directory identity
        # records ``commit_hash or revision`` (docs/cache-format.md §2.4, §3), so it is kept.
        self.revision = revision
        self.root = root
        self.config = config
        self.commit_hash = commit_hash
        self._tensors = tensors
        self.config_dtype = _config_dtype(config, config_path or root / "config.json")  # as declared, or None
        self.dtype = serving_dtype(self.config_dtype)  # what the server casts weights to under --dtype auto
        self._index_names = index_names  # every tensor of the index, also those in shards not fetched
        self.fetch = fetch  # set for a Hub checkpoint whose shards were fetched selectively

    def __repr__(self) -> str:
        return f"Checkpoint({self.model!r}, root={str(self.root)!r}, tensors={len(self._tensors)})"

    @property
    def architecture(self) -> str | None:
        """``architectures[0]`` from config.json, or None when the config names none."""
        archs = self.config.get("architectures")
        return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None

    def tensor_names(self) -> list[str]:
        """All tensor names, in file order then header order."""
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def index_names(self) -> list[str]:
        """Every tensor name of the checkpoint, including shards a selective Hub download left out."""
        return list(self._index_names) if self._index_names is not None else self.tensor_names()

    def info(self, name: str) -> TensorInfo:
        """Header record for ``name``; InputError naming the tensor when absent."""
        try:
            return self._tensors[name]
        except KeyError:
            raise InputError(f"{self.root}: checkpoint has no tensor {name!r}") from None

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def _open(self, info: TensorInfo):
        try:
            return safe_open(str(info.file), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own SafetensorError
            raise InputError(f"{info.file}: cannot open as safetensors ({e}); re-download the file") from None

    def get_tensor(self, name: str) -> torch.Tensor:
        """One whole tensor, read from its shard (nothing else is loaded)."""
        info = self.info(name)
        with self._open(info) as f:
            return f.get_tensor(name)

    def read(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """A 2-D tensor's ``[rows, cols]`` block, reading only that slice from disk (rank-local shards)."""
        info = self.info(name)
        if len(info.shape) != 2:
            raise InputError(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, expected 2-D [out, in]")
        r0, r1 = rows if rows is not None else (0, info.shape[0])
        c0, c1 = cols if cols is not None else (0, info.shape[1])
        if not (0 <= r0 <= r1 <= info.shape[0] and 0 <= c0 <= c1 <= info.shape[1]):
            raise ValueError(f"{name}: slice rows {r0}:{r1} cols {c0}:{c1} outside shape {list(info.shape)}")
        with self._open(info) as f:
            return f.get_slice(name)[r0:r1, c0:c1]


def hub_cache_dir() -> Path:
    """The Hub cache as huggingface_hub would pick it, read from the environment now (not at import): the one rule,
    ``exl3tool.cache.hub.hub_cache_dir``."""
    from exl3tool.cache.hub import hub_cache_dir as _hub_cache_dir

    return _hub_cache_dir()


def _env_offline() -> bool:
    """huggingface_hub's offline switch (HF_HUB_OFFLINE, else TRANSFORMERS_OFFLINE): ``exl3tool.cache.hub``'s rule."""
    from exl3tool.cache.hub import hub_offline

    return hub_offline()


def _snapshot_hash(directory: Path) -> str | None:
    """The commit hash when ``directory`` is a Hub-cache ``snapshots/<40hex>`` folder."""
    d = Path(os.path.abspath(directory))
    return d.name if d.parent.name == "snapshots" and _HEX40.fullmatch(d.name) else None


def _download(model: str, revision: str | None, token: str | bool | None, local_files_only: bool | None,
              select: Selector | None = None, hub_cache: str | Path | None = None) -> tuple[Path, list[str] | None]:
    """Resolve a repo id to a snapshot folder; offline (env or argument) never touches the network.

    Returns the folder and, when ``select`` chose a subset, the shard files fetched (None: every shard).
    """
    from huggingface_hub import errors as hf_errors
    from huggingface_hub import snapshot_download

    offline = _env_offline() if local_files_only is None else bool(local_files_only)
    cache = Path(hub_cache) if hub_cache is not None else hub_cache_dir()
    rev = revision or "main"
    try:
        # First the small files, which pin the commit; then only the shards the index names (a repo may also
        # carry e.g. Mistral's consolidated.safetensors, a second full copy we must not fetch).
        folder = Path(snapshot_download(
            repo_id=model, revision=revision, cache_dir=str(cache), allow_patterns=SMALL_FILES,
            token=token, local_files_only=offline,
        ))
        chosen: list[str] | None = None
        if (folder / INDEX_NAME).is_file():
            files = _index_files(folder)
            shards = list(files)
            if select is not None:
                names = [n for f in files.values() for n in f]
                wanted = select(folder, _load_config(folder / "config.json"), names)
                if wanted is not None:
                    chosen = shards = [f for f, held in files.items() if wanted & set(held)]
        else:
            shards = ["*.safetensors"]
        pinned = folder.name if _HEX40.fullmatch(folder.name) else revision
        folder = Path(snapshot_download(
            repo_id=model, revision=pinned, cache_dir=str(cache), allow_patterns=[*SMALL_FILES, *shards],
            token=token, local_files_only=offline,
        ))
    except hf_errors.HFValidationError:
        raise InputError(f"{model!r}: no such local path, and not a valid Hub repo id (expected 'org/name')") from None
    except hf_errors.IncompleteSnapshotError as e:  # a subclass of LocalEntryNotFoundError: keep its detail
        raise InputError(f"{model}: {' '.join(str(e).split())}") from None
    except hf_errors.LocalEntryNotFoundError:
        why = "downloads are off (HF_HUB_OFFLINE=1 or local_files_only)" if offline else "the Hub could not be reached"
        raise InputError(
            f"{model}: revision {rev!r} is not in the Hub cache {cache} and {why}; "
            f"download it first (hf download {model} --revision {rev}) or point HF_HUB_CACHE at a cache that has it"
        ) from None
    except hf_errors.RevisionNotFoundError:
        raise InputError(
            f"{model}: revision {rev!r} does not exist on the Hub; pass an existing branch, tag or commit"
        ) from None
    except (hf_errors.RepositoryNotFoundError, hf_errors.GatedRepoError):
        raise InputError(
            f"{model}: repository not found or access denied; check the name, or log in (hf auth login / HF_TOKEN)"
        ) from None
    except (hf_errors.HfHubHTTPError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise InputError(
            f"{model}: download failed ({type(e).__name__}: {first}); check the network or try again"
        ) from None
    return folder, chosen


def _load_config(path: Path) -> dict[str, Any]:
    try:
        return read_json_object(path)
    except FileNotFoundError:
        raise InputError(f"{path}: config.json not found; the checkpoint directory needs one") from None


def _index_files(root: Path) -> dict[str, list[str]]:
    """Shard file -> tensor names it should hold, from model.safetensors.index.json."""
    path = root / INDEX_NAME
    try:
        index = loads_json(path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise ValueError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path}: cannot parse the shard index ({type(e).__name__}: {e})") from None
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(str(file), []).append(name)
    return files


def _collect(files: list[tuple[Path, list[str] | None]]) -> dict[str, TensorInfo]:
    """Tensor name -> header record over ``(shard, names the index places there or None)`` pairs."""
    tensors: dict[str, TensorInfo] = {}
    for file, expected in files:
        if not file.is_file():
            named = f" (named in {INDEX_NAME})" if expected is not None else ""
            raise InputError(f"{file}: shard missing{named}; the checkpoint is incomplete, download that file")
        header = _read_header(file)
        if expected is not None:
            missing = [n for n in expected if n not in header]
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise InputError(f"{file}: shard lacks tensor {missing[0]!r}{more} that {INDEX_NAME} places there; "
                                 "re-download the shard")
            header = {n: header[n] for n in expected}
        for name, info in header.items():
            tensors.setdefault(name, info)
    return tensors


def _index_total(root: Path) -> Optional[int]:
    try:
        total = loads_json((root / INDEX_NAME).read_text(encoding="utf-8")).get("metadata", {}).get("total_size")
    except (OSError, ValueError, AttributeError):
        return None
    return int(total) if isinstance(total, (int, float)) else None


def open_checkpoint(model: str, *, revision: str | None = None, token: str | bool | None = None,
                    local_files_only: bool | None = None, select: Selector | None = None,
                    hf_overrides: dict[str, Any] | None = None, hub_cache: str | Path | None = None) -> Checkpoint:
    """Open ``model`` (a directory, a .safetensors file, or a Hub repo id) without loading weights.

    ``select`` (Hub repos with an index): given the snapshot's small files, the tensor names the plan needs; only
    the shards holding them are downloaded and read (``Checkpoint.fetch`` says how many bytes). Local checkpoints
    are read whole. Example: ``open_checkpoint("meta-llama/Llama-3.1-8B", revision="main")`` under
    ``HF_HUB_OFFLINE=1`` reads the cached snapshot and sets ``commit_hash`` from it. ``hf_overrides`` (the server's
    ``--hf-overrides``) is applied to config.json as the fork applies it, so the plan sees the server's config.

    Args:
        model: a directory, a .safetensors file or a Hub repo id.
        revision, token, local_files_only: the Hub's (a branch, tag or commit; the token; never download).
        select, hf_overrides: as described above.
        hub_cache: the Hub cache a repo id is read from (default: this environment's); a launch's server reads its
            own, through its volumes.

    Returns:
        A ``Checkpoint``: config, tensor index, dtype and (for the Hub) the commit and what was fetched.
    """
    if hf_overrides:
        from exl3tool.checkpoint.overrides import apply_hf_overrides

        base_select = select
        if base_select is not None:
            select = lambda root, config, names: base_select(root, apply_hf_overrides(config, hf_overrides), names)  # noqa: E731
        checkpoint = open_checkpoint(model, revision=revision, token=token, local_files_only=local_files_only,
                                     select=select, hub_cache=hub_cache)
        checkpoint.config = apply_hf_overrides(checkpoint.config, hf_overrides)
        checkpoint.config_dtype = _config_dtype(checkpoint.config, checkpoint.root / "config.json")
        checkpoint.dtype = serving_dtype(checkpoint.config_dtype)
        return checkpoint
    expanded = os.path.expanduser(model)
    if os.path.exists(expanded):  # like the server: an existing path wins over a repo id (docs/cache-format.md §2.4)
        local = Path(os.path.abspath(expanded))
        if local.is_file():
            if local.suffix != ".safetensors":
                raise InputError(
                    f"{local}: not a .safetensors file; pass a checkpoint directory or a .safetensors file"
                )
            root = local.parent
            config_path = root / "config.json"
            config = _load_config(config_path) if config_path.is_file() else {}
            return Checkpoint(model, root, config, _snapshot_hash(root), _collect([(local, None)]),
                              config_path, revision)
        root = local
        chosen = None
    else:
        root, chosen = _download(model, revision, token, local_files_only, select, hub_cache)

    config = _load_config(root / "config.json")
    if (root / INDEX_NAME).is_file():
        files = _index_files(root)
        picked = files if chosen is None else {f: files[f] for f in chosen}
        tensors = _collect([(root / f, names) for f, names in picked.items()])
        if chosen is not None:
            fetched = sum((root / f).stat().st_size for f in chosen)
            fetch = FetchInfo(tuple(chosen), len(files), fetched, _index_total(root))
            return Checkpoint(model, root, config, _snapshot_hash(root), tensors, revision=revision,
                              index_names=[n for held in files.values() for n in held], fetch=fetch)
    else:
        files = sorted(p for p in root.glob("*.safetensors") if not p.name.startswith("."))
        if not files:
            raise InputError(
                f"{root}: no *.safetensors files and no {INDEX_NAME}; only safetensors checkpoints are read"
            )
        tensors = _collect([(f, None) for f in files])
    commit = _snapshot_hash(root)
    return Checkpoint(model, root, config, commit, tensors, revision=revision)
