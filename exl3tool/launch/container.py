"""``docker run`` / ``podman run``: the container's environment, its volumes as a path map, and the server's words.

The options before the image are walked against ``flags.CONTAINER_FLAGS`` (pflag rules: ``--name value``,
``--name=value``, ``-e A=1``, ``-eA=1``, ``-it``); an option that is not in the table makes the image's position
unknowable, so it is refused naming it (write it as ``--opt=value`` to pass). After the image come the command's
words: with ``--entrypoint`` they are its arguments; without, the image's entrypoint is unknown, and they are read
as ``vllm serve ...``, ``serve ...`` (an entrypoint ``vllm``), ``python -m ...api_server ...``, or, when they start
with a flag or a model, as the arguments of an entrypoint ``vllm serve`` (said in a note).
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from exl3tool.errors import ConfigError
from exl3tool.launch.env import EnvValue, read_env_file
from exl3tool.launch.flags import container_flag

__all__ = ["Mount", "PathMap", "ContainerRun", "parse_run"]


@dataclass(frozen=True)
class Mount:
    """A bind mount: ``host`` (None for a named or anonymous volume, whose host path docker decides) at ``inside``."""

    host: Optional[str]
    inside: str
    spec: str  # as the launch wrote it
    readonly: bool = False
    # non-empty: ``host`` does not exist here and the runner refuses to start without it (its message, said
    # whole); ``launch.resolve`` refuses the launch unless writing the cache root there creates it
    refused: str = ""
    created_empty: bool = False  # ``host`` does not exist here and the runner creates it empty (docker's -v)


@dataclass(frozen=True)
class PathMap:
    """The server's paths as paths here: through bind mounts (the deepest mount wins), else a process root.

    ``--pid`` of a server in another mount namespace or a chroot has both: its bind mounts mapped to host paths
    from ``/proc/PID/mountinfo``, and ``/proc/PID/root`` for what is in its image. A ``ServerView``
    (``cache.serverfs``): ``server_realpath`` resolves links with it as the server does.
    """

    mounts: tuple[Mount, ...] = ()
    container: bool = False  # paths not under a mount are inside the image, not here
    root: Optional[str] = None  # --pid of a process in another mount namespace: /proc/PID/root

    @property
    def own_view(self) -> bool:
        """Whether the server's paths are read through a view of their own (a container's volumes, a root), not
        this machine's tree as it is (where the kernel resolves their links as the server does)."""
        return self.container or self.root is not None

    def to_host(self, path: str) -> Optional[str]:
        """Where ``path`` (absolute, as the server sees it) is here; None when it is inside the image only."""
        path = posixpath.normpath(path)
        if self.root is None and not self.container:
            return path
        best: Optional[Mount] = None
        for m in self.mounts:
            inside = posixpath.normpath(m.inside)
            if path == inside or path.startswith(inside.rstrip("/") + "/"):
                if best is None or len(inside) > len(posixpath.normpath(best.inside)):
                    best = m
        if (best is None or best.host is None) and self.root is not None:
            return self.root.rstrip("/") + path
        if best is None or best.host is None:
            return None
        rel = posixpath.relpath(path, posixpath.normpath(best.inside))
        return best.host if rel == "." else posixpath.join(best.host, rel)

    def mount_points(self) -> tuple[str, ...]:
        """The server's mount points (directories in its view, whatever their source is here)."""
        return tuple(posixpath.normpath(m.inside) for m in self.mounts)

    def mount_for(self, path: str) -> Optional[Mount]:
        """The mount ``path`` lies under (None outside every mount)."""
        path = posixpath.normpath(path)
        hits = [m for m in self.mounts if path == posixpath.normpath(m.inside)
                or path.startswith(posixpath.normpath(m.inside).rstrip("/") + "/")]
        return max(hits, key=lambda m: len(m.inside)) if hits else None


@dataclass(frozen=True)
class ContainerRun:
    """What a ``docker run`` / ``podman run`` gives: environment, path map, workdir, and the command's words."""

    runner: str  # docker | podman
    env: dict[str, EnvValue]
    paths: PathMap
    workdir: Optional[str]
    entrypoint: Optional[str]
    image: str
    command: tuple[str, ...]
    env_host: bool = False  # podman --env-host: the container gets the runner's whole environment
    ignored: tuple[str, ...] = ()


def _volume(spec: str, cwd: str) -> Mount:
    """``-v SRC:DST[:OPTS]``; SRC a path (bind) or a name (named volume), or ``-v DST`` (anonymous)."""
    parts = spec.split(":")
    if len(parts) == 1:
        return Mount(None, parts[0], spec)
    src, dst = parts[0], parts[1]
    opts = parts[2].split(",") if len(parts) > 2 else []
    host = posixpath.normpath(os.path.join(cwd, os.path.expanduser(src))) if src.startswith(("/", ".", "~")) else None
    return Mount(host, dst, spec, "ro" in opts)


def _mount(spec: str, cwd: str) -> Optional[Mount]:
    """``--mount type=bind,source=/a,target=/b[,readonly]``; tmpfs mounts give no path (None)."""
    fields: dict[str, str] = {}
    for item in spec.split(","):
        key, eq, value = item.partition("=")
        fields[key.strip().lower()] = value.strip() if eq else "true"
    kind = fields.get("type", "volume")
    target = fields.get("target") or fields.get("destination") or fields.get("dst")
    if not target:
        raise ConfigError(f"the launch's --mount {spec!r} has no target= (docker refuses it too)")
    if kind == "tmpfs":
        return None
    src = fields.get("source") or fields.get("src")
    host = posixpath.normpath(os.path.join(cwd, src)) if kind == "bind" and src else None
    ro = fields.get("readonly", fields.get("ro", "false")).lower() in ("true", "1", "")
    return Mount(host, target, spec, ro)


def _missing_source(runner: str, option: str, mount: Mount) -> Mount:
    """A bind whose host folder does not exist, as each runtime takes it: docker's ``-v`` creates it (an empty
    folder, owned by root), so the path map holds; docker's ``--mount type=bind`` and podman's ``-v`` and ``--mount``
    refuse to start the container (docker: "bind source path does not exist"; podman: "statfs HOST: no such file or
    directory", it never creates a source), and so does a dangling link: the mount is marked ``refused``, and the
    launch is refused naming it unless the cache root a warm writes lies in it (``launch.resolve``)."""
    if mount.host is None or os.path.exists(mount.host):
        return mount
    if runner == "docker" and option == "-v" and not os.path.islink(mount.host):
        return dataclasses.replace(mount, created_empty=True)
    said = ("invalid mount config for type \"bind\": bind source path does not exist" if runner == "docker"
            else f"Error: statfs {mount.host}: no such file or directory")
    return dataclasses.replace(mount, refused=(
        f"the launch's {runner} run {option} {mount.spec}: {mount.host} does not exist here, and {runner} refuses to "
        f"start the container ({said})" + (" (docker's -v would create it)" if runner == "docker" else "")))


def parse_run(runner: str, words: list[str], *, environ: Optional[Mapping[str, str]] = None,
              cwd: Optional[str] = None) -> ContainerRun:
    """Read the words after ``docker run`` / ``podman run``. ``environ`` is the runner's environment (``-e NAME``
    without a value takes it from there), ``cwd`` where relative host paths are taken from.

    >>> parse_run("docker", ["-e", "A=1", "-v", "/srv/m:/models/m:ro", "img", "serve", "/models/m"]).command
    ('serve', '/models/m')
    """
    env_src = os.environ if environ is None else environ
    cwd = cwd or os.getcwd()
    env: dict[str, EnvValue] = {}
    mounts: list[Mount] = []
    workdir = entrypoint = None
    env_host = rootfs = False
    ignored: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            i += 1
            break
        if not word.startswith("-") or word == "-":
            break
        values: list[tuple[str, str]] = []  # (role, value)
        if word.startswith("--"):
            name, eq, inline = word.partition("=")
            flag = container_flag(name)
            if flag is None and not eq:
                raise ConfigError(f"the launch's {runner} run option {name} is not one exl3tool knows, so where the "
                                  f"image name is cannot be told; write it as {name}=VALUE (or drop it)")
            if flag is None:  # --unknown=value: its value is attached, the image position is clear
                ignored.append(word)
                i += 1
                continue
            if flag.takes_value and not eq:
                if i + 1 >= len(words):
                    raise ConfigError(f"the launch's {runner} run option {name} has no value")
                inline, i = words[i + 1], i + 1
            values.append((flag.role, inline if flag.takes_value else "true"))
            if not flag.role:
                ignored.append(f"{name} {inline}" if flag.takes_value else name)
            i += 1
        else:  # short options: -it, -e A=1, -eA=1, -v/a:/b
            chars = word[1:]
            j = 0
            while j < len(chars):
                flag = container_flag("-" + chars[j])
                if flag is None:
                    raise ConfigError(f"the launch's {runner} run option -{chars[j]} (in {word}) is not one exl3tool "
                                      "knows, so where the image name is cannot be told; drop it or spell it long")
                if flag.takes_value:
                    rest = chars[j + 1:].removeprefix("=")
                    if not rest:
                        if i + 1 >= len(words):
                            raise ConfigError(f"the launch's {runner} run option -{chars[j]} has no value")
                        rest, i = words[i + 1], i + 1
                    values.append((flag.role, rest))
                    if not flag.role:
                        ignored.append(f"-{chars[j]} {rest}")
                    break
                values.append((flag.role, "true"))
                j += 1
            i += 1
        for role, value in values:
            if role == "env":
                key, eq, val = value.partition("=")
                if eq:
                    env[key] = EnvValue(val, "launch env", f"{runner} run -e {key}")
                elif key in env_src:  # -e NAME: the runner's value
                    env[key] = EnvValue(env_src[key], "launch env", f"{runner} run -e {key} (from this environment)")
            elif role == "env_file":
                path = os.path.join(cwd, os.path.expanduser(value))
                for key, item in read_env_file(path, environ=env_src, label=f"the launch's {runner} run --env-file",
                                               source="launch env", dry_run_form=False).items():
                    env[key] = item
            elif role == "volume":
                mounts.append(_missing_source(runner, "-v", _volume(value, cwd)))
            elif role == "mount":
                m = _mount(value, cwd)
                if m is not None:
                    mounts.append(_missing_source(runner, "--mount", m))
            elif role == "workdir":
                workdir = value
            elif role == "entrypoint":
                entrypoint = value
            elif role == "env_host":
                env_host = value != "false"
            elif role == "rootfs":
                rootfs = value != "false"
    if i >= len(words):
        raise ConfigError(f"the launch's {runner} run names no image (nothing after its options)")
    image, command = words[i], tuple(words[i + 1:])
    root = posixpath.normpath(os.path.join(cwd, image)) if rootfs else None  # podman --rootfs DIR: read here
    return ContainerRun(runner, env, PathMap(tuple(mounts), container=True, root=root), workdir, entrypoint, image,
                        command, env_host, tuple(ignored))
