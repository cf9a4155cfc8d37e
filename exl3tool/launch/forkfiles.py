"""The fork's modules as a server's image holds them: where its rules come from when the image can be read.

An image's labels name the release it was built from, but an image that replaces one of the fork's files (the
``gg-r34-patched`` images swap r34's ``exl3.py`` for PR #312's) keeps them. Where the image's files can be read,
exl3tool takes the rules from the files themselves (``exl3tool.releases.resolve_release`` with ``ForkModules``):

* a mounted root filesystem or an unpacked image folder, ``--image-root DIR`` (``podman image mount IMAGE``, or
  ``docker export $(docker create IMAGE) | tar -x -C DIR``); DIR may also be the ``vllm`` package folder itself, or
  the ``site-packages`` folder holding it;
* the root of a running server, ``/proc/PID/root`` (``--pid`` of a server in a container).

The vLLM package is looked for where the fork's images and the usual Python layouts install it; links are
followed as the image would follow them (``cache.serverfs``: an absolute link means the image's path, never this
machine's), and only the two files are read: ``vllm/model_executor/layers/quantization/exl3_online_cache.py`` and
``exl3.py`` (their git blobs name a release's version; ``exl3.py``'s text names its rule for unaligned shards).
"""

from __future__ import annotations

import os
import posixpath
from typing import Optional

from exl3tool.cache.serverfs import server_realpath
from exl3tool.errors import ConfigError
from exl3tool.releases import ForkModules, git_blob

__all__ = ["read_fork_modules", "VLLM_PREFIXES"]

_QUANT = "model_executor/layers/quantization"
_PY = tuple(f"python3.{n}" for n in range(14, 7, -1))
# where images install the vllm package (the fork's: /opt/venv, Python 3.12; upstream vllm-openai: /usr/local ...)
VLLM_PREFIXES = (
    *(f"/opt/venv/lib/{py}/site-packages" for py in _PY),
    *(f"/usr/local/lib/{py}/dist-packages" for py in _PY),
    *(f"/usr/local/lib/{py}/site-packages" for py in _PY),
    *(f"/opt/conda/lib/{py}/site-packages" for py in _PY),
    *(f"/root/.venv/lib/{py}/site-packages" for py in _PY),
    "/usr/lib/python3/dist-packages", "/workspace/vllm", "/vllm-workspace", "/opt/vllm", "/app/vllm",
)
_MAX_BYTES = 4 << 20  # exl3.py is ~270 kB; anything far larger is not the fork's module


class _Root:
    """The image's paths under a root folder here (no mounts: everything is in the image)."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") or "/"

    def to_host(self, path: str) -> Optional[str]:
        return self.root + path if self.root != "/" else path

    def mount_points(self) -> tuple[str, ...]:
        return ()


def _read(view: _Root, path: str) -> Optional[bytes]:
    """The bytes of the image's ``path`` (links followed in the image); None when the image has no such file. A file
    that is there but cannot be read (permissions, far too large for the module) is a ConfigError naming it: taken
    as absent, it would turn an image that encodes online into one that does not."""
    try:
        here = view.to_host(server_realpath(view, path, "the image's vllm module"))
    except ConfigError:
        return None  # a loop of links, or a part exl3tool cannot reach: no file there
    if here is None or not os.path.exists(here):
        return None
    if not os.path.isfile(here):
        raise ConfigError(f"{here}: not a regular file where the image's {posixpath.basename(path)} should be")
    try:
        with open(here, "rb") as fh:
            data = fh.read(_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{here}: cannot read the image's {posixpath.basename(path)} ({exc.strerror or exc})") from None
    if len(data) > _MAX_BYTES:
        raise ConfigError(f"{here}: over {_MAX_BYTES >> 20} MiB, not the fork's {posixpath.basename(path)}")
    return data


def _package(view: _Root, package: str) -> Optional[ForkModules]:
    exl3 = _read(view, f"{package}/{_QUANT}/exl3.py")
    cache = _read(view, f"{package}/{_QUANT}/exl3_online_cache.py")
    init = _read(view, f"{package}/__init__.py")
    if exl3 is None and (init is None or _read(view, f"{package}/{_QUANT}/__init__.py") is None):
        return None  # not a vllm package here
    where = view.to_host(package) or package
    return ForkModules(where, git_blob(cache) if cache is not None else None,
                       git_blob(exl3) if exl3 is not None else None,
                       exl3.decode("utf-8", "replace") if exl3 is not None else "")


def read_fork_modules(root: str, *, required: bool = True) -> Optional[ForkModules]:
    """The fork's modules under ``root``: a root filesystem (the vllm package looked for in ``VLLM_PREFIXES``), a
    ``site-packages`` folder, or the ``vllm`` package folder itself.

    None when no vllm package is there and not ``required``; a ConfigError naming ``root`` and where it looked when
    ``required`` (``--image-root``), or when two packages with different modules are found (which one the server
    imports is the image's Python's choice: give the package folder).
    """
    if not os.path.isdir(root):
        if not required:
            return None
        raise ConfigError(f"--image-root {root}: not a folder (give a mounted image root, an unpacked image, or its "
                          "vllm package folder)")
    view = _Root(os.path.abspath(root))
    for package in ("/", "/vllm"):  # the package folder itself, or a site-packages folder
        found = _package(view, package.rstrip("/") or "")
        if found is not None:  # a vllm package, with or without EXL3 support
            return found
    hits: list[ForkModules] = []
    for prefix in VLLM_PREFIXES:
        found = _package(view, posixpath.join(prefix, "vllm"))
        if found is not None and all(h.where != found.where for h in hits):
            hits.append(found)
    distinct = {(h.cache_blob, h.exl3_blob) for h in hits}
    if len(distinct) > 1:
        raise ConfigError(f"{root} holds {len(hits)} vllm packages with different EXL3 modules ("
                          f"{', '.join(h.where for h in hits[:3])}): give the one the server imports as --image-root")
    if hits:
        return hits[0]
    if required:
        raise ConfigError(f"--image-root {root}: no vllm package there (looked for vllm/{_QUANT} in the folder, and "
                          "under /opt/venv, /usr/local/lib, /opt/conda, /usr/lib/python3 ...): give the image's root, "
                          "its site-packages folder or the vllm package folder")
    return None
