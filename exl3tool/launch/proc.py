"""``--pid PID``: a running server's command line, environment, working directory and root, read from ``/proc``.

``/proc/PID/cmdline`` and ``/proc/PID/environ`` are what the process was started with (the environment includes
what an image's ``ENV`` set). vLLM's engine and worker processes rename themselves (``VLLM::EngineCore``); given
one of those, the parent chain is followed to the ``vllm serve`` process. A server with another root (docker and
podman pivot_root into a new mount namespace, where ``/proc/PID/root`` still reads ``/``; a chroot, where it reads the
chroot's path) has its bind mounts mapped to host paths from ``/proc/PID/mountinfo`` and ours (same device, the
mounted folder under a folder mounted here), and everything else read through ``/proc/PID/root``; links are
resolved in its view (``cache.serverfs``), never by the kernel from our root.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from exl3tool.errors import ConfigError
from exl3tool.launch.container import Mount

__all__ = ["ProcessLaunch", "MountInfo", "read_process", "parse_mountinfo", "host_mounts", "ancestors"]

_PROC = "/proc"


@dataclass(frozen=True)
class ProcessLaunch:
    """What ``/proc`` says of a process: its argv, environment, working directory and root (None when it is ours)."""

    pid: int
    argv: tuple[str, ...]
    environ: dict[str, str]
    cwd: Optional[str]
    root: Optional[str]  # "/proc/PID/root" when the process sees another filesystem root, else None
    mounts: tuple[Mount, ...] = ()  # its bind mounts with their host paths (another root only)


@dataclass(frozen=True)
class MountInfo:
    """One line of ``/proc/PID/mountinfo``: device, the mounted folder of that device, where, and read-only."""

    dev: str
    root: str
    point: str
    readonly: bool


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountInfo]:
    """The mounts of a ``mountinfo`` file (proc(5)); malformed lines are skipped."""
    out = []
    for line in text.splitlines():
        fields = line.split(" ")
        if len(fields) < 10 or "-" not in fields[6:]:
            continue
        out.append(MountInfo(fields[2], _unescape(fields[3]), _unescape(fields[4]), "ro" in fields[5].split(",")))
    return out


def host_mounts(theirs: list[MountInfo], ours: list[MountInfo], pid: int) -> tuple[Mount, ...]:
    """The process's mounts (its root excepted) with the path each has here: the same device mounted here at a
    folder that holds the mounted one (docker's and podman's bind mounts, a chroot's). A mount with no such
    folder here (a tmpfs, a named volume's device not mounted here) keeps no host path; it is read through
    ``/proc/PID/root``."""
    found: dict[str, Mount] = {}
    for m in theirs:
        if m.point == "/":
            continue
        best: Optional[MountInfo] = None
        for h in ours:
            inside = m.root == h.root or h.root == "/" or m.root.startswith(h.root.rstrip("/") + "/")
            if h.dev == m.dev and inside and (best is None or len(h.root) > len(best.root)):
                best = h
        host = None
        if best is not None:
            rel = os.path.relpath(m.root, best.root)
            host = os.path.normpath(best.point if rel == "." else os.path.join(best.point, rel))
        found[m.point] = Mount(host, m.point, f"/proc/{pid}/mountinfo: {m.point}", m.readonly)  # the last one is on top
    return tuple(found.values())


def _read(path: str, pid: int, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        raise ConfigError(f"--pid {pid}: no such process ({os.path.dirname(path)} does not exist)") from None
    except PermissionError:
        raise ConfigError(f"--pid {pid}: cannot read {path} ({what}): the process belongs to another user; run "
                          "exl3tool as that user or as root") from None
    except OSError as exc:
        raise ConfigError(f"--pid {pid}: cannot read {path} ({exc.strerror or exc})") from None


def _link(path: str) -> Optional[str]:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _mountinfo(path: str) -> list[MountInfo]:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as fh:
            return parse_mountinfo(fh.read())
    except OSError:
        return []


def _parent(pid: int, proc: str) -> int:
    stat = _read(f"{proc}/{pid}/stat", pid, "its status").decode("utf-8", "replace")
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state, past the (comm)


def ancestors(pid: int, *, proc: str = _PROC, depth: int = 6) -> list[tuple[int, tuple[str, ...]]]:
    """The process's parents, nearest first, with their command lines (as far as they can be read)."""
    out: list[tuple[int, tuple[str, ...]]] = []
    try:
        for _ in range(depth):
            pid = _parent(pid, proc)
            if pid <= 1:
                break
            raw = _read(f"{proc}/{pid}/cmdline", pid, "its command line")
            out.append((pid, tuple(a.decode("utf-8", "surrogateescape") for a in raw.split(b"\0") if a)))
    except (ConfigError, ValueError, IndexError):
        pass
    return out


def read_process(pid: int, *, proc: str = _PROC, is_server=None) -> ProcessLaunch:
    """Read process ``pid`` (following renamed vLLM children to their ``vllm serve`` parent).

    ``is_server(argv)`` says whether an argv starts a server (``parse.find_server``); a process that is not one
    and has no renamed-vLLM title is a ConfigError naming what it runs.
    """
    if pid < 1:
        raise ConfigError(f"--pid {pid}: not a process id")
    start = pid
    for _ in range(8):
        raw = _read(f"{proc}/{pid}/cmdline", pid, "its command line")
        argv = tuple(a.decode("utf-8", "surrogateescape") for a in raw.split(b"\0"))
        if argv and argv[-1] == "":
            argv = argv[:-1]
        if not argv:
            raise ConfigError(f"--pid {pid}: the process has no command line (a kernel thread or a zombie), not a "
                              "vllm server")
        if is_server is not None and not is_server(list(argv)):
            title = argv[0].split()[0] if argv[0] else ""
            if title.startswith("VLLM::") or title.startswith("VLLM:"):
                parent = _parent(pid, proc)
                if parent <= 1:
                    break
                pid = parent
                continue
            shown = " ".join(argv)[:80]
            raise ConfigError(f"--pid {start}: the process runs {shown!r}, not a vllm server (vllm serve, python -m "
                              "vllm.entrypoints.openai.api_server)")
        env_raw = _read(f"{proc}/{pid}/environ", pid, "its environment")
        environ: dict[str, str] = {}
        for item in env_raw.split(b"\0"):
            if b"=" in item:
                key, _, value = item.decode("utf-8", "surrogateescape").partition("=")
                environ[key] = value
        try:
            cwd: Optional[str] = os.readlink(f"{proc}/{pid}/cwd")
        except OSError:
            cwd = None
        root_link = _link(f"{proc}/{pid}/root") or "/"
        theirs_ns, ours_ns = _link(f"{proc}/{pid}/ns/mnt"), _link(f"{proc}/self/ns/mnt")
        # docker and podman pivot_root: the root link reads "/" but the mount namespace differs; a chroot: a path
        if root_link == "/" and not (theirs_ns and ours_ns and theirs_ns != ours_ns):
            return ProcessLaunch(pid, argv, environ, cwd, None)
        if root_link != "/" and cwd is not None and (cwd + "/").startswith(root_link.rstrip("/") + "/"):
            cwd = "/" + os.path.relpath(cwd, root_link).removeprefix(".")  # the chroot's path, as the server sees it
        mounts = host_mounts(_mountinfo(f"{proc}/{pid}/mountinfo"), _mountinfo(f"{proc}/self/mountinfo"), pid)
        return ProcessLaunch(pid, argv, environ, cwd, f"{proc}/{pid}/root", mounts)
    raise ConfigError(f"--pid {start}: a vLLM child process whose parents lead to no vllm serve process")
