"""Read a launch from its three forms: a shell string (``--launch``), an argv (after ``--``), a process (``--pid``)."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from typing import Optional

from exl3tool.errors import ConfigError
from exl3tool.launch.container import PathMap, parse_run
from exl3tool.launch.env import EnvLayers, EnvValue, read_env_file
from exl3tool.launch.parse import (
    ASSIGNMENT, ServerStart, find_server, parse_server_args, split_commands,
)
from exl3tool.launch.proc import read_process
from exl3tool.launch.resolve import ServerLaunch

__all__ = ["load_launch", "launch_from_words"]

_NOT_FOUND = ("no vllm server in the launch: expected vllm serve ..., python -m vllm.entrypoints.openai.api_server "
              "..., or docker/podman run ... IMAGE [vllm serve|serve|ARGS]")


def _reader(paths: PathMap):
    """Read a file the server names (its --config), through its path map."""
    def read(path: str) -> str:
        here = paths.to_host(path) if os.path.isabs(path) else path
        if here is None:
            raise OSError(f"{path} is inside the image, not on a bind mount of the launch")
        with open(here, encoding="utf-8") as fh:
            return fh.read()
    return read


def _server(words: list[str], start: ServerStart, form: str, env: dict[str, EnvValue], paths: PathMap,
            workdir: Optional[str], ignored: tuple[str, ...], notes: tuple[str, ...], *,
            process_env: bool = True, pid: Optional[int] = None) -> ServerLaunch:
    words = list(start.words) if start.words else words
    args = parse_server_args(words[start.index:], entry=start.entry, serve=start.kind == "vllm",
                             read_text=_reader(paths))
    for name, value in start.env:
        env.setdefault(name, EnvValue(value, "launch env", f"{name}=... before {start.entry}"))
    wrappers = tuple(w for w in start.prefix if not ASSIGNMENT.match(w))
    if wrappers:
        ignored = (*ignored, f"{' '.join(wrappers)} (wrapper words before {start.entry})")
    return ServerLaunch(form, start.entry, args, env, paths, workdir, process_env, ignored, notes, pid)


def _container(words: list[str], start: ServerStart, environ: Mapping[str, str], cwd: str) -> ServerLaunch:
    run = parse_run(start.kind, words[start.index:], environ=environ, cwd=cwd)
    command = list(run.command)
    notes: list[str] = []
    if run.entrypoint is not None and run.entrypoint.strip():
        command = [*shlex.split(run.entrypoint), *command]
    inner = find_server(command)
    if inner is None and command[:1] == ["serve"]:
        inner = ServerStart("vllm", 1, "vllm serve (the image's entrypoint: vllm)")
    if inner is None and run.entrypoint is not None:
        raise ConfigError(f"the launch's --entrypoint {run.entrypoint!r} does not start a vllm server; " + _NOT_FOUND)
    if inner is None:
        command = ["vllm", "serve", *command]
        inner = ServerStart("vllm", 2, "vllm serve (taken as the image's entrypoint)")
        notes.append(f"the words after the image {run.image} are read as the arguments of an entrypoint "
                     "`vllm serve` (as in vLLM's images); give --entrypoint to say otherwise")
    env = dict(run.env)
    if run.env_host:
        env = {**{k: EnvValue(v, "launch env", "podman --env-host") for k, v in environ.items()}, **env}
    ignored = tuple(f"{w} ({run.runner} run option)" for w in run.ignored)
    return _server(command, inner, start.kind, env, run.paths, run.workdir, ignored, tuple(notes))


def launch_from_words(words: Sequence[str], *, environ: Optional[Mapping[str, str]] = None,
                      cwd: Optional[str] = None, exports: Optional[dict[str, EnvValue]] = None) -> ServerLaunch:
    """A launch from one command's words (a plain server, wrapped, or a container start)."""
    environ = os.environ if environ is None else environ
    cwd = cwd or os.getcwd()
    words = list(words)
    start = find_server(words)
    if start is None:
        raise ConfigError(_NOT_FOUND)
    if start.kind in ("docker", "podman"):
        return _container(list(start.words) or words, start, environ, cwd)
    env = dict(exports or {})
    wrappers = list(start.prefix)
    cleared = _clears_environment(wrappers)
    notes = (f"{cleared}: the server does not get exl3tool's environment",) if cleared else ()
    return _server(words, start, "command", env, PathMap(), None, (), notes, process_env=not cleared)


def _clears_environment(prefix: list[str]) -> str:
    """Why the server gets none of the launching shell's environment (``env -i``, ``sudo`` without ``-E``), or ""."""
    for i, word in enumerate(prefix):
        base = word.rsplit("/", 1)[-1]
        rest = prefix[i + 1:]
        if base == "env" and any(w in ("-i", "--ignore-environment", "-") for w in rest):
            return "env -i clears the environment"
        if base == "sudo" and not any(w in ("-E", "--preserve-env") or w.startswith("--preserve-env=")
                                      for w in rest):
            return "sudo resets the environment (no -E)"
    return ""


def load_launch(*, text: Optional[str] = None, argv: Optional[Sequence[str]] = None, pid: Optional[int] = None,
                env_files: Sequence[str] = (), environ: Optional[Mapping[str, str]] = None,
                cwd: Optional[str] = None, proc: str = "/proc") -> Optional[tuple[ServerLaunch, EnvLayers]]:
    """The launch and its environment layers, or None when no launch is given. One form at a time."""
    given = [n for n, v in (("--launch", text), ("the argv after --", argv), ("--pid", pid)) if v]
    if not given:
        return None
    if len(given) > 1:
        raise ConfigError(f"give one launch: {' and '.join(given)} were both given")
    environ = dict(os.environ if environ is None else environ)
    files: dict[str, EnvValue] = {}
    for path in env_files:
        files.update(read_env_file(path, environ=environ))
    if pid is not None:
        proc_launch = read_process(pid, proc=proc, is_server=lambda a: find_server(a) is not None)
        words = list(proc_launch.argv)
        start = find_server(words)
        assert start is not None
        env = {k: EnvValue(v, "launch env", f"/proc/{proc_launch.pid}/environ") for k, v in proc_launch.environ.items()}
        paths = PathMap(proc_launch.mounts, container=proc_launch.root is not None, root=proc_launch.root)
        if start.kind in ("docker", "podman"):
            launch = _container(list(start.words) or words, start, proc_launch.environ, proc_launch.cwd or "/")
        else:
            launch = _server(words, start, "pid", env, paths, proc_launch.cwd, (), (), process_env=False,
                             pid=proc_launch.pid)
        return launch, EnvLayers(launch.env, files, None, container=launch.form != "pid" or paths.root is not None)
    if argv is not None:
        launch = launch_from_words(argv, environ=environ, cwd=cwd)
    else:
        commands = split_commands(text or "")
        exports: dict[str, EnvValue] = {}
        launch = None
        for words in commands:
            if find_server(words) is not None:
                launch = launch_from_words(words, environ=environ, cwd=cwd, exports=exports)
                break
            if words[0] == "export" or all(ASSIGNMENT.match(w) for w in words):  # export A=1 / A=1 on its own line
                for w in words[1:] if words[0] == "export" else words:
                    if (m := ASSIGNMENT.match(w)):
                        exports[m.group(1)] = EnvValue(m.group(2), "launch env", f"export {m.group(1)}=...")
        if launch is None:
            raise ConfigError(_NOT_FOUND)
    container = launch.form in ("docker", "podman")
    return launch, EnvLayers(launch.env, files, environ if launch.process_env else None, container=container)
