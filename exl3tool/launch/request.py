"""A command's request filled from the server's launch: the one place every command takes ``--launch`` from."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Optional

from exl3tool.errors import ConfigError
from exl3tool.launch.env import read_env_file
from exl3tool.launch.load import load_launch
from exl3tool.launch.resolve import Explicit, LaunchSettings, resolve_launch
from exl3tool.plan.request import WarmRequest

__all__ = ["LaunchInput", "apply_launch", "EXPLICIT_FIELDS", "environment_lookup_off"]

# WarmRequest fields a command's own flags can give (and so win over the launch)
EXPLICIT_FIELDS = ("model", "revision", "server_path", "tp_sizes", "dtype", "bits", "quantization_config",
                   "encoder_root", "encoder_revision", "encoder_source", "cache_dir")


@dataclass(frozen=True)
class LaunchInput:
    """A command's launch options: ``--launch TEXT``, the argv after ``--``, ``--pid PID``, ``--env-file FILE``s."""

    text: Optional[str] = None
    argv: Optional[tuple[str, ...]] = None
    pid: Optional[int] = None
    env_files: tuple[str, ...] = ()
    file: Optional[str] = None  # --launch-file
    compose: Optional[str] = None  # --compose FILE
    service: Optional[str] = None  # --service NAME (of --compose)

    @property
    def launch_given(self) -> bool:
        return (bool(self.text) or bool(self.argv) or self.pid is not None or self.file is not None
                or self.compose is not None)


def _env_only(request: WarmRequest, given: Collection[str], files: tuple[str, ...],
              environ: Mapping[str, str]) -> tuple[WarmRequest, dict[str, str]]:
    """``--env-file`` without a launch: the files' variables over ours, for the server's settings."""
    from exl3tool.cache.settings import trellis_bits

    merged = dict(environ)
    for path in files:
        merged.update({k: v.value for k, v in read_env_file(path, environ=environ).items()})
    if "bits" not in given:
        bits = trellis_bits(merged)
        if bits is not None:
            request = replace(request, bits=bits)
    return request, merged


def environment_lookup_off(environ: Optional[Mapping[str, str]] = None) -> tuple[str, ...]:
    """Without a launch, this environment is the server's: why a server started in it makes no look-up (its
    ``VLLM_EXL3_ONLINE_CACHE_MODE=off``), as ``LaunchSettings.lookup_off`` says it for a launch; () when it makes
    some. A value the server refuses is a ConfigError naming it, as it is in a launch."""
    from exl3tool.cache.settings import cache_mode

    if cache_mode(os.environ if environ is None else environ) == "off":
        return ("VLLM_EXL3_ONLINE_CACHE_MODE=off in this environment: the server encodes every layer at start-up "
                "and never reads the cache (unset it, or give the server's launch with --launch)",)
    return ()


def apply_launch(request: WarmRequest, given: Collection[str], launch: LaunchInput, *, add_tp_sizes: bool = False,
                 environ: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None, need_cache: bool = True,
                 ) -> tuple[WarmRequest, Optional[LaunchSettings], Optional[dict[str, str]]]:
    """``request`` with the launch's settings where the command's own flags (``given``: WarmRequest field names set
    on the command line) did not set them; also the settings with their sources and the server's environment.

    ``add_tp_sizes`` (``cache warm``): the launch's TP size comes first and ``--tp-size``, when given, adds more;
    otherwise a given ``--tp-size`` wins over the launch's. Without a launch the request is returned as is (with
    ``--env-file`` variables applied). ``need_cache`` False: a command that writes and reads no cache (``identity``).

    Args:
        request: the request built from the command's flags.
        given: the WarmRequest field names the command line set.
        launch: the launch forms a command was given (``LaunchInput``).
        add_tp_sizes, environ, cwd, need_cache: as described above.

    Returns:
        ``(request, settings, server_environ)``: the filled request, the launch's ``LaunchSettings`` (None without a
        launch) and the server's environment (None without one).
    """
    environ = os.environ if environ is None else environ
    if not launch.launch_given:
        if launch.service is not None:
            raise ConfigError("--service names a service of a compose file: give --compose FILE with it")
        if not launch.env_files:
            return request, None, None
        request, merged = _env_only(request, given, launch.env_files, environ)
        return request, None, merged
    loaded = load_launch(text=launch.text, argv=launch.argv, pid=launch.pid, env_files=launch.env_files,
                         environ=environ, cwd=cwd, file=launch.file, compose=launch.compose, service=launch.service)
    assert loaded is not None
    server, layers = loaded
    explicit = Explicit(**{f: getattr(request, f) for f in EXPLICIT_FIELDS if f in given})
    settings = resolve_launch(server, layers, explicit, need_cache=need_cache)
    tp_sizes: tuple[int, ...]
    if add_tp_sizes:
        extra = tuple(request.tp_sizes) if "tp_sizes" in given else ()
        tp_sizes = tuple(dict.fromkeys((settings.tp_size, *extra)))
    elif "tp_sizes" in given:
        tp_sizes = tuple(request.tp_sizes)
    else:
        tp_sizes = (settings.tp_size,)
    if request.tp_ranks is not None and any(r >= max(tp_sizes) for r in request.tp_ranks):
        raise ConfigError(f"--tp-rank {request.tp_ranks[0]} is outside 0..{max(tp_sizes) - 1} (the launch's TP size "
                          f"is {settings.tp_size})")
    out = replace(
        request, model=settings.model, server_path=settings.server_path, revision=settings.revision,
        tp_sizes=tp_sizes, bits=settings.bits, dtype=settings.dtype, quantization_config=settings.quantization_config,
        encoder_root=settings.encoder_root, encoder_revision=settings.encoder_revision,
        encoder_source=settings.encoder_source, cache_dir=settings.cache_dir or request.cache_dir,
        language_model_only=settings.language_model_only, server_view=settings.view,
        hf_overrides=settings.hf_overrides,
    )
    return out, settings, settings.environ
