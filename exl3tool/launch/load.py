"""Read a launch from its forms: a shell string (``--launch``), a script file (``--launch-file``), an argv (after
``--``), a process (``--pid``), a docker compose service (``--compose``)."""

from __future__ import annotations

import os
import posixpath
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Callable, Optional

from exl3tool.errors import ConfigError
from exl3tool.launch.container import ContainerRun, PathMap, parse_run
from exl3tool.launch.env import EnvLayers, EnvValue, is_dry_run_output, read_dry_run_env, read_env_file
from exl3tool.launch.image import image_env
from exl3tool.launch.parse import ASSIGNMENT, ServerStart, find_server, parse_server_args
from exl3tool.launch.proc import read_process
from exl3tool.launch.resolve import ServerLaunch
from exl3tool.launch.shell import SHELLS, ScriptResult, container_view, run_file, script_changes
from exl3tool.launch.script import dry_run_command, read_launcher

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


def _text_reader(paths: PathMap, cwd: Optional[str]) -> Callable[[str], Optional[str]]:
    """Read a script the launch names (through its path map); None when it cannot be read here."""
    def read(path: str) -> Optional[str]:
        if not posixpath.isabs(path):
            if paths.container or cwd is None:
                return None
            path = posixpath.join(cwd, path)
        here = paths.to_host(path)
        try:
            with open(here, encoding="utf-8") as fh:  # type: ignore[arg-type]
                return fh.read()
        except (OSError, TypeError, UnicodeDecodeError):
            return None
    return read


def _script_file(words: list[str], read: Callable[[str], Optional[str]],
                 launcher_dirs: Sequence[str] = ()) -> Optional[tuple[str, list[str], str]]:
    """``bash FILE ARGS`` / ``FILE ARGS`` (a shell script with a #! line): the script's path (as its machine sees it,
    or a same-named launcher in ``launcher_dirs``), its arguments and its name; None when the words run no script."""
    if not words:
        return None
    if words[0].rsplit("/", 1)[-1] in SHELLS:
        rest = list(words[1:])
        while rest and rest[0].startswith(("-", "+")):
            if "c" in rest[0][1:] and not rest[0].startswith("--"):
                return None  # a -c script, not a file
            rest = rest[1:]
        if not rest:
            return None
        path, args = rest[0], rest[1:]
    elif "/" in words[0] or words[0].endswith(".sh"):
        path, args = words[0], words[1:]
    else:
        return None
    text = read(path)
    if text is None:
        for d in launcher_dirs:  # the image's copy of a launcher: the same-named file beside the launch
            candidate = os.path.join(d, path.rsplit("/", 1)[-1])
            if os.path.isfile(candidate):
                with open(candidate, encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
                path = candidate
                break
    if text is None:
        return None
    if words[0].rsplit("/", 1)[-1] not in SHELLS and not (text.startswith("#!") and any(
            t.rsplit("/", 1)[-1] in SHELLS for t in text.split("\n", 1)[0][2:].split())):
        return None
    return path, list(args), words[0] if words[0].rsplit("/", 1)[-1] not in SHELLS else path


def _find(words: list[str], env: Optional[Mapping[str, str]], read: Callable[[str], Optional[str]],
          workdir: Optional[str] = None, paths: Optional[PathMap] = None,
          launcher_dirs: Sequence[str] = ()) -> Optional[ServerStart]:
    """The server in ``words``, also inside a script file it runs (``bash /scripts/serve.sh``, an entrypoint),
    which bash runs in the read-only sandbox: in the container's view when ``paths`` is a container's."""
    mounts = None
    if paths is not None and paths.container:
        mounts = [(m.host, m.inside) for m in paths.mounts if m.host is not None]
    if mounts is not None:
        with container_view(mounts, launcher_dirs):
            start = find_server(words, env)
    else:
        start = find_server(words, env)
    if start is not None:
        return start
    found = _script_file(words, read, launcher_dirs)
    if found is None:
        return None
    path, args, name = found
    if mounts is None and not posixpath.isabs(path) and workdir:
        path = posixpath.join(workdir, path)
    dirs = (*launcher_dirs, posixpath.dirname(path)) if posixpath.isabs(path) and mounts is None else launcher_dirs
    result = run_file(path, args, environ=dict(env or {}), where=name, workdir=workdir, mounts=mounts,
                      launcher_dirs=dirs, is_server=lambda w: find_server(w) is not None, strict=env is not None)
    if result is None and env is None:
        return None  # only looking: a script that starts no server is not the launch's server
    if result is None:
        raise ConfigError(f"the launch runs the script {name}, which starts no vllm server; " + _NOT_FOUND)
    return _from_script(result, name, env is not None)


def _from_script(result: ScriptResult, where: str, strict: bool) -> ServerStart:
    """The server's start in a script's result, with what the script exported and where it cd'd."""
    inner = find_server(result.words, result.environ if strict else None)
    assert inner is not None
    exports = tuple((n, v, w) for n, (v, w) in result.exports.items()) + inner.exports
    notes = tuple(result.notes) + tuple(f"{where} sets {n} (line {line}) but does not export it: the server does not "
                                        "see it" for n, line in result.unexported.items()
                                        if n.startswith(("VLLM_", "HF_", "XDG_")))
    return replace(inner, env=tuple(result.prefix_env) + inner.env, words=inner.words or tuple(result.words),
                   exports=exports, workdir=inner.workdir or result.workdir, script=inner.script or where,
                   notes=notes + inner.notes)


def _server(words: list[str], start: ServerStart, form: str, env: dict[str, EnvValue], paths: PathMap,
            workdir: Optional[str], ignored: tuple[str, ...], notes: tuple[str, ...], *,
            process_env: bool = True, pid: Optional[int] = None, image_note: str = "") -> ServerLaunch:
    words = list(start.words) if start.words else words
    args = parse_server_args(words[start.index:], entry=start.entry, serve=start.kind == "vllm",
                             read_text=_reader(paths))
    for name, value, where in start.exports:  # a script's exports, then the command's own NAME=VALUE words
        env[name] = EnvValue(value, "launch env", where)
    for name, value in start.env:
        env[name] = EnvValue(value, "launch env", f"{name}=... before {start.entry}")
    if start.workdir:
        if posixpath.isabs(start.workdir):
            workdir = start.workdir
        elif workdir:
            workdir = posixpath.normpath(posixpath.join(workdir, start.workdir))
        elif form == "command":
            workdir = os.path.abspath(start.workdir)
    wrappers = tuple(w for w in start.prefix if not ASSIGNMENT.match(w))
    if wrappers:
        ignored = (*ignored, f"{' '.join(wrappers)} (wrapper words before {start.entry})")
    if start.script:
        notes = (*notes, f"the server's command was read from {start.script}")
    return ServerLaunch(form, start.entry, args, env, paths, workdir, process_env, ignored, (*notes, *start.notes),
                        pid, image_note)


def _container(words: list[str], start: ServerStart, environ: Mapping[str, str], cwd: str) -> ServerLaunch:
    run = parse_run(start.kind, words[start.index:], environ=environ, cwd=cwd)
    return container_launch(run, start.kind, environ)


def container_launch(run: ContainerRun, form: str, environ: Mapping[str, str],
                     entrypoint_words: Optional[Sequence[str]] = None, notes: Sequence[str] = (),
                     launcher_dirs: Sequence[str] = ()) -> ServerLaunch:
    """The launch a container start gives (``docker``/``podman run``, a compose service): the image's ENV below the
    run's own environment, the server found in its entrypoint and command (also inside a script they run)."""
    command = list(run.command)
    notes = list(notes)
    if entrypoint_words is not None:
        command = [*entrypoint_words, *command]
    elif run.entrypoint is not None and run.entrypoint.strip():
        command = [*shlex.split(run.entrypoint), *command]
    base_env, image_note, image = image_env(run.runner, run.image)
    base_env = {**base_env, **run.env}
    if run.env_host:
        base_env = {**{k: EnvValue(v, "launch env", "podman --env-host") for k, v in environ.items()}, **base_env}
    inner = _find(command, {k: v.value for k, v in base_env.items()}, _text_reader(run.paths, run.workdir),
                  run.workdir, run.paths, launcher_dirs)
    if inner is None and command[:1] == ["serve"]:
        inner = ServerStart("vllm", 1, "vllm serve (the image's entrypoint: vllm)")
    if inner is None and (run.entrypoint is not None or entrypoint_words):
        shown = (f"--entrypoint {run.entrypoint!r}" if run.entrypoint is not None
                 else f"entrypoint {shlex.join(entrypoint_words or ())!r}")
        raise ConfigError(f"the launch's {shown} does not start a vllm server; " + _NOT_FOUND)
    if inner is None:
        command = ["vllm", "serve", *command]
        inner = ServerStart("vllm", 2, "vllm serve (taken as the image's entrypoint)")
        notes.append(f"the words after the image {run.image} are read as the arguments of an entrypoint "
                     "`vllm serve` (as in vLLM's images); give --entrypoint to say otherwise")
    ignored = tuple(f"{w} ({run.runner} run option)" for w in run.ignored)
    launch = _server(command, inner, form, dict(base_env), run.paths, run.workdir, ignored, tuple(notes),
                     image_note=image_note and f"{image_note} (image {run.image})")
    return replace(launch, image=image, image_name=run.image)


def launch_from_words(words: Sequence[str], *, environ: Optional[Mapping[str, str]] = None,
                      cwd: Optional[str] = None, exports: Optional[dict[str, EnvValue]] = None,
                      workdir: Optional[str] = None) -> ServerLaunch:
    """A launch from one command's words (a plain server, wrapped, or a container start)."""
    environ = os.environ if environ is None else environ
    cwd = cwd or os.getcwd()
    words = list(words)
    start = _find(words, environ, _text_reader(PathMap(), cwd), cwd)
    if start is None:
        raise ConfigError(_NOT_FOUND)
    if start.kind in ("docker", "podman"):
        launch = _container(list(start.words) or words, start, environ, cwd)
        return replace(launch, notes=(*start.notes, *launch.notes))
    env = dict(exports or {})
    wrappers = list(start.prefix)
    cleared = _clears_environment(wrappers)
    notes = (f"{cleared}: the server does not get exl3tool's environment",) if cleared else ()
    return _server(words, start, "command", env, PathMap(), workdir, (), notes, process_env=not cleared)


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
        if base in ("su", "runuser") and any(w in ("-", "-l", "--login") for w in rest):
            return f"{base} {'-l' if '-l' in rest else '-'} starts a login shell with a fresh environment"
    return ""


def _from_dry_run(text: str, where: str, environ: Mapping[str, str], cwd: str) -> Optional[ServerLaunch]:
    """A launcher's ``DRY_RUN=1`` output (``KEY=%q`` lines, ``Command: ...``): the command, with those variables as
    the launch's environment (quoting undone, an empty value unset); None when ``text`` is not that form."""
    lines = text.splitlines()
    if not is_dry_run_output(lines):
        return None
    words = dry_run_command(text)
    if words is None:
        raise ConfigError(f"{where} is a launcher's DRY_RUN output without its Command: line (the server's command); "
                          "give the whole output, or give the KEY lines with --env-file and the command with --launch")
    exports = read_dry_run_env(lines, where, label=where, source="launch env")
    launch = launch_from_words(words, environ={**environ, **{k: v.value for k, v in exports.items()}}, cwd=cwd,
                               exports=exports)
    return replace(launch, notes=(*launch.notes, f"{where} was read as a launcher's DRY_RUN=1 output: its KEY=%q lines "
                                  "are the server's environment (an empty value is unset), its Command: line the "
                                  "server's command"))


def _from_text(text: str, where: str, environ: Mapping[str, str], cwd: str, *, file: Optional[str] = None,
               ) -> ServerLaunch:
    """A launch written as shell text (``--launch``) or a script (``--launch-file``): run by bash in the read-only
    sandbox (``launch.script``) as it would run on this host; or a launcher's DRY_RUN output."""
    if not text.strip():
        raise ConfigError(f"{where} is empty: give the server's command line (vllm serve MODEL ...)")
    dry = _from_dry_run(text, where, environ, cwd)
    if dry is not None:
        return dry
    argv = ["bash", file] if file is not None else ["bash", "-c", text]
    dirs = [os.path.dirname(file)] if file is not None else [cwd]
    start = read_launcher(argv, environ=environ, cwd=cwd, launcher_dirs=dirs, where=where,
                          is_server=lambda w: find_server(w) is not None)
    if start is None:
        raise ConfigError(f"{where}: " + _NOT_FOUND)
    changed, unset_notes = script_changes(start, environ, where)
    exports = {n: EnvValue(v, "launch env", w) for n, (v, w) in changed.items()}
    launch = launch_from_words(start.argv, environ=start.env, cwd=start.cwd or cwd, exports=exports,
                               workdir=start.cwd if start.cwd and start.cwd != cwd else None)
    notes = [*start.notes, *unset_notes]
    return replace(launch, notes=(*launch.notes, *notes)) if notes else launch


def load_launch(*, text: Optional[str] = None, argv: Optional[Sequence[str]] = None, pid: Optional[int] = None,
                env_files: Sequence[str] = (), environ: Optional[Mapping[str, str]] = None,
                cwd: Optional[str] = None, proc: str = "/proc", file: Optional[str] = None,
                compose: Optional[str] = None, service: Optional[str] = None,
                ) -> Optional[tuple[ServerLaunch, EnvLayers]]:
    """The launch and its environment layers, or None when no launch is given. One form at a time.

    Args:
        text, argv, pid, file, compose (with service): the launch, in one of its forms (a command line, its words,
            a running server's process id, a script file, a compose service).
        env_files: env files applied as the server's environment.
        environ, cwd, proc: the environment, directory and /proc the launch is read in.

    Returns:
        ``(ServerLaunch, EnvLayers)``, or None when no form is given.
    """
    given = [n for n, v, g in (("--launch", text, bool(text)), ("--launch-file", file, file is not None),
                               ("the argv after --", argv, bool(argv)), ("--pid", pid, pid is not None),
                               ("--compose", compose, compose is not None)) if g]
    if not given:
        if service is not None:
            raise ConfigError("--service names a service of a compose file: give --compose FILE with it")
        return None
    if len(given) > 1:
        raise ConfigError(f"give one launch: {' and '.join(given)} were both given")
    if service is not None and compose is None:
        raise ConfigError("--service names a service of a compose file: give --compose FILE with it")
    environ = dict(os.environ if environ is None else environ)
    cwd = cwd or os.getcwd()
    files: dict[str, EnvValue] = {}
    for path in env_files:
        files.update(read_env_file(path, environ=environ))
    if pid is not None:
        proc_launch = read_process(pid, proc=proc, is_server=lambda a: find_server(a) is not None)
        words = list(proc_launch.argv)
        start = find_server(words, proc_launch.environ)
        assert start is not None
        env = {k: EnvValue(v, "launch env", f"/proc/{proc_launch.pid}/environ") for k, v in proc_launch.environ.items()}
        paths = PathMap(proc_launch.mounts, container=proc_launch.root is not None, root=proc_launch.root)
        if start.kind in ("docker", "podman"):
            launch = _container(list(start.words) or words, start, proc_launch.environ, proc_launch.cwd or "/")
        else:
            launch = _server(words, start, "pid", env, paths, proc_launch.cwd, (), (), process_env=False,
                             pid=proc_launch.pid)
        return launch, EnvLayers(launch.env, files, None, container=launch.form != "pid" or paths.root is not None)
    if compose is not None:
        from exl3tool.launch.compose import compose_run

        run, entrypoint, notes = compose_run(compose, service, environ=environ)
        project = os.path.dirname(os.path.abspath(os.path.join(cwd, compose)))
        dirs = [d for d in (project, os.path.join(project, "launchers"), os.path.join(project, "..", "launchers"))
                if os.path.isdir(d)]  # an entrypoint inside the image (/usr/local/bin/serve-*.sh): the repo's copy
        launch = container_launch(run, run.runner, environ, entrypoint, notes, launcher_dirs=dirs)
    elif argv:
        launch = launch_from_words(argv, environ=environ, cwd=cwd)
    elif file is not None:
        try:
            with open(os.path.join(cwd, file), encoding="utf-8") as fh:
                body = fh.read()
        except OSError as exc:
            raise ConfigError(f"--launch-file {file}: cannot read it ({exc.strerror or exc})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--launch-file {file}: not a text file (a shell script is expected)") from None
        launch = _from_text(body, file, environ, cwd, file=os.path.join(cwd, file))
    else:
        launch = _from_text(text or "", "--launch", environ, cwd)
    container = launch.form in ("docker", "podman")
    return launch, EnvLayers(launch.env, files, environ if launch.process_env else None, container=container)
