"""Option types shared by commands, so every command spells the same option the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Collection, Optional

import typer

from exl3tool.cache.settings import BITS_RANGE, BITS_VAR, DEFAULT_BITS
from exl3tool.cli.commands.launching import (  # the launch options, shared
    MODEL_HELP, EnvFileOpt, LaunchCommand, LaunchOpt, PidOpt, given_fields,
)
from exl3tool.plan.request import DTYPE_SPELLINGS, SERVING_DTYPES, serving_dtype_name

__all__ = [
    "non_empty",
    "MODEL_WANTED",
    "LaunchOpt",
    "PidOpt",
    "EnvFileOpt",
    "LaunchCommand",
    "RevisionOpt",
    "ServerPathOpt",
    "EncoderRootOpt",
    "EncoderRevisionOpt",
    "EncoderSourceOpt",
    "FileModeOpt",
    "CacheDirOpt",
    "JsonOpt",
    "TrustEncoderOpt",
    "QuietOpt",
    "ModelIdOpt",
    "OverlapOpt",
    "LockTimeoutOpt",
    "ProgressOpt",
    "BitsOpt",
    "DtypeOpt",
    "QuantizationConfigOpt",
    "ModelArg",
    "TpSizeOpt",
    "TpRankOpt",
    "TpSizesOpt",
    "LayersOpt",
    "ExcludeOpt",
    "SharedOpt",
    "DeviceOpt",
    "DryRunOpt",
    "GpuMemoryOpt",
    "REQUEST_OPTIONS",
    "request_from_options",
    "resolve_cache_dir",
    "parse_file_mode",
    "existing_cache_dir",
]

RevisionOpt = Annotated[
    Optional[str],
    typer.Option("--revision", help="Hub branch, tag or commit (default: main); resolved to the full commit hash."),
]
ServerPathOpt = Annotated[
    Optional[str],
    typer.Option(
        "--server-path",
        help="The local checkpoint's resolved absolute path on the server (when our copy lives elsewhere; copy with mtimes kept).",
    ),
]
EncoderRootOpt = Annotated[
    Optional[str],
    typer.Option("--encoder-root", help="The server's VLLM_EXL3_ENCODER_SOURCE path (default: that env var)."),
]
EncoderRevisionOpt = Annotated[
    Optional[str],
    typer.Option("--encoder-revision", help="The server's VLLM_EXL3_ENCODER_REVISION (default: that env var)."),
]
ServerReleaseOpt = Annotated[
    Optional[str],
    typer.Option(
        "--server-release", metavar="NAME",
        help="The fork release the server runs (e.g. gilded-gnosis-r33, infernal-invocation-r18, a patched image's "
             "gilded-gnosis-r34+pr312), whose cache root, lock and start-up rules apply (docs/releases.md). Default: "
             "the one the image's files or labels name, else the newest (said as such).",
    ),
]
EncoderSourceOpt = Annotated[
    Optional[str],
    typer.Option(
        "--encoder-source",
        metavar="DIR",
        help="A local copy of the server's encoder package whose .py files are hashed (files mode, no "
        "--encoder-revision); --encoder-root stays the path string the server uses. Default: the files under "
        "--encoder-root.",
    ),
]
FileModeOpt = Annotated[
    str,
    typer.Option(
        "--file-mode",
        help="Permissions of new entries, octal (the server writes 0600; use 0644 if it runs as another user).",
    ),
]
def non_empty(want: str, convert: Callable[[str], Any] = str) -> Callable[[str], Any]:
    """A parser refusing an empty value (``""`` would silently mean this directory), else ``convert(value)``;
    ``want`` says what to give instead."""

    def parse(value: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            raise typer.BadParameter(f"empty; give {want}")
        return value if not isinstance(value, str) else convert(value)

    return parse


CacheDirOpt = Annotated[
    Optional[Path],
    typer.Option("--cache-dir", parser=non_empty("a directory (`.` for this one), or leave --cache-dir out for the server's", Path),
                 metavar="PATH",
                 help="Cache root (default: the server's, from VLLM_EXL3_ONLINE_CACHE_DIR etc.)."),
]
TrustEncoderOpt = Annotated[
    bool,
    typer.Option(
        "--trust-encoder-identity",
        help="Write entries under an encoder identity that is not exl3tool's own even when a probe encode with that "
        "encoder gave other bytes (encoder parity `differs`; recorded so in the provenance). Default: refuse.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No notes or progress on stderr.")]
OverlapOpt = Annotated[
    bool,
    typer.Option(
        "--overlap/--no-overlap",
        help="Read the next weights and publish finished entries on background threads while encoding (same results).",
    ),
]
LockTimeoutOpt = Annotated[
    Optional[float],
    typer.Option(
        "--lock-timeout",
        metavar="SECONDS",
        min=0,
        help="Give up on an entry whose lock another process has held this long (the job fails, nothing encoded). "
        "Default: wait while the holder runs; give up only on a stopped holder, or an unidentifiable one with no "
        "progress for 600 s.",
    ),
]


def _progress_mode(value: str) -> str:
    from exl3tool.cli.progress import PROGRESS_MODES

    text = value.strip().lower()
    if text not in PROGRESS_MODES:
        raise typer.BadParameter(f"must be one of {', '.join(PROGRESS_MODES)}, got {value!r}")
    return text


ProgressOpt = Annotated[
    str,
    typer.Option(
        "--progress",
        metavar="auto|bar|lines|none",
        callback=_progress_mode,
        help="Progress on stderr: a bar, or log lines (one per job done and a status line every 30 s, with tiles "
        "done/total, rate and ETA). auto: a bar on a terminal, lines otherwise (a pipe, a CI log); none with --quiet.",
    ),
]
QuantizationConfigOpt = Annotated[
    Optional[str],
    typer.Option(
        "--quantization-config",
        metavar="JSON",
        help="The server's --quantization-config string, exactly as it is started with (keys linear, shared_experts, "
        "ignore; \"mxfp8\" shorthand). Default: '{\"linear\": {\"weight\": \"mxfp8\"}}', the minimal overlay that "
        "turns online Trellis on.",
    ),
]


def _model_id(value: Optional[str]) -> Optional[str]:
    """``--model`` of the cache commands: a model identity or a hex prefix of one (as ``cache ls`` shows them)."""
    if value is None:
        return None
    text = value.strip().lower()
    if not text or len(text) > 64 or any(c not in "0123456789abcdef" for c in text):
        raise typer.BadParameter(f"takes a model identity or a hex prefix of one (as `exl3tool cache ls` and "
                                 f"`exl3tool identity MODEL` print them), got {value!r}")
    return text


ModelIdOpt = Annotated[
    Optional[str],
    typer.Option("--model", callback=_model_id, help="Only entries of this model identity (full or hex prefix)."),
]


def _bits(value: Optional[int]) -> Optional[int]:
    """``--bits``: the given value (3..8); not given: None, and the library's ``server_bits`` takes the server's
    VLLM_EXL3_ONLINE_TRELLIS_BITS, else 6 (one rule for the library and every command)."""
    lo, hi = BITS_RANGE
    if value is not None and not lo <= value <= hi:
        raise typer.BadParameter(f"{value} is not from {lo} to {hi} (what the server accepts for {BITS_VAR})")
    return value


BitsOpt = Annotated[
    Optional[int],
    typer.Option(
        "--bits", callback=_bits, show_default=f"${BITS_VAR}, else {DEFAULT_BITS}",
        help=f"Trellis bits per weight, {BITS_RANGE[0]} to {BITS_RANGE[1]} (the server's {BITS_VAR}).",
    ),
]


def _dtype(value: str) -> str:
    """``--dtype``: one of the server's spellings (``half`` too, as a launch's), as exl3tool names it."""
    name = serving_dtype_name(value)
    if name is None:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(DTYPE_SPELLINGS)} (the server's --dtype "
                                 "values)")
    return name


DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype", callback=_dtype, metavar="|".join(SERVING_DTYPES),
        help="The server's --dtype, which weights are cast to before encoding: auto (the checkpoint's config dtype; "
        "float32 checkpoints are served as bfloat16), bfloat16, float16 (half) or float32 (float).",
    ),
]


MODEL_WANTED = "a Hub repo id or a checkpoint directory (`.` for this one)"
ModelArg = Annotated[Optional[str], typer.Argument(metavar="MODEL", parser=non_empty(MODEL_WANTED), help=MODEL_HELP)]
TpSizeOpt = Annotated[int, typer.Option("--tp-size", "-tp", min=1, help="Tensor-parallel world size of the server.")]
TpRankOpt = Annotated[Optional[int], typer.Option("--tp-rank", help="Only this rank (default: every rank).")]
# one spelling with encode/verify's (and vLLM's -tp); --tp-sizes: the old one, hidden (group.HIDDEN_ALIASES)
TpSizesOpt = Annotated[str, typer.Option("--tp-size", "-tp", "--tp-sizes", metavar="N[,N...]",
                                         help="Comma-separated TP sizes; every rank of each is warmed.")]
LayersOpt = Annotated[list[str], typer.Option("--layers", metavar="GLOB", help="Only layers whose prefix (or, for unknown architectures, checkpoint tensor name without .weight) matches this glob; repeatable.")]
ExcludeOpt = Annotated[list[str], typer.Option("--exclude", metavar="GLOB", help="Leave out layers matching this glob; repeatable.")]
SharedOpt = Annotated[bool, typer.Option("--shared-experts", help="Add a shared_experts spec to the default overlay (with --quantization-config, put it in that string instead).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto (this process's GPU under torchrun, else CPU), cpu, cuda or cuda:N.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan (layer, rank, shape, tiles, hit or miss) and encode nothing.")]
GpuMemoryOpt = Annotated[Optional[float], typer.Option("--gpu-memory", metavar="GiB", help="GPU memory budget per worker in GiB (default: what the device has free, less 5% or 1 GiB); the encoder sizes its chunks to it and a layer that cannot fit fails with the memory it needed.")]


def _same(value: Any) -> Any:
    return value


def _cache_mode(value: str) -> str:
    """``encode --mode``: readwrite, readonly or off, any case."""
    from exl3tool.cache.settings import CACHE_MODES

    norm = value.strip().lower()
    if norm not in CACHE_MODES:
        raise typer.BadParameter(f"--mode must be one of {', '.join(CACHE_MODES)}, got {value!r}")
    return norm


def _server_release(value: Optional[str]) -> Optional[str]:
    """``--server-release``: the release's canonical name (a usage error naming the known releases otherwise)."""
    from exl3tool.releases import release

    return None if value is None else release(value).name


# Every option that sets a field of the request: option parameter -> (ServerRequest field, the value's conversion).
# The one table every request-building command (identity, encode, cache warm, cache check, verify, cache import
# --against) fills its request from; a command declares the options it takes, and the table covers what it declares.
REQUEST_OPTIONS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "model": ("model", lambda v: v or ""),
    "revision": ("revision", _same),
    "server_path": ("server_path", _same),
    "tp_sizes": ("tp_sizes", lambda v: parse_positive_ints(v, "--tp-size")),
    "tp_size": ("tp_sizes", lambda v: (v,)),
    "tp_rank": ("tp_ranks", lambda v: None if v is None else (v,)),
    "mode": ("mode", _cache_mode),
    "bits": ("bits", _same),
    "dtype": ("dtype", _same),
    "quantization_config": ("quantization_config", _same),
    "layers": ("layers", tuple),
    "exclude": ("exclude", tuple),
    "shared_experts": ("shared_experts", _same),
    "cache_dir": ("cache_dir", _same),
    "device": ("device", _same),
    "encoder_root": ("encoder_root", _same),
    "encoder_revision": ("encoder_revision", _same),
    "encoder_source": ("encoder_source", _same),
    "file_mode": ("file_mode", lambda v: parse_file_mode(v)),
    "overlap": ("overlap", _same),
    "lock_timeout": ("lock_timeout", _same),
    "gpu_memory": ("gpu_memory_gib", _same),
    "check_unchecked": ("check_unchecked", _same),
    "trust_encoder_identity": ("trust_encoder_identity", _same),
    "server_release": ("server_release", _server_release),
}


def request_from_options(ctx: typer.Context, *, skip: Collection[str] = (), **fields: Any) -> tuple[Any, set[str]]:
    """The command's ``ServerRequest`` from its options (``REQUEST_OPTIONS``), and the set of fields its command line
    gave (what wins over a launch in ``apply_launch``).

    ``fields`` are set by the command itself (``verify``'s mode, ``import --against``'s model) and win over options;
    ``skip`` names options that are the command's own, not the request's (``cache import``'s ``--file-mode``).
    """
    from exl3tool.plan import ServerRequest

    params = {p: spec for p, spec in REQUEST_OPTIONS.items() if p in ctx.params and p not in skip}
    values = {field: convert(ctx.params[p]) for p, (field, convert) in params.items() if field not in fields}
    given = given_fields(ctx, {p: field for p, (field, _) in params.items()})
    return ServerRequest(**values, **fields), given


def resolve_cache_dir(cache_dir: Path | None, server_release: Any = None, environ: dict | None = None) -> Path:
    """``--cache-dir`` if given, else the server's cache root from the environment, by the rule of the release
    ``--server-release`` names (``exl3tool.releases.resolve_release``: the newest when none is named)."""
    from exl3tool.cache import cache_root
    from exl3tool.releases import resolve_release

    return cache_dir if cache_dir is not None else cache_root(environ, resolve_release(server_release).release)


def parse_positive_ints(text: str, option: str) -> tuple[int, ...]:
    """Parse a comma-separated option such as ``--tp-size 1,2,4`` or ``--rows 1,16``; BadParameter if not positive ints."""
    if any(not part.strip() for part in text.split(",")):
        raise typer.BadParameter(f"{option} has an empty item: comma-separated integers like 1,2,4, got {text!r}")
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"{option} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise typer.BadParameter(f"{option} must be positive integers, got {text!r}")
    return values


def parse_file_mode(text: str) -> int:
    """Parse ``--file-mode`` (octal such as 0600 or 0644) and check it as the store does; BadParameter otherwise."""
    from exl3tool.cache.store import file_mode_problem

    try:
        mode = int(text, 8)
    except ValueError:
        raise typer.BadParameter(f"--file-mode must be octal like 0600 or 0644, got {text!r}") from None
    problem = file_mode_problem(mode)
    if problem:
        raise typer.BadParameter(f"--file-mode {text} {problem}; use 0600, or 0644 for a server of another user")
    return mode


def existing_cache_dir(cache_dir: Path | None, environ: dict | None = None, server_release: Any = None) -> Path:
    """``resolve_cache_dir`` (with ``environ``: the server's environment; ``server_release``: a name or the run's
    ``ReleaseChoice``), which must be an existing directory (InputError otherwise, exit 2)."""
    from exl3tool.errors import InputError

    root = resolve_cache_dir(cache_dir, server_release, environ)
    if not root.exists():
        raise InputError(f"cache directory {root} does not exist (check --cache-dir, VLLM_EXL3_ONLINE_CACHE_DIR or "
                         "--server-release)")
    if not root.is_dir():
        raise InputError(f"cache directory {root} is not a directory (check --cache-dir or VLLM_EXL3_ONLINE_CACHE_DIR)")
    return root
