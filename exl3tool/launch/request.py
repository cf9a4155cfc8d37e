"""A command's request filled from the server's launch: the one place every command takes ``--launch`` from."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Optional

from exl3tool.errors import ConfigError
from exl3tool.launch.env import EnvLayers, read_env_file
from exl3tool.launch.image import ImageSettings, image_settings, same_image
from exl3tool.launch.load import load_launch
from exl3tool.launch.resolve import Explicit, LaunchSettings, ServerLaunch, resolve_cache_root, resolve_launch
from exl3tool.plan.request import ServerRequest

__all__ = ["LaunchInput", "apply_launch", "EXPLICIT_FIELDS", "launch_image", "environment_lookup_off"]

# ServerRequest fields a command's own flags can give (and so win over the launch)
EXPLICIT_FIELDS = ("model", "revision", "server_path", "tp_sizes", "dtype", "bits", "quantization_config",
                   "encoder_root", "encoder_revision", "encoder_source", "cache_dir", "server_release")


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
    image: Optional[str] = None  # --image NAME: the server's image (its ENV, labels, entrypoint)
    image_inspect: Optional[str] = None  # --image-inspect FILE: that image's saved `docker image inspect`
    image_root: Optional[str] = None  # --image-root DIR: the image's files (its fork modules give the release)
    image_archive: Optional[str] = None  # --image-archive FILE: the saved image (its settings and its files)

    @property
    def saved_image(self) -> Optional[str]:
        """The file the image's settings are read from: ``--image-inspect``, else ``--image-archive``."""
        return self.image_inspect or self.image_archive

    @property
    def launch_given(self) -> bool:
        return (bool(self.text) or bool(self.argv) or self.pid is not None or self.file is not None
                or self.compose is not None)

    @property
    def any_given(self) -> bool:
        """A launch, or what gives the server's environment or release without one (``--env-file``, ``--image``,
        ``--image-inspect``, ``--image-root``, ``--service``)."""
        return (self.launch_given or bool(self.env_files) or self.image is not None or self.image_inspect is not None
                or self.image_root is not None or self.service is not None)


def _env_only(request: ServerRequest, given: Collection[str], files: tuple[str, ...],
              environ: Mapping[str, str], image: Optional[ImageSettings] = None,
              cache_only: bool = False) -> tuple[ServerRequest, dict[str, str]]:
    """``--env-file`` / ``--image`` without a launch: the files' variables over the image's ENV over ours, for the
    server's settings (``cache_only``: the bits are not read)."""
    from exl3tool.cache.settings import server_bits

    merged = dict(environ)
    if image is not None:
        merged.update(image.env)
    for path in files:
        merged.update({k: v.value for k, v in read_env_file(path, environ=environ).items()})
    if cache_only:
        return request, merged
    return replace(request, bits=server_bits(request.bits if "bits" in given else None, merged)), merged


def environment_lookup_off(environ: Optional[Mapping[str, str]] = None) -> tuple[str, ...]:
    """Without a launch, this environment is the server's: why a server started in it makes no look-up (its
    ``VLLM_EXL3_ONLINE_CACHE_MODE=off``), as ``LaunchSettings.lookup_off`` says it for a launch; () when it makes
    some. A value the server refuses is a ConfigError naming it, as it is in a launch."""
    from exl3tool.cache.settings import cache_mode

    if cache_mode(os.environ if environ is None else environ) == "off":
        return ("VLLM_EXL3_ONLINE_CACHE_MODE=off in this environment: the server encodes every layer at start-up "
                "and never reads the cache (unset it, or give the server's launch with --launch)",)
    return ()


def apply_launch(request: ServerRequest, given: Collection[str], launch: LaunchInput, *, add_tp_sizes: bool = False,
                 environ: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None, need_cache: bool = True,
                 cache_only: bool = False) -> tuple[ServerRequest, Optional[LaunchSettings], Optional[dict[str, str]]]:
    """``request`` with the launch's settings where the command's own flags (``given``: ServerRequest field names set
    on the command line) did not set them; also the settings with their sources and the server's environment.

    ``add_tp_sizes`` (``cache warm``): the launch's TP size comes first and ``--tp-size``, when given, adds more;
    otherwise a given ``--tp-size`` wins over the launch's. Without a launch the request is returned as is (with
    ``--env-file`` variables applied). ``need_cache`` False: a command that writes and reads no cache (``identity``).
    ``cache_only`` (the cache commands): only the release and the cache root are taken from the launch
    (``resolve_cache_root``); the request's other fields stay as given.

    Args:
        request: the request built from the command's flags.
        given: the ServerRequest field names the command line set.
        launch: the launch forms a command was given (``LaunchInput``).
        add_tp_sizes, environ, cwd, need_cache, cache_only: as described above.

    Returns:
        ``(request, settings, server_environ)``: the filled request, the launch's ``LaunchSettings`` (None without a
        launch) and the server's environment (None without one).
    """
    environ = os.environ if environ is None else environ
    for a, b in (("image_inspect", "image_archive"), ("image_root", "image_archive")):
        if getattr(launch, a) is not None and getattr(launch, b) is not None:
            raise ConfigError(f"--{a.replace('_', '-')} and --{b.replace('_', '-')} both give the image's "
                              f"{'settings' if a == 'image_inspect' else 'files'}: give one")
    if launch.image_archive is not None:
        from exl3tool.launch.forkfiles import is_image_archive, read_image_archive

        if not is_image_archive(launch.image_archive):  # missing, a folder, an inspect document: named as such
            read_image_archive(launch.image_archive)
            raise ConfigError(f"--image-archive {launch.image_archive}: not a tar archive (give the file `docker "
                              "save IMAGE -o FILE` writes)")
    if not launch.launch_given:
        if launch.service is not None:
            raise ConfigError("--service names a service of a compose file: give --compose FILE with it")
        image = image_settings(launch.image, launch.saved_image) if launch.image or launch.saved_image else None
        if not launch.env_files and image is None:
            from exl3tool.cache.settings import server_bits

            # what prepare() would decide: resolved here so a bad variable fails before any other check
            if not cache_only:
                request = replace(request, bits=server_bits(request.bits, environ))
            return _with_release(request, given, None, _modules(launch, None)), None, None
        request, merged = _env_only(request, given, launch.env_files, environ, image, cache_only)
        if image is not None:
            request = replace(request, encoder_image=image.name or None)
        return _with_release(request, given, image, _modules(launch, None)), None, merged
    loaded = load_launch(text=launch.text, argv=launch.argv, pid=launch.pid, env_files=launch.env_files,
                         environ=environ, cwd=cwd, file=launch.file, compose=launch.compose, service=launch.service,
                         image_inspect=launch.saved_image)
    assert loaded is not None
    server, layers = _with_image(*loaded, launch)
    explicit = Explicit(**{f: getattr(request, f) for f in EXPLICIT_FIELDS if f in given})
    if cache_only:
        settings = resolve_cache_root(server, layers, explicit, modules=_modules(launch, server))
        return (replace(request, cache_dir=settings.cache_dir, server_release=settings.release), settings,
                settings.environ)
    settings = resolve_launch(server, layers, explicit, need_cache=need_cache, modules=_modules(launch, server))
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
        hf_overrides=settings.hf_overrides, encoder_image=server.image_name or None,
        encoder_image_runner=server.form if server.form in ("docker", "podman") else None,
        server_release=settings.release,
    )
    return out, settings, settings.environ


def _modules(launch: LaunchInput, server: Optional[ServerLaunch]):
    """The fork modules of the server's image where its files can be read: ``--image-root DIR`` (required to hold a
    vllm package), ``--image-archive FILE`` (the saved image's layers; the same), else a ``--pid`` server's own
    root (``/proc/PID/root``, when it holds one); else None."""
    from exl3tool.launch.forkfiles import read_fork_modules, read_image_archive

    if launch.image_root is not None:
        return read_fork_modules(launch.image_root)
    if launch.image_archive is not None:
        name = launch.image or (server.image_name if server is not None and server.image_name else None)
        saved = read_image_archive(launch.image_archive, name, same_image)
        if saved.modules is None:
            image = f"the image {saved.names[0]}" if saved.names else "the image"
            raise ConfigError(f"--image-archive {launch.image_archive}: {image} holds no vllm package in its "
                              f"{saved.layers} layer(s) (looked under /opt/venv, /usr/local/lib, /opt/conda, "
                              "/usr/lib/python3 ...): save the image the server runs")
        return saved.modules
    root = getattr(getattr(server, "paths", None), "root", None) if server is not None else None
    if server is not None and server.form == "pid" and root:
        try:
            return read_fork_modules(root, required=False)
        except ConfigError:  # its files are not readable from here: the release comes from its labels, as said
            return None
    return None


def _with_release(request: ServerRequest, given: Collection[str], image: Optional[ImageSettings],
                  modules) -> ServerRequest:
    """Without a launch: the release from ``--server-release``, else the image's files, else its labels (the one
    rule, ``exl3tool.releases.resolve_release``)."""
    from exl3tool.releases import resolve_release

    if "server_release" in given or (image is None and modules is None):
        return request
    table = image.release if image is not None and image.source == "published-images table" else ""
    choice = resolve_release(None, dict(image.labels) if image is not None else {},
                             image=image.name if image is not None else "", table_release=table, modules=modules)
    return replace(request, server_release=choice)


def _with_image(server: ServerLaunch, layers: EnvLayers, launch: LaunchInput) -> tuple[ServerLaunch, EnvLayers]:
    """The launch with ``--image`` / ``--image-inspect`` applied: a container launch's image read from the saved
    inspect document (its ENV replacing what was read for it), or the image a host command or a compose service
    runs in (its ENV the lowest layer; this process's environment is then not the server's)."""
    if not launch.image and not launch.saved_image:
        return server, layers
    container = server.form in ("docker", "podman")
    if container and launch.image and server.image_name and not same_image(launch.image, server.image_name):
        raise ConfigError(f"--image {launch.image}: the launch runs the image {server.image_name}; give one image "
                          "(drop --image, or fix the launch)")
    name = server.image_name if container else (launch.image or "")
    runner = server.form if container else None
    image = image_settings(name, launch.saved_image, runner)
    if server.form == "pid":  # its environment is the process's own, the image's ENV included
        return replace(server, image=image, image_name=image.name), layers
    own = {k: v for k, v in server.env.items() if not v.detail.startswith("ENV of the image ")}
    env = {**image.env_values(), **own}
    server = replace(server, env=env, image=image, image_name=image.name, image_note="", process_env=False)
    return server, EnvLayers(env, layers.files, None, container=True)


def launch_image(launch: LaunchInput, settings: Optional[LaunchSettings]) -> Optional[ImageSettings]:
    """The server's image as ``apply_launch`` read it (``settings.image`` with a launch; ``--image`` without one),
    or None: where its labels are read (a server release is picked from ``local-inference.vllm.integration.tree``)."""
    if settings is not None:
        return settings.image
    if launch.image or launch.saved_image:
        return image_settings(launch.image, launch.saved_image)  # read again: the runtime's answer is cached
    return None
