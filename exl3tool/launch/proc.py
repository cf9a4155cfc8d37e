"""``--pid PID``: a running server's command line, environment, working directory and root, read from ``/proc``.

``/proc/PID/cmdline`` and ``/proc/PID/environ`` are what the process was started with (the environment includes
what an image's ``ENV`` set). vLLM's engine and worker processes rename themselves (``VLLM::EngineCore``); given
one of those, the parent chain is followed to the ``vllm serve`` process. A server in another mount namespace (a
container seen from the host) has its files read through ``/proc/PID/root``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from exl3tool.errors import ConfigError

__all__ = ["ProcessLaunch", "read_process"]

_PROC = "/proc"


@dataclass(frozen=True)
class ProcessLaunch:
    """What ``/proc`` says of a process: its argv, environment, working directory and root (None when it is ours)."""

    pid: int
    argv: tuple[str, ...]
    environ: dict[str, str]
    cwd: Optional[str]
    root: Optional[str]  # "/proc/PID/root" when the process sees another filesystem root, else None


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


def _parent(pid: int, proc: str) -> int:
    stat = _read(f"{proc}/{pid}/stat", pid, "its status").decode("utf-8", "replace")
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state, past the (comm)


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
        try:
            root_link = os.readlink(f"{proc}/{pid}/root")
        except OSError:
            root_link = "/"
        root = None if root_link == "/" else f"{proc}/{pid}/root"
        return ProcessLaunch(pid, argv, environ, cwd, root)
    raise ConfigError(f"--pid {start}: a vLLM child process whose parents lead to no vllm serve process")
