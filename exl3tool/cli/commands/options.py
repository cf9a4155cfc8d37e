"""Every option a command shares, declared once: one row each, with its spelling, help, converter, group and the
``ServerRequest`` field it sets (if any). A command names the groups it takes (``command.command``): it takes every
row of each, in the table's order, less the rows it names in ``without``, and the rows it names in ``options``
(a row ``by_name``, which no group hands out, or one of a group it does not take). Adding a row to a group gives it
to every command that takes the group; its body gets the request the rows give, never the rows one by one.

Groups, in help order: ``model`` (which checkpoint, as the server names it), ``plan`` (what the server plans: TP,
bits, layers, overlay, dtype), ``encoder`` (the encoder's identity), ``cache`` (where the entries are),
``encoding`` (how an encode runs and publishes its entries), ``entries`` (which entries a cache command takes),
``launch`` (the server's launch and release: they give the settings, the cache root among them), ``output``
(``--json``, ``--quiet``, ``--progress``: the run's ``Output``; every command takes it). A rule ("only with
--against", "nothing with --nodes") names groups, never a hand list of options (``command.Rule``).
"""

from __future__ import annotations

from dataclasses import dataclass
from inspect import Parameter
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from exl3tool.cache.settings import BITS_RANGE, BITS_VAR, DEFAULT_BITS
from exl3tool.plan.request import DTYPE_SPELLINGS, SERVING_DTYPES, serving_dtype_name

__all__ = ["Row", "ROWS", "GROUPS", "LAUNCH", "HIDDEN_ALIASES", "group", "taken", "non_empty", "MODEL_WANTED",
           "MODEL_HELP", "spelling", "parse_positive_ints", "parse_file_mode", "existing_cache_dir"]

GROUPS = ("model", "plan", "encoder", "cache", "encoding", "entries", "launch", "output")
REQUIRED = Parameter.empty  # a row without a default: the command line must give it


@dataclass(frozen=True)
class Row:
    """One option (or argument): ``type`` is its ``Annotated`` type as Typer reads it (spelling, help, metavar,
    converter), ``field`` the ``ServerRequest`` field it sets (``convert``: its value as that field's), ``old`` an
    old spelling still accepted and left out of the help for one release (CHANGELOG.md). ``by_name``: a command
    takes it only by naming it (``--tp-rank``, ``--dry-run``), not with its group; ``instead``: a variant of that row
    of the group (``encode``'s one ``--tp-size`` instead of warm's list), taken by name in its place."""

    name: str
    type: Any
    default: Any
    group: str
    field: Optional[str] = None
    convert: Callable[[Any], Any] = lambda value: value
    old: Optional[str] = None
    by_name: bool = False
    instead: Optional[str] = None


def non_empty(want: str, convert: Callable[[str], Any] = str) -> Callable[[str], Any]:
    """A parser refusing an empty value (``""`` would silently mean this directory), else ``convert(value)``;
    ``want`` says what to give instead."""

    def parse(value: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            raise typer.BadParameter(f"empty; give {want}")
        return value if not isinstance(value, str) else convert(value)

    return parse


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


def _progress_mode(value: str) -> str:
    from exl3tool.cli.progress import PROGRESS_MODES

    text = value.strip().lower()
    if text not in PROGRESS_MODES:
        raise typer.BadParameter(f"must be one of {', '.join(PROGRESS_MODES)}, got {value!r}")
    return text


def _model_id(value: Optional[str]) -> Optional[str]:
    """``--model`` of the cache commands: a model identity or a hex prefix of one (as ``cache ls`` shows them)."""
    if value is None:
        return None
    text = value.strip().lower()
    if not text or len(text) > 64 or any(c not in "0123456789abcdef" for c in text):
        raise typer.BadParameter(f"takes a model identity or a hex prefix of one (as `exl3tool cache ls` and "
                                 f"`exl3tool identity MODEL` print them), got {value!r}")
    return text


def _bits(value: Optional[int]) -> Optional[int]:
    """``--bits``: the given value (3..8); not given: None, and the library's ``server_bits`` takes the server's
    VLLM_EXL3_ONLINE_TRELLIS_BITS, else 6 (one rule for the library and every command)."""
    lo, hi = BITS_RANGE
    if value is not None and not lo <= value <= hi:
        raise typer.BadParameter(f"{value} is not from {lo} to {hi} (what the server accepts for {BITS_VAR})")
    return value


def _dtype(value: str) -> str:
    """``--dtype``: one of the server's spellings (``half`` too, as a launch's), as exl3tool names it."""
    name = serving_dtype_name(value)
    if name is None:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(DTYPE_SPELLINGS)} (the server's --dtype "
                                 "values)")
    return name


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


def _row(name: str, python_type: Any, default: Any, info: Any, group: str, field: Optional[str] = None,
         convert: Callable[[Any], Any] = lambda value: value, old: Optional[str] = None, by_name: bool = False,
         instead: Optional[str] = None) -> Row:
    return Row(name, Annotated[python_type, info], default, group, field, convert, old, by_name or bool(instead),
               instead)


MODEL_WANTED = "a Hub repo id or a checkpoint directory (`.` for this one)"
MODEL_HELP = ("Hub repo id or local checkpoint directory (here). With --launch/--pid it defaults to the launch's "
              "model; given, it is the copy read here and the launch's path is the server's.")
_TP_SIZES = "N[,N...]"

# Every row, by its parameter name. A row with a ``field`` sets that field of the command's ``ServerRequest``.
ROWS: dict[str, Row] = {row.name: row for row in (
    # model: which checkpoint, as the server names it
    _row("model", Optional[str], None,
         typer.Argument(metavar="MODEL", parser=non_empty(MODEL_WANTED), help=MODEL_HELP),
         "model", "model", lambda value: value or ""),
    _row("source", str, REQUIRED,
         typer.Argument(metavar="SOURCE", help="The EXL3 checkpoint folder (read only, never written)."),
         "model", "model", instead="model"),
    _row("revision", Optional[str], None,
         typer.Option("--revision", metavar="TEXT",
                      help="Hub branch, tag or commit (default: main); resolved to the full commit hash."),
         "model", "revision"),
    _row("server_path", Optional[str], None,
         typer.Option("--server-path", metavar="TEXT",
                      help="The local checkpoint's resolved absolute path on the server (when our copy lives "
                      "elsewhere; copy with mtimes kept)."),
         "model", "server_path"),
    # plan: what the server plans
    _row("tp_size", int, 1,
         typer.Option("--tp-size", "-tp", min=1, metavar="INTEGER RANGE",
                      help="Tensor-parallel world size of the server."),
         "plan", "tp_sizes", lambda value: (value,), instead="tp_sizes"),
    _row("tp_sizes", str, "1",  # one spelling with encode/verify's (and vLLM's -tp)
         typer.Option("--tp-size", "-tp", metavar=_TP_SIZES,
                      help="Comma-separated TP sizes; every rank of each is warmed."),
         "plan", "tp_sizes", lambda value: parse_positive_ints(value, "--tp-size"), old="--tp-sizes"),
    _row("hydrate_tp_sizes", Optional[str], None,  # hydrate's: not given, every size OUT can start at
         typer.Option("--tp-size", "-tp", metavar=_TP_SIZES,
                      help="The TP sizes OUT must start at; a layer one of them cannot slice stays BF16 and is listed. "
                      "Default: the launch's, else every size up to 8 a server of SOURCE starts at."),
         "plan", "tp_sizes", lambda value: () if value is None else parse_positive_ints(value, "--tp-size"),
         old="--tp-sizes", instead="tp_sizes"),
    _row("tp_rank", Optional[int], None,
         typer.Option("--tp-rank", metavar="INTEGER", help="Only this rank (default: every rank)."),
         "plan", "tp_ranks", lambda value: None if value is None else (value,), by_name=True),
    _row("bits", Optional[int], None,
         typer.Option("--bits", callback=_bits, metavar="INTEGER", show_default=f"${BITS_VAR}, else {DEFAULT_BITS}",
                      help=f"Trellis bits per weight, {BITS_RANGE[0]} to {BITS_RANGE[1]} (the server's {BITS_VAR})."),
         "plan", "bits"),
    _row("layers", list[str], [],
         typer.Option("--layers", metavar="GLOB",
                      help="Only layers whose prefix (or, for unknown architectures, checkpoint tensor name without "
                      ".weight) matches this glob; repeatable."),
         "plan", "layers", tuple),
    _row("exclude", list[str], [],
         typer.Option("--exclude", metavar="GLOB", help="Leave out layers matching this glob; repeatable."),
         "plan", "exclude", tuple),
    _row("shared_experts", bool, False,
         typer.Option("--shared-experts",
                      help="Add a shared_experts spec to the default overlay (with --quantization-config, put it in "
                      "that string instead)."),
         "plan", "shared_experts"),
    _row("quantization_config", Optional[str], None,
         typer.Option("--quantization-config", metavar="JSON",
                      help="The server's --quantization-config string, exactly as it is started with (keys linear, "
                      "shared_experts, ignore; \"mxfp8\" shorthand). Default: '{\"linear\": {\"weight\": \"mxfp8\"}}', "
                      "the minimal overlay that turns online Trellis on."),
         "plan", "quantization_config"),
    _row("dtype", str, "auto",
         typer.Option("--dtype", callback=_dtype, metavar="|".join(SERVING_DTYPES),
                      help="The server's --dtype, which weights are cast to before encoding: auto (the checkpoint's "
                      "config dtype; float32 checkpoints are served as bfloat16), bfloat16, float16 (half) or float32 "
                      "(float)."),
         "plan", "dtype"),
    _row("dry_run", bool, False,
         typer.Option("--dry-run", help="Print the plan (layer, rank, shape, tiles, hit or miss) and encode nothing."),
         "plan", by_name=True),
    # encoder: the encoder's identity
    _row("encoder_root", Optional[str], None,
         typer.Option("--encoder-root", metavar="TEXT",
                      help="The server's VLLM_EXL3_ENCODER_SOURCE path (default: that env var)."),
         "encoder", "encoder_root"),
    _row("encoder_revision", Optional[str], None,
         typer.Option("--encoder-revision", metavar="TEXT",
                      help="The server's VLLM_EXL3_ENCODER_REVISION (default: that env var)."),
         "encoder", "encoder_revision"),
    _row("encoder_source", Optional[str], None,
         typer.Option("--encoder-source", metavar="DIR",
                      help="A local copy of the server's encoder package whose .py files are hashed (files mode, no "
                      "--encoder-revision); --encoder-root stays the path string the server uses. Default: the files "
                      "under --encoder-root."),
         "encoder", "encoder_source"),
    # cache: where the entries are
    _row("cache_dir", Optional[Path], None,
         typer.Option("--cache-dir", metavar="PATH",
                      parser=non_empty("a directory (`.` for this one), or leave --cache-dir out for the server's",
                                       Path),
                      help="Cache root (default: the server's, from VLLM_EXL3_ONLINE_CACHE_DIR etc.)."),
         "cache", "cache_dir"),
    # encoding: how an encode runs and publishes its entries
    _row("device", str, "auto",
         typer.Option("--device", metavar="TEXT",
                      help="auto (this process's GPU under torchrun, else CPU), cpu, cuda or cuda:N."),
         "encoding", "device"),
    _row("overlap", bool, True,
         typer.Option("--overlap/--no-overlap",
                      help="Read the next weights and publish finished entries on background threads while encoding "
                      "(same results)."),
         "encoding", "overlap"),
    _row("gpu_memory", Optional[float], None,
         typer.Option("--gpu-memory", metavar="GiB",
                      help="GPU memory budget per worker in GiB (default: what the device has free, less 5% or "
                      "1 GiB); the encoder sizes its chunks to it and a layer that cannot fit fails with the memory it "
                      "needed."),
         "encoding", "gpu_memory_gib"),
    _row("trust_encoder_identity", bool, False,
         typer.Option("--trust-encoder-identity",
                      help="Write entries under an encoder identity that is not exl3tool's own even when a probe "
                      "encode with that encoder gave other bytes (encoder parity `differs`; recorded so in the "
                      "provenance). Default: refuse."),
         "encoding", "trust_encoder_identity"),
    _row("mode", str, "readwrite",
         typer.Option("--mode", metavar="TEXT",
                      help="readwrite (publish), readonly (encode misses, write nothing) or off (no cache)."),
         "encoding", "mode", _cache_mode, by_name=True),
    _row("file_mode", str, "0600",
         typer.Option("--file-mode", metavar="TEXT",
                      help="Permissions of new entries, octal (the server writes 0600; use 0644 if it runs as "
                      "another user)."),
         "encoding", "file_mode", parse_file_mode),
    _row("check_unchecked", bool, False,
         typer.Option("--check-unchecked",
                      help="Re-encode every hit without exl3tool's checksum (e.g. server-written), compare it exactly "
                      "and replace it if it differs."),
         "encoding", "check_unchecked", by_name=True),
    _row("lock_timeout", Optional[float], None,
         typer.Option("--lock-timeout", metavar="SECONDS", min=0,
                      help="Give up on an entry whose lock another process has held this long (the job fails, "
                      "nothing encoded). Default: wait while the holder runs; give up only on a stopped holder, or an "
                      "unidentifiable one with no progress for 600 s."),
         "encoding", "lock_timeout"),
    # entries: which entries a cache command takes
    _row("model_id", Optional[str], None,
         typer.Option("--model", callback=_model_id, metavar="TEXT",
                      help="Only entries of this model identity (full or hex prefix)."),
         "entries"),
    _row("tp_filter", Optional[str], None,
         typer.Option("--tp-size", "-tp", metavar=_TP_SIZES,
                      help="Only entries of these TP sizes, comma-separated (default: all)."),
         "entries", old="--tp-sizes", by_name=True),
    # launch: the server's launch and release (``command.Call.launch``, ``Call.cache_root``)
    _row("server_release", Optional[str], None,
         typer.Option("--server-release", metavar="NAME",
                      help="The fork release the server runs (e.g. gilded-gnosis-r33, infernal-invocation-r18, a "
                      "patched image's gilded-gnosis-r34+pr312), whose cache root, lock and start-up rules apply "
                      "(docs/releases.md). Default: the one the image's files or labels name; else none is "
                      "assumed: where the answer or the write depends on the release (the cache root where "
                      "XDG_CACHE_HOME gives it, an r7 checkpoint, ...) the command stops (exit 2) until it is named, "
                      "and where every release that encodes online gives the same, it goes on and says so."),
         "launch", "server_release", _server_release),
    _row("launch", Optional[str], None,
         typer.Option("--launch", metavar="COMMAND",
                      help="The server's launch, one shell-quoted string: `vllm serve MODEL ...`, `python -m "
                      "vllm.entrypoints.openai.api_server ...`, wrapped (`setsid ./run vllm serve ...`, `env A=1 "
                      "...`), or `docker run`/`podman run ... IMAGE ...`. Its model, revision, TP size, dtype, "
                      "--quantization-config, environment (VLLM_EXL3_*, cache root) and volumes (paths as the server "
                      "sees them) give the settings; this command's own flags win. Also: the server's argv after "
                      "`--`."),
         "launch"),
    _row("pid", Optional[int], None,
         typer.Option("--pid", metavar="PID",
                      help="A running server's process: its command line and environment are read from /proc/PID."),
         "launch"),
    _row("env_file", list[str], [],
         typer.Option("--env-file", metavar="FILE",
                      help="The server's environment in Docker's env-file format (NAME=VALUE lines); repeatable. "
                      "Below the launch's own -e/--env-file, above this process's environment."),
         "launch"),
    _row("launch_file", Optional[str], None,
         typer.Option("--launch-file", metavar="FILE",
                      help="The server's launch script (run.sh, a launcher serve-*.sh), run by this machine's bash in "
                      "a read-only sandbox (no network, nothing written, the server's command recorded, not run; "
                      "docs/launch.md); or a launcher's DRY_RUN=1 output (KEY=%q lines and a Command: line)."),
         "launch"),
    _row("compose", Optional[str], None,
         typer.Option("--compose", metavar="FILE",
                      help="A docker compose file: the server's service (image, entrypoint, command, environment, "
                      "env_file, volumes, working_dir), ${VAR} interpolated from this environment and the project's "
                      ".env, as docker compose applies them."),
         "launch"),
    _row("service", Optional[str], None,
         typer.Option("--service", metavar="NAME",
                      help="The --compose service that runs the server (default: the only one that runs vllm)."),
         "launch"),
    _row("image", Optional[str], None,
         typer.Option("--image", metavar="NAME",
                      help="The server's image: its ENV (below the launch's -e), labels and entrypoint, read with "
                      "`docker|podman image inspect` (never pulled), else --image-inspect, else exl3tool's table of "
                      "the fork's published images (docs/images.md). Also the image a parity probe may run the "
                      "encoder in."),
         "launch"),
    _row("image_inspect", Optional[str], None,
         typer.Option("--image-inspect", metavar="FILE",
                      help="The server image's settings as saved by `docker image inspect NAME > FILE` where the image "
                      "is (no runtime needed here); wins over inspecting the image here."),
         "launch"),
    _row("image_root", Optional[str], None,
         typer.Option("--image-root", metavar="DIR",
                      help="The server image's files: a mounted or unpacked image root (`podman image mount IMAGE`), "
                      "or its vllm package folder. The fork modules there (exl3_online_cache.py, exl3.py) give the "
                      "release's rules, over its labels (a patched image keeps its release's labels; "
                      "docs/releases.md)."),
         "launch"),
    _row("image_archive", Optional[str], None,
         typer.Option("--image-archive", metavar="FILE",
                      help="The server's image saved by `docker save IMAGE -o FILE` (or `podman save`): its ENV, "
                      "labels and entrypoint, and the fork modules in its layers, as --image-inspect and "
                      "--image-root give them (read here, nothing run; docs/images.md)."),
         "launch"),
    # output: the run's ``Output`` (``command.command`` gives --json and --quiet to every command)
    _row("progress", str, "auto",
         typer.Option("--progress", metavar="auto|bar|lines|none", callback=_progress_mode,
                      help="Progress on stderr: a bar, or log lines (one per job done and a status line every 30 s, "
                      "with tiles done/total, rate and ETA). auto: a bar on a terminal, lines otherwise (a pipe, a CI "
                      "log); none with --quiet."),
         "output", by_name=True),
    _row("json", bool, False, typer.Option("--json", help="Machine-readable JSON on stdout."), "output"),
    _row("quiet", bool, False, typer.Option("--quiet", "-q", help="No notes or progress on stderr."), "output"),
)}


def group(name: str) -> tuple[str, ...]:
    """The rows of group ``name``, in the table's order (those ``by_name`` included)."""
    if name not in GROUPS:
        raise KeyError(f"no option group {name!r} (groups: {', '.join(GROUPS)})")
    return tuple(row.name for row in ROWS.values() if row.group == name)


def taken(groups: tuple[str, ...], without: tuple[str, ...] = (), options: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The rows a command takes, in the table's order: every row of ``groups`` and of ``output`` (every command's)
    that is not ``by_name``, less ``without``, and the rows named in ``options`` (a variant takes the place of the
    row it stands ``instead`` of). ValueError naming what is wrong: an unknown group, a ``without`` that is not a
    row of them, an option that is no row, or one the groups give already."""
    wrong = [g for g in groups if g not in GROUPS]
    names = {row.name for row in ROWS.values() if row.group in (*groups, "output") and not row.by_name}
    wrong += [n for n in without if n not in names]
    wrong += [n for n in options if n not in ROWS or n in names]
    if wrong:
        raise ValueError(f"{wrong}: a group of {GROUPS}, `without` a row of its groups, `options` rows they do not give")
    names = (names - set(without)) | set(options)
    names -= {ROWS[n].instead for n in options}
    return tuple(n for n in ROWS if n in names)


# the launch rows that give the server's launch (``launching.launch_input``); the others set request fields
LAUNCH = tuple(n for n in group("launch") if ROWS[n].field is None)


def spelling(row: Row) -> str:
    """The row's first spelling (``--tp-size``), as its help lists it and messages name it."""
    info = row.type.__metadata__[0]  # in ``Annotated``, Typer's first positional is the first spelling
    return info.default if isinstance(info.default, str) and info.default.startswith("-") else row.name


HIDDEN_ALIASES = {row.old: spelling(row) for row in ROWS.values() if row.old}  # old spelling -> new


def existing_cache_dir(root: Path) -> Path:
    """The cache root a command reads (``ServerRequest.cache_root``), which must be an existing directory (InputError
    otherwise, exit 2)."""
    from exl3tool.errors import InputError

    if not root.exists():
        raise InputError(f"cache directory {root} does not exist (check --cache-dir, VLLM_EXL3_ONLINE_CACHE_DIR, "
                         "--server-release or the launch)")
    if not root.is_dir():
        raise InputError(f"cache directory {root} is not a directory (check --cache-dir or VLLM_EXL3_ONLINE_CACHE_DIR)")
    return root
