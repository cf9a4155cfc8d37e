"""The launch options every request-building command shares (``--launch``, ``--pid``, ``--env-file``, the argv after
``--``), the command class that takes that argv, and the thin glue from options to ``exl3tool.launch``."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from exl3tool.cli.commands.group import Exl3Command
from exl3tool.errors import ConfigError
from exl3tool.cli.output import Output

__all__ = ["LaunchOpt", "LaunchFileOpt", "ComposeOpt", "ServiceOpt", "ImageOpt", "ImageInspectOpt", "ImageRootOpt", "PidOpt",
           "EnvFileOpt", "LaunchCommand", "launch_input", "launch_argv", "given_fields", "apply_options",
           "launch_json", "lookup_off", "MODEL_HELP"]

LaunchOpt = Annotated[
    Optional[str],
    typer.Option(
        "--launch", metavar="COMMAND",
        help="The server's launch, one shell-quoted string: `vllm serve MODEL ...`, `python -m "
        "vllm.entrypoints.openai.api_server ...`, wrapped (`setsid ./run vllm serve ...`, `env A=1 ...`), or `docker "
        "run`/`podman run ... IMAGE ...`. Its model, revision, TP size, dtype, --quantization-config, environment "
        "(VLLM_EXL3_*, cache root) and volumes (paths as the server sees them) give the settings; this command's own "
        "flags win. Also: the server's argv after `--`.",
    ),
]
LaunchFileOpt = Annotated[
    Optional[str],
    typer.Option(
        "--launch-file", metavar="FILE",
        help="The server's launch script (run.sh, a launcher serve-*.sh), run by this machine's bash in a read-only "
        "sandbox (no network, nothing written, the server's command recorded, not run; docs/launch.md); or a "
        "launcher's DRY_RUN=1 output (KEY=%q lines and a Command: line).",
    ),
]
ComposeOpt = Annotated[
    Optional[str],
    typer.Option(
        "--compose", metavar="FILE",
        help="A docker compose file: the server's service (image, entrypoint, command, environment, env_file, "
        "volumes, working_dir), ${VAR} interpolated from this environment and the project's .env, as docker compose "
        "applies them.",
    ),
]
ServiceOpt = Annotated[
    Optional[str],
    typer.Option("--service", metavar="NAME",
                 help="The --compose service that runs the server (default: the only one that runs vllm)."),
]
ImageOpt = Annotated[
    Optional[str],
    typer.Option(
        "--image", metavar="NAME",
        help="The server's image: its ENV (below the launch's -e), labels and entrypoint, read with `docker|podman "
        "image inspect` (never pulled), else --image-inspect, else exl3tool's table of the fork's published images "
        "(docs/images.md). Also the image a parity probe may run the encoder in.",
    ),
]
ImageInspectOpt = Annotated[
    Optional[str],
    typer.Option(
        "--image-inspect", metavar="FILE",
        help="The server image's settings as saved by `docker image inspect NAME > FILE` where the image is (no "
        "runtime needed here); wins over inspecting the image here.",
    ),
]
ImageRootOpt = Annotated[
    Optional[str],
    typer.Option(
        "--image-root", metavar="DIR",
        help="The server image's files: a mounted or unpacked image root (`podman image mount IMAGE`), or its vllm "
        "package folder. The fork modules there (exl3_online_cache.py, exl3.py) give the release's rules, over its "
        "labels (a patched image keeps its release's labels; docs/releases.md).",
    ),
]
PidOpt = Annotated[
    Optional[int],
    typer.Option("--pid", metavar="PID",
                 help="A running server's process: its command line and environment are read from /proc/PID."),
]
EnvFileOpt = Annotated[
    list[str],
    typer.Option("--env-file", metavar="FILE",
                 help="The server's environment in Docker's env-file format (NAME=VALUE lines); repeatable. Below the "
                 "launch's own -e/--env-file, above this process's environment."),
]
MODEL_HELP = ("Hub repo id or local checkpoint directory (here). With --launch/--pid it defaults to the launch's "
              "model; given, it is the copy read here and the launch's path is the server's.")
_ARGV_KEY = "exl3tool.launch_argv"


class LaunchCommand(Exl3Command):
    """A command whose words after ``--`` are the server's launch (``exl3tool cache warm -- vllm serve M -tp 2``)."""

    def parse_args(self, ctx, args):
        if "--" in args:
            at = args.index("--")
            ctx.meta[_ARGV_KEY] = tuple(args[at + 1:])
            args = args[:at]
        return super().parse_args(ctx, args)


def launch_argv(ctx: typer.Context) -> Optional[tuple[str, ...]]:
    """The server's argv given after ``--`` (None when there was no ``--``)."""
    return ctx.meta.get(_ARGV_KEY)


def launch_input(ctx: typer.Context, launch: Optional[str], pid: Optional[int], env_files: list[str]):
    """The command's launch options as one ``LaunchInput``."""
    from exl3tool.launch import LaunchInput

    argv = ctx.meta.get(_ARGV_KEY)
    if launch is not None and not launch.strip():  # `--launch "$(cat missing.txt)"` in CI: never planned as "no launch"
        raise typer.BadParameter("the launch is empty; give the server's command line (vllm serve MODEL ...), or leave "
                                 "--launch out", param_hint="'--launch'")
    if argv is not None and not argv:
        raise typer.BadParameter("nothing after `--`: give the server's command line there (vllm serve MODEL ...)")
    params = ctx.params  # the launch forms every launch-taking command declares beside --launch
    return LaunchInput(text=launch, argv=argv, pid=pid, env_files=tuple(env_files), file=params.get("launch_file"),
                       compose=params.get("compose"), service=params.get("service"), image=params.get("image"),
                       image_inspect=params.get("image_inspect"), image_root=params.get("image_root"))


def given_fields(ctx: typer.Context, fields: dict[str, str]) -> set[str]:
    """ServerRequest field names whose option (``fields``: parameter name -> field) was given on the command line."""
    out = set()
    for param, name in fields.items():
        source = ctx.get_parameter_source(param)
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT", "PROMPT"):
            out.add(name)
    return out


def launch_json(settings) -> dict:
    """The ``settings`` and ``launch`` keys a command adds to its ``--json`` when a launch was given."""
    if settings is None:
        return {}
    data = settings.as_json()
    return {"settings": data.pop("settings"), "launch": data}


def apply_options(ctx: typer.Context, out: Output, request, launch: Optional[str], pid: Optional[int],
                  env_files: list[str], given: set[str], *, add_tp_sizes: bool = False,
                  need_cache: bool = True, no_lookup: str = "refuse"):
    """Fill ``request`` from the launch (the given options win) and say on stderr where each setting came from.

    ``request`` and ``given`` (the fields the command line set, which win) come from ``options.request_from_options``.
    Returns ``(request, settings or None, the server's environment or None)``; a command without MODEL and without
    a launch is a usage error. A launch whose server makes no look-up (``settings.lookup_off``) is, by
    ``no_lookup``: ``"refuse"`` a usage error (nothing to encode or verify for it: exit 2), ``"report"`` left to
    the command (``cache check`` reports it as a finding), ``"warn"`` said on stderr (``identity``), ``"ignore"``
    nothing (``hydrate``: the checkpoint it writes is loaded whatever the server's cache does, and a release that
    encodes nothing online is what it is for).
    """
    from exl3tool.launch import apply_launch

    li = launch_input(ctx, launch, pid, env_files)
    if li.image_inspect is not None and not li.image and not li.launch_given:
        raise typer.BadParameter("--image-inspect FILE is the saved inspect document of the server's image: give "
                                 "--image NAME or a docker/podman launch with it", param_hint="'--image-inspect'")
    if not li.launch_given and not request.model:
        raise typer.BadParameter("give MODEL, or the server's launch with --launch COMMAND, --launch-file FILE, "
                                 "--compose FILE, --pid PID or -- ARGV",
                                 param_hint="'MODEL'")
    request, settings, environ = apply_launch(request, given, li, add_tp_sizes=add_tp_sizes,
                                              need_cache=need_cache)
    choice = request.release_choice
    if settings is None and choice.source not in ("default", "--server-release"):
        out.note(choice.describe())  # a launch lists it with its settings
    if settings is None:
        for line in choice.unknown:  # a launch's are among its warnings
            out.warn(line)
    if settings is None and li.image:  # no launch: the image's ENV is the server's environment
        from exl3tool.launch.request import launch_image

        image = launch_image(li, None)
        for line in (image.describe(), *image.notes) if image is not None else ():
            out.note(line)
    if settings is not None:
        out.note(f"launch ({settings.launch.form}, {settings.launch.entry}): the look-up's settings and where each "
                 "came from:")
        for line in settings.lines():
            out.note(f"  {line}")
        for line in settings.defaulted:
            out.warn(f"defaulted: {line}")
        for line in settings.warnings:
            out.warn(line)
        for line in settings.notes:
            out.note(line)
        ignored = list(settings.launch.ignored) + list(settings.launch.args.ignored)
        if ignored:
            out.note("ignored (no effect on a look-up): " + "; ".join(ignored))
    off = lookup_off(settings, environ) if no_lookup != "ignore" else ()
    if off:
        why = "; ".join(off)
        what = "launch" if settings is not None else "environment"
        if no_lookup == "refuse":
            raise ConfigError(f"this {what} makes no cache look-up, so nothing would read what this command "
                              f"writes or checks: {why}")
        if no_lookup == "warn":
            for line in off:
                out.warn(f"no look-up: {line}")
            if not request.encoder_root:
                raise ConfigError(f"this {what} makes no cache look-up ({why}) and names no encoder, so there "
                                  "is no encoder identity to show; pass --encoder-root")
    return request, settings, environ


def lookup_off(settings, environ) -> tuple[str, ...]:
    """Why the server makes no look-up: its launch's reasons, or without a launch this environment's (the
    ``--env-file`` variables over it)."""
    from exl3tool.launch.request import environment_lookup_off

    return settings.lookup_off if settings is not None else environment_lookup_off(environ)
