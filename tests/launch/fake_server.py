"""A server's filesystem, for real: a child process in its own mount namespace, the launch's host folders
bind-mounted at the container's paths on an empty root, chrooted into it, as docker and podman start a server.

``in_server_view(rootfs, mounts, fn, *args)`` runs ``fn(*args)`` there and returns its result, so the tests'
independent server functions (``helpers.server_model_identity``, ``server_lookup``) see exactly the paths, links
and mounts the server sees: no exl3tool code, no path rewriting. Without mount namespaces (no root and no user
namespaces) the test is skipped.
"""

from __future__ import annotations

import ctypes
import os
import pickle
from pathlib import Path

import pytest

_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18


def _enter(rootfs: Path, mounts: dict[str, Path]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(_CLONE_NEWNS | (0 if uid == 0 else _CLONE_NEWUSER)) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    if uid != 0:  # be root in the new user namespace, mapped to ourselves
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
        Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    for inside, host in sorted(mounts.items()):  # parents first
        target = rootfs / inside.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        if libc.mount(str(host).encode(), str(target).encode(), None, _MS_BIND | _MS_REC, None) != 0:
            raise OSError(ctypes.get_errno(), f"mount --bind {host} {target}")
    os.chroot(rootfs)
    os.chdir("/")


def start_server(rootfs: Path, mounts: dict[str, Path], argv: list[str], env: dict[str, str]) -> int:
    """Start ``argv`` as a server in its own mount namespace, chrooted into ``rootfs`` with ``mounts``: a real
    process whose ``/proc/PID`` (root, mountinfo, ns/mnt) the kernel writes. The host's ``/usr``, ``/lib*``, ``/bin``
    and this Python are mounted read-only-in-spirit at their own paths so ``argv`` can run there. The caller kills
    it. Skips without mount namespaces."""
    import sys

    system = {p: Path(p) for p in ("/usr", "/lib", "/lib64", "/bin", sys.base_prefix, sys.prefix) if Path(p).is_dir()}
    rootfs.mkdir(parents=True, exist_ok=True)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            _enter(rootfs, {**system, **mounts})
            os.write(write, b"ok")
            os.close(write)
            os.execve(argv[0], argv, env)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(write, f"skip: {exc}".encode())
        finally:
            os._exit(1)
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        said = fh.read().decode()
    if said != "ok":
        os.waitpid(pid, 0)
        pytest.skip(f"mount namespaces are not available here ({said})")
    return pid


def in_server_view(rootfs: Path, mounts: dict[str, Path], fn, *args):
    """``fn(*args)`` in the server's filesystem: ``rootfs`` as ``/`` with ``mounts`` (container path -> host
    folder) bind-mounted. Its result comes back pickled; its exception is raised here as an AssertionError."""
    rootfs.mkdir(parents=True, exist_ok=True)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        try:
            try:
                _enter(rootfs, mounts)
            except OSError as exc:
                out = ("skip", f"mount namespaces are not available here ({exc})")
            else:
                try:
                    out = ("ok", fn(*args))
                except BaseException as exc:  # noqa: BLE001 - reported to the parent
                    out = ("error", f"{type(exc).__name__}: {exc}")
            with os.fdopen(write, "wb") as fh:
                fh.write(pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    if kind == "skip":
        pytest.skip(value)
    if kind == "error":
        raise AssertionError(f"in the server's view: {value}")
    return value
