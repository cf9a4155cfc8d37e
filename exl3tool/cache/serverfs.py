"""The server's filesystem seen from here: its paths mapped to ours, and ``realpath`` as the server computes it.

A server in a container (or a chroot, or read through ``/proc/PID/root``) resolves its model path with its own
mount table: ``/models/current -> v2`` is relative to the container's ``/models``, and a link to ``/weights/x``
means the container's ``/weights``, whatever is at ``/weights`` here. The kernel cannot do that walk for us (an
absolute link met through ``/proc/PID/root`` resolves against *our* root), so ``server_realpath`` walks the path one
component at a time, reads each link through the view and interprets its text in the server's namespace.
"""

from __future__ import annotations

import os
import posixpath
from typing import Optional, Protocol

from exl3tool.errors import ConfigError

__all__ = ["ServerView", "server_realpath", "host_path", "seen_from_here"]

_MAX_LINKS = 40  # the kernel's limit on links followed in one walk (ELOOP beyond it)


class ServerView(Protocol):
    """How the server's absolute paths are reached here (``launch.container.PathMap`` is one)."""

    def to_host(self, path: str) -> Optional[str]:
        """Where the server's ``path`` is here, or None when it is inside an image exl3tool cannot see."""

    def mount_points(self) -> tuple[str, ...]:
        """The server's mount points: directories there whatever their source is here (docker resolves a linked
        ``-v`` source once, when it mounts it)."""


def host_path(view: ServerView, path: str, what: str) -> str:
    """``path`` here; ConfigError naming ``what`` when the server's path is not reachable from here."""
    here = view.to_host(path)
    if here is None:
        raise ConfigError(f"{what} {path} is inside the server's image (or its own empty root), not on a bind mount "
                          "exl3tool can read: mount it from the host (-v HOST_DIR:DIR), or run exl3tool where the "
                          "server runs")
    return here


def server_realpath(view: ServerView, path: str, what: str = "the server's path", *, unseen: str = "refuse") -> str:
    """``os.path.realpath(path)`` as the server computes it in its own filesystem (``path`` absolute).

    Like ``realpath`` (non-strict) a missing component is kept as it is; a loop of links is a ConfigError. A
    component the view cannot reach (inside the server's image) is a ConfigError naming it, and the link that led
    there if one did (a link that leaves the mounts: what it points at is not here); with ``unseen="keep"`` such a
    component reached by no link is kept as written (the image's own folders, whose links exl3tool cannot read:
    taken as none, as the callers that allow it say).
    """
    if not posixpath.isabs(path):
        raise ConfigError(f"{what} {path!r} is not absolute (internal: make it absolute in the server's view first)")
    mounts = {posixpath.normpath(m) for m in view.mount_points()}
    resolved = "/"
    rest = [c for c in path.split("/") if c]
    followed = 0
    via = ""  # the last link followed, as "LINK -> TARGET" (named when it leads out of what is here)
    while rest:
        part = rest.pop(0)
        if part == ".":
            continue
        if part == "..":
            resolved = posixpath.dirname(resolved)  # ``resolved`` holds no links, so its parent is textual
            continue
        candidate = posixpath.join(resolved, part)
        if candidate in mounts:
            resolved = candidate
            continue
        here = view.to_host(candidate)
        if here is None and any(m.startswith(candidate + "/") for m in mounts):
            resolved = candidate  # a mount point's parent in the image: a directory (the runtime made it)
            continue
        if here is None and via:
            raise ConfigError(f"{what} {path}: the link {via} leads to {candidate}, which is not on a bind mount of "
                              "the launch (inside the server's image or root, not here): what the server finds there "
                              "cannot be read; mount that folder, or point the link inside a mount")
        if here is None and unseen == "keep":
            resolved = candidate
            continue
        here = host_path(view, candidate, what if candidate == posixpath.normpath(path) else f"{what} {path}: its part")
        if not os.path.islink(here):
            resolved = candidate
            continue
        followed += 1
        if followed > _MAX_LINKS:
            raise ConfigError(f"{what} {path}: more than {_MAX_LINKS} symbolic links on the way (a loop); the server "
                              "fails to resolve it too")
        target = os.readlink(here)
        via = f"{candidate} -> {target}"
        if target.startswith("/"):
            resolved = "/"
        rest = [c for c in target.split("/") if c] + rest
    return resolved


def seen_from_here(view: ServerView, path: str, what: str) -> Optional[str]:
    """Where the server's ``path`` is here once resolved as the server resolves it (its links read in its own
    view, never this machine's): None when it is inside the image (on no mount, reached by no link); a ConfigError
    naming the link when a link leads out of what is here."""
    resolved = server_realpath(view, path, what, unseen="keep")
    return view.to_host(resolved)
