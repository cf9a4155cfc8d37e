"""The thin glue from the launch rows (``--launch``, ``--launch-file``, ``--compose``, ``--pid``, ``--env-file``,
``--image``, the argv after ``--``) to ``exl3tool.launch``: the ``LaunchInput`` they give, the request filled from
it (each setting's source said on stderr), and the ``--json`` keys of a launch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import typer

from exl3tool.cli.commands.group import LAUNCH_ARGV
from exl3tool.cli.output import Output
from exl3tool.errors import ConfigError

if TYPE_CHECKING:
    from exl3tool.launch import LaunchInput

__all__ = ["launch_input", "apply_options", "launch_json", "lookup_off"]


def launch_input(ctx: typer.Context, launch: Optional[str], pid: Optional[int], env_file: list[str],
                 launch_file: Optional[str] = None, compose: Optional[str] = None, service: Optional[str] = None,
                 image: Optional[str] = None, image_inspect: Optional[str] = None,
                 image_root: Optional[str] = None, image_archive: Optional[str] = None) -> LaunchInput:
    """The command's launch rows (and the words after ``--``) as one ``LaunchInput``."""
    from exl3tool.launch import LaunchInput

    argv = ctx.meta.get(LAUNCH_ARGV)
    if launch is not None and not launch.strip():  # `--launch "$(cat missing.txt)"` in CI: never planned as "no launch"
        raise typer.BadParameter("the launch is empty; give the server's command line (vllm serve MODEL ...), or leave "
                                 "--launch out", param_hint="'--launch'")
    if argv is not None and not argv:
        raise typer.BadParameter("nothing after `--`: give the server's command line there (vllm serve MODEL ...)")
    return LaunchInput(text=launch, argv=argv, pid=pid, env_files=tuple(env_file or ()), file=launch_file,
                       compose=compose, service=service, image=image, image_inspect=image_inspect,
                       image_root=image_root, image_archive=image_archive)


def launch_json(settings) -> dict:
    """The ``settings`` and ``launch`` keys a command adds to its ``--json`` when a launch was given."""
    if settings is None:
        return {}
    data = settings.as_json()
    return {"settings": data.pop("settings"), "launch": data}


def apply_options(out: Output, request, li: LaunchInput, given: frozenset[str], *, add_tp_sizes: bool = False,
                  need_cache: bool = True, no_lookup: str = "refuse", cache_only: bool = False):
    """Fill ``request`` from the launch ``li`` (the fields in ``given``, which the command line set, win) and say on
    stderr where each setting came from (``command.Call.resolve``).

    Returns ``(request, settings or None, the server's environment or None)``; a command without MODEL and without
    a launch is a usage error, unless ``cache_only`` (the cache commands: the launch gives the release and the cache
    root, ``apply_launch``'s ``cache_only``). A launch whose server makes no look-up (``settings.lookup_off``) is, by
    ``no_lookup``: ``"refuse"`` a usage error (nothing to encode or verify for it: exit 2), ``"report"`` left to
    the command (``cache check`` reports it as a finding), ``"warn"`` said on stderr, with an encoder root required
    (``identity``), ``"say"`` said on stderr (``cache ls``), ``"ignore"`` nothing (``hydrate``: the checkpoint it
    writes is loaded whatever the server's cache does, and a release that encodes nothing online is what it is for).
    """
    from exl3tool.launch import apply_launch

    if li.image_inspect is not None and not li.image and not li.launch_given:
        raise typer.BadParameter("--image-inspect FILE is the saved inspect document of the server's image: give "
                                 "--image NAME or a docker/podman launch with it", param_hint="'--image-inspect'")
    if not li.launch_given and not request.model and not cache_only:
        raise typer.BadParameter("give MODEL, or the server's launch with --launch COMMAND, --launch-file FILE, "
                                 "--compose FILE, --pid PID or -- ARGV",
                                 param_hint="'MODEL'")
    request, settings, environ = apply_launch(request, given, li, add_tp_sizes=add_tp_sizes,
                                              need_cache=need_cache, cache_only=cache_only)
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
        if no_lookup in ("warn", "say"):
            for line in off:
                out.warn(f"no look-up: {line}")
            if no_lookup == "warn" and not request.encoder_root:
                raise ConfigError(f"this {what} makes no cache look-up ({why}) and names no encoder, so there "
                                  "is no encoder identity to show; pass --encoder-root")
    return request, settings, environ


def lookup_off(settings, environ) -> tuple[str, ...]:
    """Why the server makes no look-up: its launch's reasons, or without a launch this environment's (the
    ``--env-file`` variables over it)."""
    from exl3tool.launch.request import environment_lookup_off

    return settings.lookup_off if settings is not None else environment_lookup_off(environ)
