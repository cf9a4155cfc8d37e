"""Options that do nothing in a command's mode are refused, never ignored: the table of those modes, and the check.

A command with modes (``cache import`` with or without ``--against``, ``verify`` of a cache or of a hydrated
checkpoint, ``cache check`` of one launch or of a fleet's identities) takes options that only one mode reads. Given
in the other, such an option would change nothing while the user believes it did (``cache import --bits 4`` without
``--against`` imported every entry whatever its bits). ``MODE_RULES`` lists, per command and mode, the options that
mode does not read; ``refuse_unused`` turns any of them given on the command line into one usage error (exit 2)
naming it and the mode. ``tests/cli/test_modes.py`` walks every option of these commands: each is read in the mode
or refused there.
"""

from __future__ import annotations

import typer

__all__ = ["MODE_RULES", "MODE_FIX", "refuse_unused"]

_LAUNCH = ("launch", "pid", "env_file", "launch_file", "compose", "service", "image", "image_inspect", "image_root")
_PLAN = ("revision", "bits", "layers", "exclude", "shared_experts", "quantization_config", "encoder_root",
         "encoder_revision", "encoder_source", "server_path")

# (command, mode) -> parameters the mode does not read (refused when given); the mode reads every other option
MODE_RULES: dict[tuple[str, str], tuple[str, ...]] = {
    # the import checks nothing against a model: the plan options and the encode's device mean nothing;
    # --server-release stays (it picks the cache root)
    ("cache import", "without --against"): ("exact", *_PLAN, "dtype", "device"),
    # a hydrated checkpoint against its SOURCE: no cache, no plan, no launch (verify_hydrated reads the stored
    # modules the hydrate recorded, at TP 1, with the bits it recorded); --exact compares cache entries only
    ("verify", "with --against"): ("exact", "tp_size", "tp_rank", *_PLAN, "cache_dir", "server_release", *_LAUNCH),
    # the fleet's identity documents are compared, nothing is planned
    ("cache check", "with --nodes"): ("model", *_PLAN, "tp_sizes", "cache_dir", "dtype", "server_release", *_LAUNCH),
    # a cache command's release only picks the cache root, which --cache-dir gives
    **{(command, "with --cache-dir"): ("server_release",)
       for command in ("cache ls", "cache show", "cache verify", "cache prune", "cache export")},
    ("cache import", "with --cache-dir and without --against"): ("server_release",),
}
# what to do instead, per mode (the end of the one-line error)
MODE_FIX: dict[tuple[str, str], str] = {
    ("cache import", "without --against"): "drop it, or give --against MODEL to check the entries against MODEL's "
                                           "plan",
    ("verify", "with --against"): "drop it (the hydrated checkpoint's stored layers are compared with SOURCE's "
                                  "weights, no cache), or verify the cache without --against",
    ("cache check", "with --nodes"): "drop it (--nodes compares the identity documents given), or check one launch "
                                     "without --nodes",
    **{(command, "with --cache-dir"): "the release only picks the server's cache root, which --cache-dir gives: "
                                      "drop one of them"
       for command in ("cache ls", "cache show", "cache verify", "cache prune", "cache export")},
    ("cache import", "with --cache-dir and without --against"): "the release only picks the server's cache root, "
                                                                "which --cache-dir gives: drop one of them",
}


def _flag(ctx: typer.Context, param: str) -> str:
    for p in ctx.command.params:
        if p.name == param:
            return max(p.opts, key=len) if p.param_type_name == "option" else (p.metavar or p.name.upper())
    return "--" + param.replace("_", "-")


def refuse_unused(ctx: typer.Context, command: str, mode: str) -> None:
    """A usage error (exit 2) naming the options given on the command line that ``mode`` of ``command`` does not
    read (``MODE_RULES``); nothing when none was given. The server's argv after ``--`` counts as ``--launch``."""
    from exl3tool.cli.commands.launching import launch_argv

    given = []
    for param in MODE_RULES[(command, mode)]:
        source = ctx.get_parameter_source(param)
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT", "PROMPT"):
            given.append(_flag(ctx, param))
    if "launch" in MODE_RULES[(command, mode)] and launch_argv(ctx) is not None:
        given.append("-- ARGV")
    if given:
        fix = MODE_FIX[(command, mode)]
        verb, fix = ("does", fix) if len(given) == 1 else ("do", fix.replace("drop it", "drop them"))
        raise typer.BadParameter(f"{', '.join(given)} {verb} nothing {mode}: {fix}",
                                 param_hint=given[0] if given[0].startswith("--") else None)
