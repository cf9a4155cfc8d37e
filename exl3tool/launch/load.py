"""Read a launch from its forms: a shell string (``--launch``), a script file (``--launch-file``), an argv (after
``--``), a process (``--pid``), a docker compose service (``--compose``).

Each form has one reader with one signature, ``read(value, at: ReadAt) -> ServerLaunch`` (``FORMS``), as a library
keeps one module per framework with the same functions; ``load_launch`` picks the one given and adds the env files.
What a reader finds goes through the same steps: the server's start in the words (``parse.find_server``, also
inside a ``-c`` script or a script file, run by bash in the read-only sandbox in the view it runs in: this host or
a container's volumes, passed explicitly as a ``ScriptView``), the wrappers before it (``wrappers.follow``: their
root, binds, environment and user), and the server's own flags (``parse.parse_server_args``).
"""

from __future__ import annotations

import os
import posixpath
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Optional

from exl3tool.cache.serverfs import seen_from_here
from exl3tool.errors import ConfigError
from exl3tool.launch.container import ContainerRun, PathMap, parse_run
from exl3tool.launch.env import EnvLayers, EnvValue, is_dry_run_output, read_dry_run_env, read_env_file
from exl3tool.launch.image import image_env
from exl3tool.launch.parse import Level, ServerStart, find_server, parse_server_args
from exl3tool.launch.proc import ancestors, read_process
from exl3tool.launch.resolve import ServerLaunch
from exl3tool.launch.script import (
    HOST_VIEW, SHELLS, LauncherStart, ScriptView, dry_run_command, read_launcher, script_changes,
)
from exl3tool.launch.wrappers import Guest, entrypoint_passes, follow, refusal_in, traced_view

__all__ = ["load_launch", "launch_from_words", "container_launch", "ReadAt", "FORMS"]

_NOT_FOUND = ("no vllm server in the launch: expected vllm serve ..., python -m vllm.entrypoints.openai.api_server "
              "..., or docker/podman run ... IMAGE [vllm serve|serve|ARGS]")


@dataclass(frozen=True)
class ReadAt:
    """What every launch form is read with: the environment and directory it starts in, and ``/proc``."""

    environ: Mapping[str, str]
    cwd: str
    proc: str = "/proc"
    image_inspect: Optional[str] = None  # --image-inspect FILE: the container's image as saved (ENV, entrypoint)


# --- reading files the server names, through its view ----------------------------------------------------------

def _reader(paths: PathMap, cwd: Optional[str]):
    """Read a file the server names (its --config), through its path map; a relative path is the server's working
    directory's (the launch's after its `cd`, a container's workdir), never this process's."""
    def read(path: str) -> str:
        if not posixpath.isabs(path):
            path = posixpath.join(cwd or ("/" if paths.container else os.getcwd()), path)
        here = _in_view(paths, path, "the launch's --config file")
        if here is None:
            raise OSError(f"{path} is inside the image, not on a bind mount of the launch")
        with open(here, encoding="utf-8") as fh:
            return fh.read()
    return read


def _text_reader(paths: PathMap, cwd: Optional[str]) -> Callable[[str], Optional[tuple[str, str]]]:
    """Read a script the launch names (through its path map): (its text, where it is here), or None."""
    def read(path: str) -> Optional[tuple[str, str]]:
        if not posixpath.isabs(path):
            if paths.container or cwd is None:
                return None
            path = posixpath.join(cwd, path)
        try:
            here = _in_view(paths, path, "the launch's script")
            with open(here, encoding="utf-8") as fh:  # type: ignore[arg-type]
                return fh.read(), here  # type: ignore[return-value]
        except (OSError, TypeError, UnicodeDecodeError, ConfigError):
            return None
    return read


def _in_view(paths: PathMap, path: str, what: str) -> Optional[str]:
    """Where the server's file ``path`` is here: through its view's mounts with its links read there (a root, a
    container's volumes; ``cache.serverfs``), never this machine's; None inside the image; a ConfigError naming
    a link that leads out of what is here."""
    if not paths.own_view:
        return paths.to_host(path)
    return seen_from_here(paths, path, what)


def _mounts(paths: PathMap) -> Optional[tuple[tuple[str, str], ...]]:
    """A container's volumes as the sandbox's (host folder, container path) pairs; None for this host."""
    if not paths.container:
        return None
    return tuple((m.host, m.inside) for m in paths.mounts if m.host is not None)


def _script_file(words: list[str], read: Callable[[str], Optional[tuple[str, str]]], paths: PathMap,
                 launcher_dirs: Sequence[str] = ()) -> Optional[tuple[str, list[str], str, tuple[str, ...]]]:
    """``bash FILE ARGS`` / ``FILE ARGS`` (a shell script with a #! line): the script's path as the sandbox sees it
    (the server's path on a mount, else where it is here), its arguments, its name, and the folders the sandbox must
    show for it; None when the words run no script that can be read here."""
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
    found = read(path)
    dirs: tuple[str, ...] = ()
    if found is not None and paths.container and posixpath.isabs(path) and paths.mount_for(path) is None:
        path = found[1]  # inside an image root read here (podman --rootfs): the sandbox shows its folder
        dirs = (posixpath.dirname(path),)
    if found is None:
        for d in launcher_dirs:  # the image's copy of a launcher: the same-named file beside the launch
            candidate = os.path.join(d, path.rsplit("/", 1)[-1])
            if os.path.isfile(candidate):
                with open(candidate, encoding="utf-8", errors="replace") as fh:
                    found = (fh.read(), candidate)
                path = candidate
                break
    if found is None:
        return None
    text = found[0]
    if words[0].rsplit("/", 1)[-1] not in SHELLS and not (text.startswith("#!") and any(
            t.rsplit("/", 1)[-1] in SHELLS for t in text.split("\n", 1)[0][2:].split())):
        return None
    return path, list(args), words[0] if words[0].rsplit("/", 1)[-1] not in SHELLS else path, dirs


def _find(words: list[str], env: Optional[Mapping[str, str]], paths: PathMap, view: ScriptView,
          read: Callable[[str], Optional[tuple[str, str]]]) -> Optional[ServerStart]:
    """The server in ``words``, also inside a script file it runs (``bash /scripts/serve.sh``, an entrypoint),
    which bash runs in the read-only sandbox in ``view`` (this host, or the container's volumes)."""
    start = find_server(words, env, view)
    if start is not None:
        return start
    found = _script_file(words, read, paths, view.launcher_dirs)
    if found is None:
        return None
    path, args, name, extra = found
    if view.mounts is None and not posixpath.isabs(path) and view.cwd:
        path = posixpath.join(view.cwd, path)
    dirs = (*view.launcher_dirs, *extra)
    if posixpath.isabs(path) and view.mounts is None:
        dirs = (*dirs, posixpath.dirname(path))
    script_view = replace(view, launcher_dirs=dirs)
    strict = env is not None
    try:
        start_ = script_view.read(["bash", path, *args], environ=dict(env or {}), where=name,
                                  is_server=lambda w, cwd: find_server(w, view=replace(
                                      script_view, cwd=cwd or script_view.cwd)) is not None)
    except ConfigError:
        if strict:
            raise
        return None
    if start_ is None and not strict:
        return None  # only looking: a script that starts no server is not the launch's server
    if start_ is None:
        raise ConfigError(f"the launch runs the script {name}, which starts no vllm server; " + _NOT_FOUND)
    return _from_script(start_, dict(env or {}), name, view.cwd, strict, script_view)


def _from_script(start: LauncherStart, environ: dict[str, str], where: str, workdir: Optional[str], strict: bool,
                 view: ScriptView) -> ServerStart:
    """The server's start in a script file's recorded start, with what the script exported and where it cd'd."""
    inner = find_server(list(start.argv), start.env if strict else None, replace(view, cwd=start.cwd or view.cwd))
    assert inner is not None
    exports, notes = script_changes(start, environ, where)
    cwd = start.cwd if start.cwd and start.cwd != workdir else None
    level = Level((), tuple((n, v, w) for n, (v, w) in exports.items()), cwd, where)
    return replace(inner, words=inner.words or tuple(start.argv), levels=(level, *inner.levels),
                   notes=(*start.notes, *notes, *inner.notes))


# --- from the server's start to the launch ----------------------------------------------------------------------

def _server(words: list[str], start: ServerStart, form: str, env: dict[str, EnvValue], paths: PathMap,
            workdir: Optional[str], ignored: tuple[str, ...], notes: tuple[str, ...], *, environ: Mapping[str, str],
            cwd: str, process_env: bool = True, pid: Optional[int] = None, image_note: str = "") -> ServerLaunch:
    """The launch of a server found in ``words``: the scripts it was found in and the wrappers before it followed
    (``wrappers.follow``) over ``env`` (the launch's own variables) and ``environ`` (the one below it), then its
    flags read."""
    inside = form in ("docker", "podman")
    guest = Guest(env=dict(env), paths=paths, workdir=workdir)
    for level in start.levels:  # outermost first: what ran the shell, what the script exported, where it cd'd
        follow(level.wrappers, guest, environ=environ, cwd=guest.workdir or cwd, entry=level.how, inside=inside)
        for name, value, where in level.exports:
            guest.set(name, value, where)
        if level.workdir:
            guest.workdir = (level.workdir if posixpath.isabs(level.workdir) or not guest.workdir
                             else posixpath.normpath(posixpath.join(guest.workdir, level.workdir)))
    follow(start.prefix, guest, environ=environ, cwd=guest.workdir or cwd, entry=start.entry, inside=inside)
    words = list(start.words) if start.words else words
    args = parse_server_args(words[start.index:], entry=start.entry, serve=start.kind == "vllm",
                             read_text=_reader(guest.paths, guest.workdir or cwd))
    if guest.ignored:
        ignored = (*ignored, f"{' '.join(guest.ignored)} (wrapper words before {start.entry})")
    notes = (*notes, *guest.notes)
    if start.script:
        notes = (*notes, f"the server's command was read from {start.script}")
    return ServerLaunch(form, start.entry, args, guest.env, guest.paths, guest.workdir,
                        process_env and not guest.cleared, ignored, (*notes, *start.notes), pid,
                        image_note or guest.image_note, hidden=tuple(sorted(guest.hidden)),
                        home_unknown=guest.home_unknown)


def _not_found(words: Sequence[str], where: str = "") -> ConfigError:
    """No server in the launch: a wrapper exl3tool refuses named, if one runs it; else what forms are read."""
    said = refusal_in(words)
    return ConfigError(said or (f"{where}: " if where else "") + _NOT_FOUND)


def launch_from_words(words: Sequence[str], *, environ: Optional[Mapping[str, str]] = None,
                      cwd: Optional[str] = None, exports: Optional[dict[str, EnvValue]] = None,
                      workdir: Optional[str] = None, image_inspect: Optional[str] = None) -> ServerLaunch:
    """A launch from one command's words (a plain server, wrapped, or a container start)."""
    environ = os.environ if environ is None else environ
    cwd = cwd or os.getcwd()
    words = list(words)
    start = _find(words, environ, PathMap(), replace(HOST_VIEW, cwd=cwd), _text_reader(PathMap(), cwd))
    if start is None:
        raise _not_found(words)
    if start.kind in ("docker", "podman"):
        guest = follow(start.prefix, Guest(), environ=environ, cwd=cwd, entry=start.entry)  # sudo docker run ...
        run = parse_run(start.kind, (list(start.words) or words)[start.index:], environ=guest.environ(environ),
                        cwd=cwd)
        launch = container_launch(run, start.kind, environ, launcher_dirs=_beside(cwd), image_inspect=image_inspect)
        return replace(launch, notes=(*start.notes, *launch.notes))
    return _server(words, start, "command", dict(exports or {}), PathMap(), workdir, (), (), environ=environ,
                   cwd=cwd)


def _beside(folder: str) -> list[str]:
    """Where a script named by a path of another machine (an image's launcher) is looked up by its name."""
    return [d for d in (folder, os.path.join(folder, "launchers"), os.path.join(folder, "..", "launchers"))
            if os.path.isdir(d)]


def container_launch(run: ContainerRun, form: str, environ: Mapping[str, str],
                     entrypoint_words: Optional[Sequence[str]] = None, notes: Sequence[str] = (),
                     launcher_dirs: Sequence[str] = (), image_inspect: Optional[str] = None) -> ServerLaunch:
    """The launch a container start gives (``docker``/``podman run``, a compose service): the image's ENV below the
    run's own environment, the server found in its entrypoint and command (also inside a script they run: the
    image's entrypoint script when it can be read here, through the volumes or beside the launch)."""
    command = list(run.command)
    notes = list(notes)
    base_env, image_note, image = image_env(run.runner, run.image, image_inspect)
    base_env = {**base_env, **run.env}
    if run.env_host:
        base_env = {**{k: EnvValue(v, "launch env", "podman --env-host") for k, v in environ.items()}, **base_env}
    given = ""  # the entrypoint the launch gives, for messages
    from_image: tuple[str, ...] = ()  # the image's own entrypoint, when that is what runs
    if entrypoint_words is not None:
        entry = list(entrypoint_words)
        given = f"entrypoint {shlex.join(entrypoint_words)!r}"
    elif run.entrypoint is not None and run.entrypoint.strip():
        entry = shlex.split(run.entrypoint)
        given = f"--entrypoint {run.entrypoint!r}"
    elif image is not None and image.entrypoint:
        entry, how = entrypoint_passes(list(image.entrypoint))
        from_image = tuple(image.entrypoint)
        if how:
            notes.append(f"the image {run.image}'s entrypoint {shlex.join(from_image)} {how}")
        if not command and image.cmd:
            command = list(image.cmd)
    else:
        entry = []
    words = [*entry, *command]
    env_values = {k: v.value for k, v in base_env.items()}
    view = ScriptView(_mounts(run.paths), tuple(launcher_dirs), run.workdir)
    inner = _find(words, env_values, run.paths, view, _text_reader(run.paths, run.workdir))
    if inner is None and words[:1] == ["serve"] and not from_image:
        inner = ServerStart("vllm", 1, "vllm serve (the image's entrypoint: vllm)")
    if inner is None and given:
        raise ConfigError(f"the launch's {given} does not start a vllm server; " + _NOT_FOUND)
    if inner is None and from_image:
        # the image's own entrypoint runs: its script, or (after a pass-through such as NVIDIA's) the first word,
        # which is then a command of the image (`serve` alone is not vllm's), never guessed to be `vllm serve`
        where = image.how() if image is not None else "the image"
        runs = (f"{words[0]} is inside the image, not on a volume of the launch or beside it" if words else
                "it is given no command")
        if entry != list(from_image) and words:
            runs = f"it runs its arguments, so {words[0]!r} is a command of the image that exl3tool cannot read"
        raise ConfigError(
            f"the image {run.image}'s entrypoint {shlex.join(from_image)} (from {where}) starts no vllm server "
            f"exl3tool can see: {runs}; copy it out (docker cp) beside the launch or into its launchers/ folder to "
            f"have it read, or give the server's command with --entrypoint (`--entrypoint vllm IMAGE serve MODEL "
            "...`) or after the image (`IMAGE vllm serve MODEL ...`), or its DRY_RUN output")
    if inner is None:
        words = ["vllm", "serve", *words]
        inner = ServerStart("vllm", 2, "vllm serve (taken as the image's entrypoint)")
        notes.append(f"the words after the image {run.image} are read as the arguments of an entrypoint "
                     "`vllm serve` (as in vLLM's images); give --entrypoint to say otherwise")
    ignored = tuple(f"{w} ({run.runner} run option)" for w in run.ignored)
    launch = _server(words, inner, form, dict(base_env), run.paths, run.workdir, ignored, tuple(notes),
                     environ=env_values, cwd=run.workdir or "/", process_env=False,
                     image_note=image_note and f"{image_note} (image {run.image})")
    return replace(launch, image=image, image_name=run.image)


# --- the forms ----------------------------------------------------------------------------------------------------

def _from_dry_run(text: str, where: str, at: ReadAt) -> Optional[ServerLaunch]:
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
    launch = launch_from_words(words, environ={**at.environ, **{k: v.value for k, v in exports.items()}}, cwd=at.cwd,
                               exports=exports, image_inspect=at.image_inspect)
    return replace(launch, notes=(*launch.notes, f"{where} was read as a launcher's DRY_RUN=1 output: its KEY=%q lines "
                                  "are the server's environment (an empty value is unset), its Command: line the "
                                  "server's command"))


def _from_text(text: str, where: str, at: ReadAt, *, file: Optional[str] = None) -> ServerLaunch:
    """A launch written as shell text or a script: run by bash in the read-only sandbox (``launch.script``) as it
    would run on this host; or a launcher's DRY_RUN output."""
    if not text.strip():
        raise ConfigError(f"{where} is empty: give the server's command line (vllm serve MODEL ...)")
    dry = _from_dry_run(text, where, at)
    if dry is not None:
        return dry
    argv = ["bash", file] if file is not None else ["bash", "-c", text]
    dirs = [os.path.dirname(file)] if file is not None else [at.cwd]
    start = read_launcher(argv, environ=at.environ, cwd=at.cwd, launcher_dirs=dirs, where=where,
                          is_server=lambda w, cwd: find_server(w, view=replace(HOST_VIEW, cwd=cwd)) is not None,
                          refused=refusal_in)
    if start is None:
        raise ConfigError(f"{where}: " + _NOT_FOUND)
    changed, unset_notes = script_changes(start, at.environ, where)
    exports = {n: EnvValue(v, "launch env", w) for n, (v, w) in changed.items()}
    launch = launch_from_words(start.argv, environ=start.env, cwd=start.cwd or at.cwd, exports=exports,
                               workdir=start.cwd if start.cwd and start.cwd != at.cwd else None,
                               image_inspect=at.image_inspect)
    notes = [*start.notes, *unset_notes]
    return replace(launch, notes=(*launch.notes, *notes)) if notes else launch


def read_text(text: str, at: ReadAt) -> ServerLaunch:
    """``--launch "LINE"``: bash runs the line in the read-only sandbox, from ``at.cwd``."""
    return _from_text(text or "", "--launch", at)


# Files given as --launch-file that are not shell scripts. bash would read them as commands, and what it makes of
# them is not what starts the server: `[Service]` is a command it does not find, `Environment=X=1` a shell variable
# never exported, `ExecStart=/usr/bin/env vllm serve ...` an assignment before a command (the unit's Environment=
# lines lost), a Makefile's `$(BITS)` a command substitution, a Dockerfile's `CMD vllm serve ...` a command without
# the file's ENV. Each kind: how it is told (its name, its first line, or a make rule with a tab-indented recipe),
# and what to give instead.
_UNIT = re.compile(r"^\[[A-Za-z][A-Za-z0-9 ._-]*\]$")
_MAKE_RULE = re.compile(r"^[^\s#=:][^=:]*::?(?![=:])(\s|$)")
_DOCKERFILE_FIRST = re.compile(r"^(FROM|ARG)\s", re.I)
_MANIFEST_FIRST = re.compile(r"^(apiVersion|kind|services|version|x-[A-Za-z0-9_-]+|---)\s*:?(\s|$)")
_NOT_SCRIPTS: dict[str, str] = {
    "unit": "a systemd unit or Podman Quadlet file ([Unit], [Service], [Container] sections), not a shell script: "
            "exl3tool does not read units (their Environment=, EnvironmentFile=, User=, drop-ins and the manager's "
            "own environment); give the unit's ExecStart= command with --launch and its environment with --env-file "
            "(a Quadlet's generated podman run line: podman-system-generator --dryrun), or --pid of the running "
            "service (systemctl show -p MainPID UNIT)",
    "make": "a Makefile, not a shell script: give the target as make runs it, --launch 'make -f FILE TARGET' (make "
            "runs in the read-only sandbox and the command its recipe starts is recorded)",
    "dockerfile": "a Dockerfile, not a shell script: exl3tool reads a built image (its ENV, ENTRYPOINT and CMD, from "
                  "docker|podman image inspect or --image-inspect); give the docker|podman run line of the built image",
    "manifest": "a YAML manifest, not a shell script: give a compose file with --compose FILE; a Kubernetes pod spec "
                "is not read (its env, volumes and args): give its container as a docker|podman run line, or --pid of "
                "the server in the pod",
}


def _not_a_script(file: str, body: str) -> Optional[str]:
    """Which of ``_NOT_SCRIPTS`` a --launch-file is (None: a shell script, or a launcher's DRY_RUN output)."""
    name = os.path.basename(file)
    lines = [line.rstrip() for line in body.splitlines()]
    first = next((line.strip() for line in lines
                  if line.strip() and not line.lstrip().startswith(("#", ";"))), "")
    if body.startswith("#!"):
        return None  # a script says what runs it
    if _UNIT.match(first):
        return "unit"
    if name in ("Makefile", "makefile", "GNUmakefile") or name.endswith(".mk"):
        return "make"
    for i, line in enumerate(lines[:-1]):
        if _MAKE_RULE.match(line) and lines[i + 1].startswith("\t"):
            return "make"
    if name.startswith(("Dockerfile", "Containerfile")) or name.endswith((".Dockerfile", ".Containerfile")) \
            or _DOCKERFILE_FIRST.match(first):
        return "dockerfile"
    if _MANIFEST_FIRST.match(first):
        return "manifest"
    return None


def read_file(file: str, at: ReadAt) -> ServerLaunch:
    """``--launch-file FILE``: ``bash FILE`` in the sandbox, or a launcher's DRY_RUN output."""
    try:
        with open(os.path.join(at.cwd, file), encoding="utf-8") as fh:
            body = fh.read()
    except OSError as exc:
        raise ConfigError(f"--launch-file {file}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--launch-file {file}: not a text file (a shell script is expected)") from None
    kind = _not_a_script(file, body)
    if kind is not None:
        raise ConfigError(f"--launch-file {file} is {_NOT_SCRIPTS[kind]}")
    return _from_text(body, file, at, file=os.path.join(at.cwd, file))


def read_argv(argv: Sequence[str], at: ReadAt) -> ServerLaunch:
    """The argv after ``--``: one command's words, already expanded."""
    return launch_from_words(argv, environ=at.environ, cwd=at.cwd, image_inspect=at.image_inspect)


def read_pid(pid: int, at: ReadAt) -> ServerLaunch:
    """``--pid PID``: a running server's ``/proc/PID`` (its own environment, root and mounts)."""
    proc_launch = read_process(pid, proc=at.proc, is_server=lambda a: find_server(a) is not None)
    words = list(proc_launch.argv)
    start = find_server(words, proc_launch.environ)
    assert start is not None
    if start.kind in ("docker", "podman"):
        run = parse_run(start.kind, (list(start.words) or words)[start.index:], environ=proc_launch.environ,
                        cwd=proc_launch.cwd or "/")
        return container_launch(run, start.kind, proc_launch.environ, image_inspect=at.image_inspect)
    env = {k: EnvValue(v, "launch env", f"/proc/{proc_launch.pid}/environ") for k, v in proc_launch.environ.items()}
    paths = PathMap(proc_launch.mounts, container=proc_launch.root is not None, root=proc_launch.root)
    cwd, notes = proc_launch.cwd, ()
    for parent, argv in ancestors(proc_launch.pid, proc=at.proc) if proc_launch.root is None else ():
        guest = traced_view(argv, environ=proc_launch.environ, cwd=proc_launch.cwd or "/")
        if guest is not None:  # proot traces its guest: /proc shows this machine's root, the server sees proot's
            paths, cwd = guest.paths, guest.workdir
            notes = (f"the server runs under proot (process {parent}: {' '.join(argv[:6])}): its paths are read "
                     "through proot's root and binds, as its command line gives them", *guest.notes)
            break
    return _server(words, start, "pid", env, paths, cwd, (), notes, environ=proc_launch.environ,
                   cwd=cwd or "/", process_env=False, pid=proc_launch.pid)


def read_compose(compose: tuple[str, Optional[str]], at: ReadAt) -> ServerLaunch:
    """``--compose FILE [--service NAME]``: the service's container start, its entrypoint script read beside the
    compose file or in its ``launchers/`` folders."""
    from exl3tool.launch.compose import compose_run

    path, service = compose
    run, entrypoint, notes = compose_run(path, service, environ=at.environ)
    project = os.path.dirname(os.path.abspath(os.path.join(at.cwd, path)))
    return container_launch(run, run.runner, at.environ, entrypoint, notes, launcher_dirs=_beside(project),
                            image_inspect=at.image_inspect)


# option -> (reader, the value it is given); one reader per form, one signature
FORMS: dict[str, Callable[..., ServerLaunch]] = {
    "--launch": read_text, "--launch-file": read_file, "the argv after --": read_argv, "--pid": read_pid,
    "--compose": read_compose,
}


def load_launch(*, text: Optional[str] = None, argv: Optional[Sequence[str]] = None, pid: Optional[int] = None,
                env_files: Sequence[str] = (), environ: Optional[Mapping[str, str]] = None,
                cwd: Optional[str] = None, proc: str = "/proc", file: Optional[str] = None,
                compose: Optional[str] = None, service: Optional[str] = None, image_inspect: Optional[str] = None,
                ) -> Optional[tuple[ServerLaunch, EnvLayers]]:
    """The launch and its environment layers, or None when no launch is given. One form at a time.

    Args:
        text, argv, pid, file, compose (with service): the launch, in one of its forms (a command line, its words,
            a running server's process id, a script file, a compose service).
        env_files: env files applied as the server's environment.
        environ, cwd, proc: the environment, directory and /proc the launch is read in.
        image_inspect: a saved ``docker image inspect`` of the container's image (its ENV and entrypoint).

    Returns:
        ``(ServerLaunch, EnvLayers)``, or None when no form is given.
    """
    values = {"--launch": text if text else None, "--launch-file": file, "the argv after --": argv or None,
              "--pid": pid, "--compose": (compose, service) if compose is not None else None}
    given = [n for n, v in values.items() if v is not None]
    if service is not None and compose is None:
        raise ConfigError("--service names a service of a compose file: give --compose FILE with it")
    if not given:
        return None
    if len(given) > 1:
        raise ConfigError(f"give one launch: {' and '.join(given)} were both given")
    environ = dict(os.environ if environ is None else environ)
    at = ReadAt(environ, cwd or os.getcwd(), proc, image_inspect)
    files: dict[str, EnvValue] = {}
    for path in env_files:
        files.update(read_env_file(path, environ=environ))
    launch = FORMS[given[0]](values[given[0]], at)
    if launch.form == "pid":
        container = launch.paths.root is not None
        return launch, EnvLayers(launch.env, files, None, container=container)
    container = launch.form in ("docker", "podman")
    return launch, EnvLayers(launch.env, files, environ if launch.process_env else None, container=container,
                             hidden=frozenset(launch.hidden))
