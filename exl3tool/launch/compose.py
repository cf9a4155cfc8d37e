"""A docker compose service as a container start: what ``docker compose up`` gives the server's container.

Rules as docker compose applies them (docs.docker.com, "Interpolation", "Set environment variables", "Environment
variables precedence", the Compose file reference "services"): ``${VAR}``, ``$VAR``, ``${VAR:-default}``,
``${VAR-default}``, ``${VAR:?err}``, ``${VAR?err}``, ``${VAR:+alt}``, ``${VAR+alt}`` and ``$$`` in values are
interpolated from the shell's environment, then the project directory's ``.env`` (the shell wins); an unset
variable without a default becomes "" (compose warns; exl3tool says so in a note). The container's environment is,
lowest first: the image's ``ENV``, ``env_file`` files in order, ``environment`` (list or mapping; a name without a
value takes the shell's). ``entrypoint``/``command`` are a list or a string split with shell-like rules (no shell
runs them); an ``entrypoint`` also drops the image's command. ``volumes`` short (``SRC:DST[:ro]``, SRC relative to
the project directory) and long (``type``, ``source``, ``target``, ``read_only``) syntax; ``working_dir``.
"""

from __future__ import annotations

import os
import posixpath
import re
import shlex
from collections.abc import Mapping
from typing import Any, Optional

from exl3tool.errors import ConfigError
from exl3tool.launch.container import ContainerRun, Mount, PathMap
from exl3tool.launch.env import EnvValue

__all__ = ["compose_run", "interpolate", "read_dotenv"]

_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)([-?+])((?:[^{}]|\{[^{}]*\})*))?\}"
                  r"|([A-Za-z_][A-Za-z0-9_]*))")
_NOT_FOLLOWED = ("extends", "include")


def interpolate(text: str, lookup: Mapping[str, str], where: str, unset: list[str]) -> str:
    """``text`` with compose's interpolation applied; names found unset (no default) are added to ``unset``."""
    def sub(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(6)
        colon, op, word = m.group(3), m.group(4), m.group(5) or ""
        value = lookup.get(name)
        missing = value is None or (colon == ":" and value == "")
        if op is None:
            if value is None:
                unset.append(name)
            return value or ""
        if op == "-":
            return interpolate(word, lookup, where, unset) if missing else value  # type: ignore[return-value]
        if op == "+":
            return "" if missing else interpolate(word, lookup, where, unset)
        if missing:  # ?
            raise ConfigError(f"{where}: ${{{name}}} is required ({word or 'not set'}); docker compose refuses it "
                              f"too: set {name} in this environment or the project's .env")
        return value  # type: ignore[return-value]
    return _VAR.sub(sub, text)


def _walk(node: Any, lookup: Mapping[str, str], where: str, unset: list[str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, lookup, where, unset)
    if isinstance(node, list):
        return [_walk(x, lookup, where, unset) for x in node]
    if isinstance(node, dict):
        return {k: _walk(v, lookup, where, unset) for k, v in node.items()}
    return node


def read_dotenv(path: str, lookup: Mapping[str, str], *, label: str) -> dict[str, str]:
    """A compose env file (``.env``, ``env_file``): ``NAME=VALUE`` lines, ``export`` allowed, quotes removed
    (single: literal; double and bare: ``${VAR}`` interpolated, earlier lines of the file included), ``#`` comments
    (a bare value's `` #`` starts one)."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise ConfigError(f"{label} {path}: cannot read it ({exc.strerror or exc})") from None
    out: dict[str, str] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line[len("export "):].lstrip() if line.startswith("export ") else line
        name, eq, value = line.partition("=")
        name = name.strip()
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", name):
            raise ConfigError(f"{label} {path} line {number}: {raw.strip()[:60]!r} is not NAME=VALUE")
        if not eq:
            if name in lookup:
                out[name] = lookup[name]
            continue
        value = value.strip()
        here = {**lookup, **out}
        if value[:1] == "'" and value.rstrip().endswith("'") and len(value) > 1:
            out[name] = value[1:value.rindex("'")]
        elif value[:1] == '"' and '"' in value[1:]:
            out[name] = interpolate(value[1:value.rindex('"')].replace('\\"', '"').replace("\\n", "\n"), here,
                                    f"{path} line {number}", [])
        else:
            value = re.split(r"\s+#", value, maxsplit=1)[0].strip()
            out[name] = interpolate(value, here, f"{path} line {number}", [])
    return out


def _words(value: Any, what: str, where: str) -> Optional[list[str]]:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise ConfigError(f"{where}: {what} cannot be split ({exc})") from None
    if isinstance(value, list):
        return [str(x) for x in value]
    raise ConfigError(f"{where}: {what} must be a list or a string")


def _host(src: str, project: str) -> Optional[str]:
    if src.startswith(("/", ".", "~")):
        return posixpath.normpath(os.path.join(project, os.path.expanduser(src)))
    return None  # a named volume


def _volumes(items: Any, project: str, where: str) -> list[Mount]:
    mounts: list[Mount] = []
    for item in items or []:
        if isinstance(item, str):
            parts = item.split(":")
            if len(parts) == 1:
                mounts.append(Mount(None, parts[0], item))
                continue
            opts = parts[2].split(",") if len(parts) > 2 else []
            mounts.append(Mount(_host(parts[0], project), parts[1], item, "ro" in opts))
        elif isinstance(item, dict):
            kind = item.get("type", "volume")
            target = item.get("target")
            if not target:
                raise ConfigError(f"{where}: a volume has no target ({item})")
            if kind == "tmpfs":
                continue
            src = str(item.get("source") or "")
            host = _host(src, project) if kind == "bind" and src else None
            create = (item.get("bind") or {}).get("create_host_path") if isinstance(item.get("bind"), dict) else None
            if host is not None and not os.path.exists(host) and create is not True:
                # the short syntax creates a missing source (compose's legacy rule), the long one only with
                # bind.create_host_path: true; otherwise the engine refuses the mount and the service never starts
                raise ConfigError(f"{where}: the bind volume {src}:{target} names {host}, which does not exist here: "
                                  "without bind.create_host_path: true the engine refuses it (bind source path does "
                                  "not exist), so this service never starts; create that folder first")
            mounts.append(Mount(host, str(target), f"{kind} {src}:{target}", bool(item.get("read_only"))))
        else:
            raise ConfigError(f"{where}: volumes must hold strings or mappings")
    return mounts


def _environment(value: Any, shell: Mapping[str, str], where: str) -> dict[str, Optional[str]]:
    out: dict[str, Optional[str]] = {}
    if isinstance(value, list):
        for item in value:
            name, eq, val = str(item).partition("=")
            out[name] = val if eq else shell.get(name)
    elif isinstance(value, dict):
        for name, val in value.items():
            if val is None:
                out[str(name)] = shell.get(str(name))
            else:
                out[str(name)] = ("true" if val else "false") if isinstance(val, bool) else str(val)
    elif value is not None:
        raise ConfigError(f"{where}: environment must be a list or a mapping")
    return out


def _runs_vllm(svc: dict) -> bool:
    text = " ".join(str(svc.get(k) or "") for k in ("image", "entrypoint", "command"))
    return "vllm" in text.lower()


# compose's own file names (compose-go cli/options.go): without -f, `docker compose` reads the first default file of
# the folder and merges the first override file beside it over it
_DEFAULT_FILES = ("compose.yaml", "compose.yml", "docker-compose.yml", "docker-compose.yaml")
_OVERRIDE_FILES = ("compose.override.yml", "compose.override.yaml", "docker-compose.override.yml",
                   "docker-compose.override.yaml")
_MERGED = "give the merged file: docker compose config > merged.yml, then --compose merged.yml"


def _one_file(path: str, lookup: Mapping[str, str], where: str) -> None:
    """Refuse a service that docker compose would merge from more files than ``path``: ``COMPOSE_FILE`` (the
    shell's or the project's .env) naming other files, or an override file beside a default-named one."""
    listed = lookup.get("COMPOSE_FILE")
    if listed:
        files = [f for f in listed.split(lookup.get("COMPOSE_PATH_SEPARATOR") or ":") if f]
        here = os.path.dirname(os.path.abspath(path))
        if [os.path.realpath(os.path.join(here, f)) for f in files] != [os.path.realpath(path)]:
            raise ConfigError(f"{where}: COMPOSE_FILE={listed} makes docker compose read {', '.join(files)} (merged "
                              f"in that order), which exl3tool does not merge; {_MERGED}")
        return
    if os.path.basename(path) not in _DEFAULT_FILES:
        return
    folder = os.path.dirname(os.path.abspath(path))
    override = next((f for f in _OVERRIDE_FILES if os.path.isfile(os.path.join(folder, f))), None)
    if override is not None:
        raise ConfigError(f"{where}: docker compose run without -f also reads {override} beside it and merges it over "
                          f"this file (its environment, volumes and command win), which exl3tool does not merge; "
                          f"{_MERGED}")


def compose_run(path: str, service: Optional[str], *, environ: Mapping[str, str],
                project_dir: Optional[str] = None) -> tuple[ContainerRun, Optional[list[str]], list[str]]:
    """The service's container start (a ``ContainerRun``), its entrypoint's words (None: the image's) and notes."""
    import yaml

    project = os.path.abspath(project_dir or os.path.dirname(os.path.abspath(path)))
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"--compose {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--compose {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict) or not data["services"]:
        raise ConfigError(f"--compose {path}: no services: mapping (a compose file names its services)")
    services: dict = data["services"]
    if service is None:
        runs = [name for name, svc in services.items() if isinstance(svc, dict) and _runs_vllm(svc)]
        if len(runs) != 1:
            which = ", ".join(runs or services)
            raise ConfigError(f"--compose {path}: {'no service runs' if not runs else 'several services run'} vllm "
                              f"({which}); name the server's with --service NAME")
        service = runs[0]
    if service not in services or not isinstance(services[service], dict):
        raise ConfigError(f"--compose {path}: no service {service!r} (services: {', '.join(services)})")
    where = f"--compose {path} service {service}"
    dotenv_path = os.path.join(project, ".env")
    dotenv = read_dotenv(dotenv_path, environ, label="the compose project's") if os.path.isfile(dotenv_path) else {}
    lookup = {**dotenv, **environ}  # the shell's environment wins over .env
    _one_file(path, lookup, f"--compose {path}")
    unset: list[str] = []
    svc = _walk(services[service], lookup, where, unset)
    for key in _NOT_FOLLOWED:
        if key in svc or key in data:
            raise ConfigError(f"{where}: `{key}` is not followed by exl3tool; write the service out in one file")
    notes = [f"the server's container is the compose service {service} of {path}"]
    if unset:
        notes.append(f"{where}: {', '.join(sorted(set(unset)))} not set in this environment or {dotenv_path}: "
                     "docker compose uses an empty string, and so does exl3tool")
    env: dict[str, EnvValue] = {}
    files = svc.get("env_file")
    for item in [files] if isinstance(files, (str, dict)) else (files or []):
        file, required = (item, True) if isinstance(item, str) else (item.get("path"), item.get("required", True))
        full = os.path.join(project, os.path.expanduser(str(file)))
        if not os.path.isfile(full):
            if required:
                raise ConfigError(f"{where}: env_file {file} does not exist (at {full}); docker compose refuses it too")
            continue
        for name, value in read_dotenv(full, environ, label=f"{where} env_file").items():
            env[name] = EnvValue(value, "launch env", f"env_file {file} of compose service {service}")
    for name, value in _environment(svc.get("environment"), environ, where).items():
        if value is not None:
            env[name] = EnvValue(value, "launch env", f"environment of compose service {service}")
    entrypoint = _words(svc.get("entrypoint"), "entrypoint", where)
    command = _words(svc.get("command"), "command", where) or []
    image = str(svc.get("image") or "")
    if not image:
        name = data.get("name") or os.path.basename(project)
        image = f"{name}-{service}"
        notes.append(f"{where} has no image: (it is built); its image is named {image} when built")
    runner = "podman" if os.path.basename(str(environ.get("DOCKER_HOST", ""))).startswith("podman") else "docker"
    mounts = _volumes(svc.get("volumes"), project, where)
    run = ContainerRun(runner, env, PathMap(tuple(mounts), container=True), svc.get("working_dir"),
                       None, image, tuple(command))
    return run, entrypoint, notes
