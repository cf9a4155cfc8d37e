"""From a launch to the settings of a look-up, each with where it came from.

Precedence, for every setting: exl3tool's own flags, then the launch (its arguments; its environment: ``-e``,
its env files, ``env A=1``, ``/proc/PID/environ``), then ``--env-file`` files, then exl3tool's environment (not
for ``--pid``, whose environment is the server's whole one), then the server's default. A setting nothing named
is listed as defaulted with what that means and how to pass it.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from exl3tool.cache.hub import hub_cache_dir, hub_offline
from exl3tool.cache.serverfs import server_realpath
from exl3tool.errors import ConfigError
from exl3tool.launch.container import Mount, PathMap
from exl3tool.launch.env import EnvLayers, EnvValue
from exl3tool.launch.parse import ServerArgs
from exl3tool.releases import (
    ForkModules, ReleaseChoice, ServerRelease, edit_distance, no_online_encoding, resolve_release, rule_splits,
    server_cache_root, server_vllm_root, variable_note,
)
from exl3tool.plan.request import DTYPE_SPELLINGS, serving_dtype_name

__all__ = ["Setting", "ServerLaunch", "Explicit", "LaunchSettings", "resolve_launch", "resolve_cache_root", "SEQUENCE_PARALLEL_ALL2ALL",
           "unknown_flag_message", "unknown_flag_warning", "close_flag_matches"]

# the fork's ParallelConfig.use_sequence_parallel_moe: these all2all backends with EP, TP > 1 and DP > 1
SEQUENCE_PARALLEL_ALL2ALL = ("allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "mori",
                             "nixl_ep")
_LOAD_FORMATS = ("auto", "safetensors", "pt", "npcache", "dummy", "fastsafetensors", "instanttensor")
_HOW_TO_PASS = ("an image may set it in its ENV: pass it with -e NAME=VALUE in the launch or in an --env-file "
                "FILE, or read a running server with --pid PID")


def _how_to_pass(launch: "ServerLaunch", var: str) -> str:
    """How to give ``var``; when the image's ENV could not be read, that first (it may be where ``var`` is set)."""
    if launch.image_note:
        return (f"the image's ENV, where {var} may be set, was not read: {launch.image_note}; pass {var} with "
                f"--env-file FILE (a line {var}=VALUE) or -e {var}=VALUE in the launch")
    if launch.form == "command":  # no image: the launch line, its script or an env file sets it
        return (f"set it where the server starts ({var}=VALUE before the command, or export in its script), in an "
                "--env-file FILE, or read a running server with --pid PID")
    return _HOW_TO_PASS


@dataclass(frozen=True)
class Setting:
    """One setting's value and where it came from (``source`` a kind, ``detail`` the flag, variable or file)."""

    value: Any
    source: str  # flag | launch argument | launch env | env file | process env | default
    detail: str = ""

    def as_json(self) -> dict:
        return {"value": self.value, "source": self.source, "detail": self.detail}


@dataclass(frozen=True)
class ServerLaunch:
    """A launch as read: how the server starts, its arguments, its own environment and how its paths map here."""

    form: str  # command | docker | podman | pid
    entry: str  # vllm serve | python -m vllm.entrypoints.openai.api_server
    args: ServerArgs
    env: dict[str, EnvValue]
    paths: PathMap
    workdir: Optional[str] = None
    process_env: bool = True  # whether exl3tool's environment is a layer (not for --pid)
    ignored: tuple[str, ...] = ()  # wrapper words and runner options that change nothing
    notes: tuple[str, ...] = ()
    pid: Optional[int] = None
    image_note: str = ""  # why the image's ENV could not be read ("" when read, or no image)
    image: Optional[Any] = None  # the image's settings (launch.image.ImageSettings) when read
    image_name: str = ""  # the image the launch runs ("" when none)
    hidden: tuple[str, ...] = ()  # variables a wrapper removed from the launching environment (env -u, a user's HOME)
    home_unknown: str = ""  # why the server's HOME is not known (a wrapper changed the user): "" when it is


@dataclass(frozen=True)
class Explicit:
    """exl3tool's own flags, None where not given on the command line."""

    model: Optional[str] = None
    revision: Optional[str] = None
    server_path: Optional[str] = None
    tp_sizes: Optional[tuple[int, ...]] = None
    dtype: Optional[str] = None
    bits: Optional[int] = None
    quantization_config: Optional[str] = None
    encoder_root: Optional[str] = None
    encoder_revision: Optional[str] = None
    encoder_source: Optional[str] = None
    cache_dir: Optional[str] = None
    server_release: Optional[ReleaseChoice] = None  # --server-release, resolved (ServerRequest.release_choice)


@dataclass(frozen=True)
class LaunchSettings:
    """The look-up's settings a launch gives (each with its source), and what a ServerRequest takes from them."""

    launch: ServerLaunch
    settings: dict[str, Setting]
    model: str  # what exl3tool reads here (a local path or a Hub repo id)
    server_path: Optional[str]
    revision: Optional[str]
    tp_size: int
    dtype: str
    bits: int
    quantization_config: Optional[str]
    encoder_root: str
    encoder_revision: Optional[str]
    encoder_source: Optional[str]
    cache_dir: str  # here
    language_model_only: bool
    environ: dict[str, str] = field(default_factory=dict)
    defaulted: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    view: Optional[PathMap] = None  # the server's filesystem, when its model path is resolved there (not ours)
    hf_overrides: Optional[str] = None  # the launch's --hf-overrides, as canonical JSON
    lookup_off: tuple[str, ...] = ()  # why the launched server makes no look-up at all ("" reasons: it makes some)
    server_release: Optional[str] = None  # the release whose rules were applied (exl3tool.releases)
    image_labels: dict[str, str] = field(default_factory=dict)  # the server image's labels (launch.image), as read
    release: Optional[ReleaseChoice] = None  # that release, where it came from and what was assumed
    # the launch's own model folder as seen here (through its volumes), also when MODEL replaced it; None when the
    # launch serves a Hub repo id or its folder is not seen here
    model_seen_here: Optional[str] = None

    @property
    def image(self) -> Optional[Any]:
        """The server image's settings (``launch.image.ImageSettings``: ENV, labels, entrypoint, their source)."""
        return self.launch.image

    @property
    def server_lookup(self) -> bool:
        """Whether the launched server looks anything up in the cache (False: it encodes nothing online, or never
        reads the cache)."""
        return not self.lookup_off

    def as_json(self) -> dict:
        """The ``launch`` block of ``--json``: form, settings with sources, defaulted and ignored flags (a launch
        with a flag the fork does not know is refused before this exists)."""
        return {
            "form": self.launch.form, "entry": self.launch.entry, "pid": self.launch.pid,
            "server_lookup": self.server_lookup, "lookup_off": list(self.lookup_off),
            "settings": {k: v.as_json() for k, v in self.settings.items()},
            "defaulted": list(self.defaulted), "warnings": list(self.warnings), "notes": list(self.notes),
            "ignored": list(self.launch.ignored) + list(self.launch.args.ignored),
            "image": self.launch.image.as_json() if self.launch.image is not None else None,
        }

    def lines(self) -> list[str]:
        """One line per setting, for stderr: ``name = value (source: detail)``."""
        out = []
        for name, s in self.settings.items():
            value = "(none)" if s.value is None else s.value
            out.append(f"{name} = {value} ({s.source}{': ' + s.detail if s.detail else ''})")
        return out


def close_flag_matches(unknown: tuple[str, ...]) -> dict[str, str]:
    """Unknown flags within edit distance 2 of a flag the server knows (a typo the server refuses), each with that
    flag; the rest are taken for flags of a newer release than exl3tool's table.

    A known name with the other number of dashes (``--tp`` for ``-tp``, ``-tensor-parallel-size``) is 1 edit away:
    the fork's parser (argparse, ``allow_abbrev`` on) takes ``-tp`` only as written and no long flag starts with
    ``--tp``, so it refuses the line (unrecognized arguments)."""
    from exl3tool.launch.flags import VLLM_FLAGS, VLLM_SHORT

    out: dict[str, str] = {}
    for u in unknown:
        flag = u.split(" ", 1)[0].partition("=")[0]
        name, names, spell = ((flag[2:].partition(".")[0], VLLM_FLAGS, "--{}") if flag.startswith("--")
                              else (flag, VLLM_SHORT, "{}"))
        # nearest first; among equals, the longest shared start (-tpp: -tp before -dpp)
        known = [(edit_distance(name, k), -len(os.path.commonprefix([name, k])), spell.format(k)) for k in names]
        other = "-" + name if flag.startswith("--") else flag.lstrip("-")  # the same name, the other dashes
        if other in (VLLM_SHORT if flag.startswith("--") else VLLM_FLAGS):
            known.append((1, -len(other), other if flag.startswith("--") else "--" + other))
        best = min(known, default=None)
        if best is not None and 0 < best[0] <= 2:
            out[flag] = best[2]
    return out


def unknown_flag_message(unknown: tuple[str, ...], close: Optional[dict[str, str]] = None) -> str:
    """One line for an unknown flag that is a close match of a known one (a typo: vLLM refuses the line)."""
    close = close_flag_matches(unknown) if close is None else close
    flag, near = next(iter(close.items())) if close else (unknown[0].split(" ", 1)[0].partition("=")[0], "")
    hint = f"; did you mean {near}?" if near else "; check the spelling against `vllm serve --help`"
    others = [f for f in (u.split(" ", 1)[0].partition("=")[0] for u in unknown) if f != flag]
    more = f" (and {len(others)} more: {', '.join(others[:3])})" if others else ""
    return (f"the launch's {flag} is not a flag of the server: vLLM refuses the line (unrecognized arguments), so "
            f"this server never starts{more}{hint}")


def unknown_flag_warning(unknown: tuple[str, ...]) -> str:
    """One line naming flags exl3tool's table does not know and that are no typo of one it knows: every fork release
    adds flags, so they are taken as changing no look-up (check them if a hit is missed)."""
    names = ", ".join(u.split(" ", 1)[0].partition("=")[0] for u in unknown)
    return (f"flags exl3tool does not know: {names}; taken as flags of a newer server release that change no "
            "look-up (none is within 2 edits of a known flag); if one changes the model, TP size, dtype or overlay, "
            "pass it to exl3tool as its own option")


def _where_env(launch: ServerLaunch) -> str:
    """Where the server's environment was looked for, for a message."""
    if launch.form == "pid":
        return f"/proc/{launch.pid}/environ"
    if launch.form in ("docker", "podman"):
        image = "the image's ENV was not read" if launch.image_note else "the image's ENV"
        return f"the launch's -e/--env/--env-file, --env-file files and {image}"
    return "the launch's assignments and exports, --env-file files and this environment"


def _looks_like_path(text: str) -> bool:
    return text.startswith(("/", "./", "../", "~")) or text in (".", "..")


def _arg(args: ServerArgs, name: str) -> Optional[tuple[str, str]]:
    return args.values.get(name)


def _int_arg(args: ServerArgs, name: str, default: int) -> tuple[int, Optional[str]]:
    raw = _arg(args, name)
    if raw is None:
        return default, None
    try:
        value = int(raw[0])
    except ValueError:
        raise ConfigError(f"the launch's {raw[1]} {raw[0]!r} is not an integer (the server refuses it too)") from None
    if value < 1:
        raise ConfigError(f"the launch's {raw[1]} {value} must be at least 1 (the server refuses it too)")
    return value, raw[1]


def _bool_arg(args: ServerArgs, name: str) -> bool:
    raw = _arg(args, name)
    return raw is not None and raw[0].strip().lower() in ("true", "1", "yes")


def _json_arg(args: ServerArgs, name: str) -> Optional[Any]:
    raw = _arg(args, name)
    if raw is None:
        return None
    try:
        return json.loads(raw[0])
    except json.JSONDecodeError as exc:
        raise ConfigError(f"the launch's {raw[1]} is not valid JSON ({exc.msg} at column {exc.colno}): "
                          f"{raw[0][:60]!r}; the server takes it as inline JSON") from None


class _Builder:
    """Collects settings, defaulted sentences, warnings and notes while resolving."""

    def __init__(self, launch: ServerLaunch, layers: EnvLayers) -> None:
        self.launch, self.layers = launch, layers
        self.settings: dict[str, Setting] = {}
        self.defaulted: list[str] = []
        self.warnings: list[str] = []
        self.notes: list[str] = []
        self.view: Optional[PathMap] = None  # set when the identity is computed in the server's filesystem
        self.choice: Optional[ReleaseChoice] = None  # the server release whose rules apply: _release sets it first
        self.model_seen: Optional[str] = None  # the launch's own model folder as seen here (None: not seen, or Hub)

    def put(self, name: str, value: Any, source: str, detail: str = "") -> Any:
        self.settings[name] = Setting(value, source, detail)
        return value

    def arg(self, name: str, value: Any, how: str) -> Any:
        return self.put(name, value, "launch argument", how)

    def env(self, var: str) -> Optional[EnvValue]:
        return self.layers.get(var)

    def put_env(self, name: str, var: str, item: EnvValue) -> str:
        detail = item.detail if var in item.detail else f"{var}" + (f" ({item.detail})" if item.detail else "")
        if item.source == "process env" and self.launch.form in ("docker", "podman"):
            self.notes.append(f"{var} came from this environment, which the container does not inherit: make sure "
                              "the image sets it the same, or pass it with -e in the launch")
        return self.put(name, item.value, item.source, detail)


def _unknown_home(launch: ServerLaunch) -> str:
    """Why the server's HOME is not known (a wrapper changed its user), as the start of a message; "" when it is."""
    return f"{launch.home_unknown}; " if launch.home_unknown else ""


def _server_path(path: str, launch: ServerLaunch, what: str) -> str:
    """An absolute server-side path for ``path`` (relative: from the launch's working directory)."""
    if posixpath.isabs(path):
        return posixpath.normpath(path)
    if path.startswith("~"):
        home = launch.env.get("HOME")
        if home is None:
            raise ConfigError(f"{_unknown_home(launch)}the launch's {what} {path!r} starts with ~ and the server's "
                              "HOME is not known; give an absolute path")
        return posixpath.normpath(home.value + path[1:])
    if launch.workdir:
        return posixpath.normpath(posixpath.join(launch.workdir, path))
    if launch.form == "command" and not launch.paths.container:
        return os.path.abspath(path)
    raise ConfigError(f"the launch's {what} {path!r} is relative and the server's working directory is not known "
                      "(give -w/--workdir in the launch or an absolute path)")


OBJECT_STORAGE_SCHEMES = ("s3://", "gs://", "az://")  # vLLM's runai_utils.SUPPORTED_SCHEMES


def _object_storage(b: _Builder, name: str, how: str) -> None:
    """An object-storage model (``s3://``, ``gs://``, ``az://``): vLLM's ``ModelConfig.
    maybe_pull_model_tokenizer_for_runai`` pulls its ``*.json``, ``*.py`` and ``*.model`` files into
    ``$VLLM_ASSETS_CACHE/model_streamer/<sha256(url)[:8]>`` (``VLLM_ASSETS_CACHE`` default:
    ``$XDG_CACHE_HOME/vllm/assets``, else ``~/.cache/vllm/assets``; ``vllm/transformers_utils/runai_utils.py``,
    ``vllm/envs.py``), serves that folder and streams the weights with runai_streamer. The fork's model identity is
    then that folder's: its path, its config files' digests and no shard (none is pulled). exl3tool plans from a
    local checkpoint's shards and does not reproduce that identity: refused, naming the folder."""
    if not name.lower().startswith(OBJECT_STORAGE_SCHEMES):
        return
    import hashlib

    assets = b.env("VLLM_ASSETS_CACHE")
    if assets is not None:
        root = assets.value
    else:
        xdg, home = b.env("XDG_CACHE_HOME"), b.env("HOME")
        base = xdg.value if xdg is not None else posixpath.join(home.value if home is not None else "~", ".cache")
        root = posixpath.join(base, "vllm", "assets")
    folder = posixpath.join(root, "model_streamer", hashlib.sha256(name.encode()).hexdigest()[:8])
    raise ConfigError(
        f"the launch's model {name} ({how}) is in object storage: vLLM pulls its config files into {folder} and "
        "serves that folder, streaming the weights with --load-format runai_streamer; the fork then keys entries by "
        "that folder (its path, its config files' sha256, no shard), which exl3tool does not reproduce from a local "
        "copy: serve the model from a local folder or a Hub id with a pinned --revision for a warmed start")


def _model(b: _Builder, launch: ServerLaunch, explicit: Explicit) -> tuple[str, Optional[str]]:
    """(what exl3tool reads, the server's path for --server-path or None) and the model settings."""
    raw = _arg(launch.args, "model")
    if raw is None and explicit.model is None:
        if launch.entry.startswith("python -m"):
            raise ConfigError("no model in the launch: this entry point takes --model MODEL (without it the server "
                              "serves vLLM's default model); add it, or pass MODEL to exl3tool")
        raise ConfigError("no model in the launch (vllm serve MODEL, --model MODEL or model: in its --config file); "
                          "add it, or pass MODEL to exl3tool"
                          + (f" (the unknown flag {launch.args.unknown[0]} took a word as its value)"
                             if launch.args.unknown else ""))
    if raw is None:
        b.put("model", explicit.model, "flag", "MODEL")
        if explicit.server_path:
            b.put("server_path", explicit.server_path, "flag", "--server-path")
        return explicit.model, explicit.server_path  # type: ignore[return-value]
    name, how = raw
    b.arg("model", name, how)
    _object_storage(b, name, how)
    paths = launch.paths
    local_here: Optional[str] = None
    server: Optional[str] = None
    if _looks_like_path(name) or launch.form in ("command", "pid") or launch.paths.root is not None:
        try:
            server = _server_path(name, launch, "model")
        except ConfigError:
            if _looks_like_path(name):
                raise
            server = None  # a relative name with no known working directory: a Hub repo id
        host = _seen(paths, server) if server else None
        if host is not None:
            local_here = host
        elif not _looks_like_path(name):
            server = None  # a Hub repo id
    elif launch.workdir and paths.container:  # a relative folder under the container's working directory?
        candidate = posixpath.join(launch.workdir, name)
        host = _seen(paths, candidate)
        if host is not None:
            server, local_here = posixpath.normpath(candidate), host
    if server is not None and local_here is None and explicit.model is None:
        mount = paths.mount_for(server)
        if mount is not None and (mount.refused or mount.created_empty):
            raise ConfigError(_model_bind_message(mount, name))
        if paths.to_host(server) is not None:  # on a mount, yet not seen: a link that leaves the mounts?
            try:
                server_realpath(paths, server, "the launch's model")
            except ConfigError as exc:
                raise ConfigError(f"{exc}; or pass MODEL, a copy here with mtimes kept, with --server-path") from None
        where = ("it is not on a bind mount of the launch" if paths.container and paths.to_host(server) is None
                 else f"it does not exist here at {paths.to_host(server)}")
        raise ConfigError(f"the launch's model {name}: {where}; pass MODEL, a copy here with mtimes kept (cp -a, "
                          "rsync -a), and its identity is computed with the launch's path")
    if server is None and explicit.model is not None and explicit.model != name:
        raise ConfigError(f"the launch serves the Hub repo {name}, whose identity is its commit, but MODEL (or "
                          f"hydrate's SOURCE) is {explicit.model}: drop MODEL (exl3tool reads {name} from the Hub or "
                          "its cache; hydrate needs the launch of SOURCE's own folder), or make the launch serve the "
                          "folder")
    b.model_seen = local_here
    if explicit.model is not None:
        b.put("model_here", explicit.model, "flag", "MODEL")
    elif local_here is not None:
        b.put("model_here", local_here, "launch argument",
              "the launch's path, read here" if local_here == server else f"{name} through the launch's volumes")
    model_here = explicit.model if explicit.model is not None else (local_here or name)
    if explicit.server_path is not None:
        b.put("server_path", explicit.server_path, "flag", "--server-path")
        return model_here, explicit.server_path
    if server is None:
        return model_here, None  # a Hub repo id
    if explicit.model is None and not paths.container and paths.root is None:
        # the server's own filesystem: the identity is computed from the path as it resolves here
        return (name if launch.form == "command" and not launch.workdir else server), None  # as given: transformers reads it unresolved
    b.put("server_path", server, "launch argument", f"{how}: the identity uses the server's path")
    if explicit.model is None:
        b.view = paths  # the server's path is resolved in its own filesystem, links read through the mounts
        resolved = server_realpath(paths, server, "the launch's model")
        if resolved != server:
            b.put("server_path_resolved", resolved, "launch argument",
                  f"{server} resolved in the server's filesystem (its links read through the launch's mounts)")
    return model_here, server


_HF_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME",
            "XDG_CACHE_HOME", "HOME")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")  # huggingface_hub's REGEX_COMMIT_HASH


def _hf_env(b: _Builder) -> dict[str, str]:
    """The server's values of the variables huggingface_hub reads for its cache and offline mode; a container does
    not inherit ours (an image's ENV must come from the launch or an --env-file)."""
    if b.launch.form in ("docker", "podman"):
        given = {**b.layers.files, **b.layers.launch}
        return {var: given[var].value for var in _HF_VARS if var in given}
    return {var: item.value for var in _HF_VARS if (item := b.env(var)) is not None}


def _offline_snapshot(b: _Builder, launch: ServerLaunch, repo: str, revision: Optional[str]) -> tuple[str, str]:
    """HF_HUB_OFFLINE: the snapshot folder vLLM serves instead of the repo id, and where it is here.

    vLLM's ``EngineArgs.__post_init__`` (``vllm/engine/arg_utils.py``) replaces the model by
    ``get_model_path(model, revision)`` (``vllm/transformers_utils/repo_utils.py``): ``snapshot_download(repo,
    revision, local_files_only=True)``, which takes a 40-hex revision as the commit, else reads
    ``refs/<revision>`` (default ``main``) of ``<HF_HUB_CACHE>/models--org--name``, and returns
    ``snapshots/<commit>`` when it exists; else the server does not start (LocalEntryNotFoundError).
    """
    env = _hf_env(b)
    if not any(v in env for v in _HF_VARS[2:]):
        raise ConfigError(f"{_unknown_home(launch)}the launch serves the Hub repo {repo} with HF_HUB_OFFLINE, so the "
                          "server reads it from its "
                          "Hub cache, under a HOME the launch does not give: pass HF_HUB_CACHE (or HF_HOME, HOME) "
                          "with -e in the launch or in an --env-file")
    cache = _server_path(str(hub_cache_dir(env)), launch, "Hub cache (HF_HUB_CACHE)")
    storage = posixpath.join(cache, "models--" + repo.replace("/", "--"))
    rev = revision or "main"
    paths = launch.paths
    if _COMMIT.match(rev):
        commit, how = rev, f"--revision {rev} is a commit"
    else:
        ref = posixpath.join(storage, "refs", rev)
        here = _seen(paths, ref)
        if here is None or not os.path.isfile(here):
            raise ConfigError(f"the launch serves the Hub repo {repo} with HF_HUB_OFFLINE, and its Hub cache has no "
                              f"{ref} (here: {paths.to_host(ref) or 'not on a mount'}): the server would not start "
                              f"(LocalEntryNotFoundError); download {repo} into {cache} or start the server with the "
                              "full commit hash as --revision")
        with open(here, encoding="utf-8") as fh:
            commit = fh.read()  # taken as read, as snapshot_download does (no strip)
        how = f"refs/{rev} holds {commit.strip()}"
    snapshot = posixpath.join(storage, "snapshots", commit)
    here = _seen(paths, snapshot)
    if here is None:
        raise ConfigError(f"the launch serves the Hub repo {repo} with HF_HUB_OFFLINE ({how}), and {snapshot} is not "
                          f"in its Hub cache (here: {paths.to_host(snapshot) or 'not on a mount'}): the server would "
                          f"not start (LocalEntryNotFoundError); download {repo} into {cache}")
    var = "HF_HUB_OFFLINE" if env.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"  # huggingface_hub's order
    item = b.env(var)
    b.put("hf_hub_offline", True, item.source if item else "launch env", f"{var}={env[var]}")
    b.put("server_path", snapshot, "launch argument",
          f"HF_HUB_OFFLINE: vLLM serves the snapshot folder of {repo} in its Hub cache {cache} ({how}), so the "
          "identity is that directory's, not the Hub repo's")
    b.view = paths
    return here, snapshot


def _seen(paths: PathMap, server: str) -> Optional[str]:
    """Where the server's path ``server`` is here once resolved as the server resolves it, if it exists."""
    try:
        here = paths.to_host(server_realpath(paths, server))
    except ConfigError:
        return None
    return here if here is not None and os.path.exists(here) else None


def _cache_dir(b: _Builder, launch: ServerLaunch, explicit: Explicit, need_cache: bool = True) -> str:
    """The server's cache root (setting ``cache_dir``) and where exl3tool writes it (``cache_dir_here``); without
    ``need_cache`` (``identity``) a root exl3tool cannot reach is a warning, not an error, and ``""`` returned."""
    def get(var: str) -> Optional[str]:
        it = b.env(var)
        return None if it is None else it.value

    assert b.choice is not None
    rel = b.choice.release
    _legacy_cache_dir(b, rel)
    server: Optional[str]
    server, var = server_cache_root(get, rel)  # the one rule (exl3tool.releases), per release
    if explicit.cache_dir is None and not b.choice.determined:  # the release not named: does the root depend on it?
        found = rule_splits(b.choice.candidates, root_env=get)
        if found:
            b.choice = replace(b.choice, splits=(*b.choice.splits, *found))
    home = b.env("HOME")
    if var:
        item = b.env(var)
        assert item is not None
        if var == "VLLM_EXL3_ONLINE_CACHE_DIR":
            b.put_env("cache_dir", var, item)
        else:
            where = "VLLM_CACHE_ROOT/exl3_online" if var == "VLLM_CACHE_ROOT" else "XDG_CACHE_HOME/vllm/exl3_online"
            b.put("cache_dir", server, item.source, f"{where} ({item.detail or item.source})")
    elif home is not None:
        server = posixpath.join(home.value, server[2:])
        b.put("cache_dir", server, "default", f"~/.cache/vllm/exl3_online with HOME={home.value}")
    elif explicit.cache_dir is None and not need_cache:
        whose = "the container's" if launch.form in ("docker", "podman") else "the server's"
        b.warnings.append(f"{_unknown_home(launch)}the server's cache root is under {whose} HOME, which the launch "
                          "does not give")
        return ""
    elif explicit.cache_dir is None:
        whose = "the container's" if launch.form in ("docker", "podman") else "the server's"
        raise ConfigError(f"{_unknown_home(launch)}the server's cache root is ~/.cache/vllm/exl3_online of {whose} "
                          "HOME, which the launch does not give; pass VLLM_EXL3_ONLINE_CACHE_DIR (-e in the launch or "
                          "--env-file) or exl3tool's --cache-dir")
    else:
        server = None
    if var in ("", "XDG_CACHE_HOME") and server is not None:
        b.defaulted.append("VLLM_EXL3_ONLINE_CACHE_DIR and VLLM_CACHE_ROOT were not given: the server's cache "
                           f"root is its default {server}; "
                           + _how_to_pass(launch, "VLLM_EXL3_ONLINE_CACHE_DIR"))
    xdg = b.env("XDG_CACHE_HOME")
    module = rel.cache_module
    if not var.startswith("VLLM_") and xdg is not None and module is not None and not module.xdg_cache_home:
        b.warnings.append(f"XDG_CACHE_HOME={xdg.value} is ignored by {rel.name}'s cache module (its root is "
                          "VLLM_CACHE_ROOT, else ~/.cache/vllm: Gilded Gnosis up to r33): the server's cache is "
                          f"{server or '~/.cache/vllm/exl3_online'}; newer releases would use "
                          f"{posixpath.join(xdg.value, 'vllm', 'exl3_online')}")
    if server is not None and server.startswith("~"):
        home = b.env("HOME")
        if home is None:
            raise ConfigError(f"{_unknown_home(launch)}the server's cache root {server} starts with ~ and its HOME "
                              "is not known; pass an absolute VLLM_EXL3_ONLINE_CACHE_DIR or exl3tool's --cache-dir")
        server = home.value + server[1:]
    if explicit.cache_dir is not None:
        b.put("cache_dir_here", explicit.cache_dir, "flag", "--cache-dir")
        return explicit.cache_dir
    assert server is not None
    server = _server_path(server, launch, "cache root")
    paths = launch.paths
    resolved, here = server, server  # this machine's tree: the kernel resolves its links as the server does
    if paths.own_view:  # the server resolves the root's links in its own view (a proot/chroot root, volumes)
        try:
            resolved = server_realpath(paths, server, "the server's cache root", unseen="keep")
        except ConfigError as exc:
            if need_cache:
                raise ConfigError(f"{exc}; or pass --cache-dir") from None
            b.warnings.append(f"{exc}: entries written here would not reach the server")
            return ""
        here = paths.to_host(resolved)
    if here is None and not need_cache:
        b.warnings.append(f"the server's cache root {server} is not on a bind mount of the launch: entries written "
                          "here would not reach it")
        return ""
    if here is None:
        raise ConfigError(f"the server's cache root {server} is not on a bind mount of the launch, so entries "
                          f"written here would never reach it: mount it (-v HOST_DIR:{server}) or pass --cache-dir")
    root = posixpath.normpath(resolved)
    inner = [m for m in paths.mounts if paths.own_view and posixpath.normpath(m.inside).startswith(root + "/")
             and posixpath.normpath(m.host or "") != posixpath.join(here, posixpath.relpath(m.inside, root))]
    if inner:  # the server's entries under it live elsewhere here, and exl3tool writes one folder
        raise ConfigError(f"the launch mounts {inner[0].spec} inside the server's cache root {server}: the server "
                          f"reads what is under {inner[0].inside} from {inner[0].host or 'a named volume'}, the rest "
                          f"from {here}, and exl3tool writes one folder; bind the cache root alone")
    mount = paths.mount_for(resolved)
    if mount is not None and mount.readonly:
        b.warnings.append(f"the server's cache root {server} is mounted read-only ({mount.spec}): the server can "
                          "read these entries but not add its own")
    if resolved != server:
        b.put("cache_dir_resolved", resolved, "launch argument",
              f"{server} resolved in the server's filesystem (its links read through the launch's view)")
    b.put("cache_dir_here", here, "launch argument",
          "the server's cache root" if here == server else f"{resolved} through the launch's volumes")
    return here


def _model_bind_message(mount: Mount, name: str) -> str:
    """Why a server whose model folder is a bind that does not exist here never starts (refused, or docker's -v,
    which creates it empty: vLLM then finds no config.json there)."""
    elsewhere = "; or, where exl3tool runs on another host than the server, pass MODEL (a copy here)"
    if mount.refused:
        return (f"{mount.refused}, so this server never starts (its model {name} is there); create that folder "
                f"first{elsewhere}")
    return (f"the launch's docker run -v {mount.spec}: {mount.host} does not exist here, so docker creates it empty "
            f"and the server finds no model at {name} (no config.json): it never starts; put the model there or fix "
            f"the -v{elsewhere}")


def _not_creatable(host: str) -> str:
    """Why ``mkdir -p host`` fails here (a dangling link on the way, a file), or "" where it creates the folder."""
    path = host
    while path and not os.path.exists(path):
        if os.path.islink(path):
            return f"{path} is a link to {os.readlink(path)}, which does not exist: create the link's target"
        path = posixpath.dirname(path) if path != "/" else ""
    if path and not os.path.isdir(path):
        return f"{path} is a file, so no folder can be made under it: fix the bind's source"
    return ""


def _refused_mounts(b: _Builder, launch: ServerLaunch, cache_dir: str, explicit: Explicit) -> None:
    """Binds whose host folder does not exist and whose runner refuses to start without it (``Mount.refused``): the
    server never starts, so the launch is refused naming the bind, except where the cache root here lies in that
    folder and ``mkdir -p`` can make it: a warm's first entry creates it, after which the server starts; a warning
    says so (and ``cache check`` counts it a start failure until then). Where MODEL or ``--cache-dir`` names a copy
    here, exl3tool may run on another host than the server (CI warming for a fleet: docs/launch.md), so the launch's
    host paths may exist there only: each such bind is a warning naming what happens if this is the server's host,
    never a refusal nor a start failure. A model folder docker's ``-v`` would create empty is said the same way."""
    raw = _arg(launch.args, "model")
    model = posixpath.normpath(raw[0]) if raw is not None and raw[0].startswith("/") else None
    elsewhere = explicit.model is not None or explicit.cache_dir is not None
    for mount in launch.paths.mounts:
        inside = posixpath.normpath(mount.inside)
        if mount.created_empty and model is not None and (model + "/").startswith(inside.rstrip("/") + "/"):
            b.warnings.append(f"{_model_bind_message(mount, model).split('; or, where')[0]}, if this is the "
                              "server's host (taken as another host's path: MODEL is the copy here)")
            continue
        if not mount.refused:
            continue
        if elsewhere and not (cache_dir and (posixpath.normpath(cache_dir) + "/").startswith(
                posixpath.normpath(mount.host or "") + "/")):
            b.warnings.append(f"{mount.refused}, so the server never starts if this is its host (taken as another "
                              "host's path: MODEL or --cache-dir names the copy here)")
            continue
        host = posixpath.normpath(mount.host or "")
        if cache_dir and (posixpath.normpath(cache_dir) + "/").startswith(host + "/"):
            why = _not_creatable(host)
            if why:
                raise ConfigError(f"{mount.refused}, so this server never starts, and `cache warm` cannot create "
                                  f"it: {why}")
            b.warnings.append(f"{mount.refused}: the server does not start until it exists; `cache warm` creates it "
                              f"with the cache root {cache_dir} (or create it first)")
            continue
        raise ConfigError(f"{mount.refused}, so this server never starts; create that folder first")


def _legacy_cache_dir(b: _Builder, rel: ServerRelease) -> None:
    """``VLLM_CACHE_DIR``, which deployments set as if it named vLLM's cache root: the fork's ``vllm/envs.py`` reads
    ``VLLM_CACHE_ROOT`` only (``VLLM_CACHE_DIR`` appears nowhere in its history), so it changes nothing; a warning
    when the root it seems to name is not the server's (``exl3tool.releases.server_vllm_root``)."""
    item = b.env("VLLM_CACHE_DIR")
    if item is None:
        return

    def get(var: str) -> Optional[str]:
        it = b.env(var)
        return None if it is None else it.value

    actual, var = server_vllm_root(get, rel)
    home = b.env("HOME")
    if not var and home is not None:
        actual = posixpath.join(home.value, actual[2:])
    b.put_env("vllm_cache_dir", "VLLM_CACHE_DIR", item)
    b.settings["vllm_cache_dir"] = Setting(item.value, item.source, b.settings["vllm_cache_dir"].detail
                                           + ": not read by the server (vLLM's root is VLLM_CACHE_ROOT)")
    if posixpath.normpath(item.value) != posixpath.normpath(actual):
        b.warnings.append(f"VLLM_CACHE_DIR={item.value} is not read by the server (the fork's vllm/envs.py takes its "
                          f"cache root from VLLM_CACHE_ROOT only): its root is {actual}, so the online cache is "
                          f"{posixpath.join(actual, 'exl3_online')}; set VLLM_CACHE_ROOT={item.value} (or "
                          "VLLM_EXL3_ONLINE_CACHE_DIR) in the launch if that is where it should be")


def _encoder(b: _Builder, launch: ServerLaunch, explicit: Explicit) -> tuple[str, Optional[str], Optional[str]]:
    """The encoder root string, revision and (files mode) the local copy to hash."""
    if explicit.encoder_root:
        root = b.put("encoder_root", explicit.encoder_root, "flag", "--encoder-root")
    else:
        item = b.env("VLLM_EXL3_ENCODER_SOURCE")
        if item is None or not item.value.strip():
            raise ConfigError("VLLM_EXL3_ENCODER_SOURCE was not given (not in the launch, an --env-file or this "
                              "environment) and the server needs it for every look-up; "
                              + _how_to_pass(launch, "VLLM_EXL3_ENCODER_SOURCE") + "; or pass --encoder-root")
        root = b.put_env("encoder_root", "VLLM_EXL3_ENCODER_SOURCE", item)
    revision: Optional[str]
    if explicit.encoder_revision is not None:
        revision = b.put("encoder_revision", explicit.encoder_revision, "flag", "--encoder-revision")
    else:
        item = b.env("VLLM_EXL3_ENCODER_REVISION")
        if item is not None:
            revision = b.put_env("encoder_revision", "VLLM_EXL3_ENCODER_REVISION", item)
        else:
            revision = b.put("encoder_revision", None, "default",
                             "not given: the server hashes the encoder's .py files")
            b.defaulted.append("VLLM_EXL3_ENCODER_REVISION was not given: the encoder identity hashes the .py files "
                               f"under {root} as the server sees them; "
                             + _how_to_pass(launch, "VLLM_EXL3_ENCODER_REVISION"))
    source: Optional[str] = None
    if explicit.encoder_source:
        source = b.put("encoder_source", explicit.encoder_source, "flag", "--encoder-source")
    elif revision is None or not revision.strip():
        server_root = _server_path(root, launch, "VLLM_EXL3_ENCODER_SOURCE")
        paths = launch.paths
        if paths.own_view:  # its links resolve in the server's view (a root, volumes), never this machine's
            resolved = server_realpath(paths, server_root, "VLLM_EXL3_ENCODER_SOURCE", unseen="keep")
            here = paths.to_host(resolved)
        else:
            resolved, here = server_root, server_root
        if here is not None and here != resolved:
            _py_links_in_view(paths, resolved, here)
            shown = server_root if resolved == server_root else f"{server_root} (resolved there: {resolved})"
            source = b.put("encoder_source", here, "launch argument", f"{shown} through the launch's volumes")
        elif here is None:
            if os.path.isdir(server_root):
                b.warnings.append(f"the encoder {server_root} is inside the image: its .py files are hashed from "
                                  f"{server_root} here, which must be the image's copy (else pass --encoder-source "
                                  "with the files copied out of the image, or set VLLM_EXL3_ENCODER_REVISION)")
            else:
                raise ConfigError(f"the server hashes the encoder's .py files under {server_root}, inside the image; "
                                  "copy them out (docker cp) and pass --encoder-source DIR, or give the server a "
                                  "VLLM_EXL3_ENCODER_REVISION")
    return root, revision, source


def _py_links_in_view(paths: PathMap, server_dir: str, here_dir: str) -> None:
    """Refuse a ``.py`` link under the encoder's folder that the server resolves to another file than this
    machine does (an absolute link read in its root or volumes): the files hashed here would not be the server's.
    Links to folders are not followed by the server's file walk (``rglob``), so they are not read here either."""
    for dirpath, _dirs, files in os.walk(here_dir, followlinks=False):
        for name in files:
            host = os.path.join(dirpath, name)
            if not name.endswith(".py") or not os.path.islink(host):
                continue
            server = posixpath.join(server_dir, os.path.relpath(host, here_dir))
            there = paths.to_host(server_realpath(paths, server, "the encoder's file", unseen="keep"))
            if there is None or os.path.realpath(there) != os.path.realpath(host):
                raise ConfigError(f"the encoder's file {server} is a link ({os.readlink(host)}) that the server "
                                  f"resolves in its own filesystem to {there or 'a file inside its image'}, not to "
                                  f"{os.path.realpath(host)} as read here: its .py files cannot be hashed as the "
                                  "server hashes them; give the server a VLLM_EXL3_ENCODER_REVISION, or copy the "
                                  "encoder without links (cp -rL) and pass --encoder-source")


def _parallel(b: _Builder, args: ServerArgs) -> None:
    """Parallel sizes the fork shards by: honoured when they leave every key as at the TP size, else refused."""
    pp, how = _int_arg(args, "pipeline_parallel_size", 1)
    if how:
        b.arg("pipeline_parallel_size", pp, how)
        if pp > 1:
            b.notes.append(f"{how} {pp}: each stage builds its own share of the layers with the same prefixes and "
                           "TP ranks, and the key holds no stage, so the warm of the TP size covers every stage")
    dp, dp_how = _int_arg(args, "data_parallel_size", 1)
    if dp_how:
        b.arg("data_parallel_size", dp, dp_how)
    pcp, pcp_how = _int_arg(args, "prefill_context_parallel_size", 1)
    if pcp_how:
        b.arg("prefill_context_parallel_size", pcp, pcp_how)
        if pcp > 1:
            raise ConfigError(f"the launch's {pcp_how} {pcp}: exl3tool does not model prefill context parallelism's "
                              "layout; warm without it or check the server's log for its keys")
    ep = _bool_arg(args, "enable_expert_parallel")
    if ep:
        b.arg("enable_expert_parallel", True, args.values["enable_expert_parallel"][1])


def resolve_launch(launch: ServerLaunch, layers: EnvLayers, explicit: Explicit, *,
                   need_cache: bool = True, labels: Optional[dict[str, str]] = None,
                   modules: Optional[ForkModules] = None) -> LaunchSettings:
    """The settings of every look-up the launched server makes, with sources; ConfigError (exit 2) naming the flag
    or variable for what the server would refuse or exl3tool cannot reproduce. ``need_cache`` False (``identity``)
    lets a cache root exl3tool cannot reach be a warning.

    Args:
        launch, layers: ``load_launch``'s result.
        explicit: the settings a command's own flags give (they win over the launch's).
        need_cache: False where a command reads and writes no cache.
        labels: the image's labels, when known (one may name the server release: ``exl3tool.releases``).
        modules: the fork modules the server's image holds, when its files were read (``launch.forkfiles``).

    Returns:
        ``LaunchSettings``: each setting with its source, the defaults taken, and ``lookup_off``.
    """
    args = launch.args
    b = _Builder(launch, layers)
    off: list[str] = []  # why the server makes no look-up (each alone is enough)
    _flags_known(b, args)
    _release(b, explicit, off, labels, modules)
    _quantization(b, args)
    model, server_path, revision = _served_model(b, launch, explicit)
    tp = _tp_size(b, args)
    dtype = _dtype(b, args, explicit)
    qc = _overlay(b, args, explicit, off)
    _speculative(b, args)
    lmo = _language_model_only(b, args)
    _weights_format(b, args)
    for var in ("HF_HOME", "HF_HUB_CACHE"):
        item = b.env(var)
        if item is not None:
            b.put_env(var.lower(), var, item)
    bits = _bits(b, launch, explicit, off, need_cache)
    try:
        enc_root, enc_rev, enc_src = _encoder(b, launch, explicit)
    except ConfigError as exc:
        if not off:
            raise
        # the server needs no encoder when it encodes nothing online: say so instead of refusing the launch
        b.warnings.append(f"also: {exc}")
        enc_root, enc_rev, enc_src = "", None, None
    cache_dir = _cache_dir(b, launch, explicit, need_cache)
    _refused_mounts(b, launch, cache_dir, explicit)
    _cache_mode(b, off)
    if explicit.tp_sizes:
        b.put("tp_sizes_extra", list(explicit.tp_sizes), "flag", "--tp-size")
    hf_overrides = _hf_overrides(b, args)
    return LaunchSettings(
        launch, b.settings, model, server_path, revision, tp, dtype, bits, qc, enc_root, enc_rev, enc_src,
        cache_dir, lmo, layers.merged(), tuple(b.defaulted), tuple(b.warnings),
        _image_lines(launch) + tuple(launch.notes) + tuple(b.notes),
        view=b.view, lookup_off=tuple(off), hf_overrides=hf_overrides, model_seen_here=b.model_seen,
        image_labels=dict(launch.image.labels) if launch.image is not None else {},
        server_release=b.choice.release.name if b.choice else None, release=b.choice)


def resolve_cache_root(launch: ServerLaunch, layers: EnvLayers, explicit: Explicit, *,
                       modules: Optional[ForkModules] = None) -> LaunchSettings:
    """What a launch gives the cache commands (``cache ls`` ... ``cache import``): the server's release, its cache
    root here and whether the server reads that cache, each with its source, by ``resolve_launch``'s own steps.
    Nothing else is resolved (the launch's model need not be reachable from here): the settings hold those three,
    and the fields for the model, TP size, overlay and encoder are empty."""
    b = _Builder(launch, layers)
    off: list[str] = []  # why the server makes no look-up
    _release(b, explicit, off, None, modules)
    cache_dir = _cache_dir(b, launch, explicit)
    _refused_mounts(b, launch, cache_dir, explicit)
    _cache_mode(b, off)
    assert b.choice is not None
    return LaunchSettings(
        launch, b.settings, "", None, None, 0, "", 0, None, "", None, None, cache_dir, False, layers.merged(),
        tuple(b.defaulted), tuple(b.warnings), _image_lines(launch) + tuple(launch.notes) + tuple(b.notes),
        lookup_off=tuple(off), image_labels=dict(launch.image.labels) if launch.image is not None else {},
        server_release=b.choice.release.name, release=b.choice)


def _flags_known(b: _Builder, args: ServerArgs) -> None:
    """Flags exl3tool refuses, and unknown flags: a typo of a known one is refused (the server refuses it too),
    the rest a warning (a newer release's flags)."""
    if args.refused:
        flag, why = args.refused[0]
        raise ConfigError(f"the launch's {flag} is not supported by exl3tool: {why}")
    if args.unknown:
        close = close_flag_matches(args.unknown)
        if close:
            raise ConfigError(unknown_flag_message(args.unknown, close))
        b.warnings.append(unknown_flag_warning(args.unknown))


def _quantization(b: _Builder, args: ServerArgs) -> None:
    """``--quantization``: exl3 or none (the checkpoint's), else the server runs no online Trellis."""
    quant = _arg(args, "quantization")
    if quant is not None:
        b.arg("quantization", quant[0], quant[1])
        if quant[0].strip().lower() != "exl3":
            raise ConfigError(f"the launch's {quant[1]} {quant[0]}: the server runs EXL3 online Trellis only with "
                              "exl3 (or with none, taken from the checkpoint), so it looks nothing up; fix the launch")
    else:
        b.put("quantization", None, "default", "not given: the checkpoint's quant_method (exl3)")


def _served_model(b: _Builder, launch: ServerLaunch, explicit: Explicit) -> tuple[str, Optional[str], Optional[str]]:
    """The model (what exl3tool reads here, the server's path or None) and its revision; a Hub repo id served with
    HF_HUB_OFFLINE becomes its snapshot folder, as vLLM rewrites it."""
    args = launch.args
    model, server_path = _model(b, launch, explicit)
    rev = _arg(args, "revision")
    if explicit.revision is not None:
        revision = b.put("revision", explicit.revision, "flag", "--revision")
    elif rev is not None:
        revision = b.arg("revision", rev[0], rev[1])
    else:
        revision = b.put("revision", None, "default", "not given")
    hub = server_path is None and explicit.model is None and "model_here" not in b.settings  # a Hub repo id
    if hub and hub_offline(_hf_env(b)):  # an existing path is served as is (get_model_path)
        modelscope = b.env("VLLM_USE_MODELSCOPE")
        if modelscope is not None and modelscope.value.lower() == "true":  # vllm/envs.py's test
            raise ConfigError("the launch sets VLLM_USE_MODELSCOPE with HF_HUB_OFFLINE: the server reads ModelScope's "
                              "cache, which exl3tool does not model; pass MODEL and --server-path of the folder")
        model, server_path = _offline_snapshot(b, launch, model, revision)
    elif server_path is None and explicit.model is None:
        if hub and launch.home_unknown and not any(v in _hf_env(b) for v in _HF_VARS[2:-1]):
            raise ConfigError(f"{launch.home_unknown}; the launch serves the Hub repo {model}, whose Hub cache is "
                              "under that HOME: pass HF_HUB_CACHE (or HF_HOME) in the launch, or run exl3tool as "
                              "that user")
        b.view = launch.paths  # a Hub repo: its revision resolves with the server's Hub cache when offline
    return model, server_path, revision


def _tp_size(b: _Builder, args: ServerArgs) -> int:
    """The TP size, the other parallel sizes, and the layout exl3tool does not model (sequence-parallel MoE)."""
    tp, how = _int_arg(args, "tp_size", 1)
    if how:
        b.arg("tp_size", tp, how)
    else:
        b.put("tp_size", 1, "default", "not given: the server runs TP 1")
    _parallel(b, args)
    dp = b.settings.get("data_parallel_size")
    if (b.settings.get("enable_expert_parallel") and dp is not None and dp.value > 1 and tp > 1
            and (_arg(args, "all2all_backend") or ("allgather_reducescatter", ""))[0] in SEQUENCE_PARALLEL_ALL2ALL):
        raise ConfigError("the launch's --enable-expert-parallel with --data-parallel-size > 1 and TP > 1 runs "
                          "sequence-parallel MoE, where the fork replicates the shared experts (and GLM-5's dense "
                          "MLPs) on every rank instead of sharding them; exl3tool does not model that layout")
    return tp


def _dtype(b: _Builder, args: ServerArgs, explicit: Explicit) -> str:
    dtype_arg = _arg(args, "dtype")
    if explicit.dtype is not None:
        return b.put("dtype", explicit.dtype, "flag", "--dtype")
    if dtype_arg is not None:
        mapped = serving_dtype_name(dtype_arg[0])
        if mapped is None:
            raise ConfigError(f"the launch's {dtype_arg[1]} {dtype_arg[0]!r} is not one of the server's dtypes "
                              f"({', '.join(DTYPE_SPELLINGS)})")
        return b.arg("dtype", mapped, dtype_arg[1] + (f" {dtype_arg[0]}" if mapped != dtype_arg[0] else ""))
    return b.put("dtype", "auto", "default", "not given: the checkpoint's config dtype")


def _overlay(b: _Builder, args: ServerArgs, explicit: Explicit, off: list[str]) -> Optional[str]:
    """``--quantization-config``: without an online overlay the server encodes nothing online."""
    from exl3tool.checkpoint import resolve_overlay

    qc_arg = _arg(args, "quantization_config")
    if explicit.quantization_config is not None:
        return b.put("quantization_config", explicit.quantization_config, "flag", "--quantization-config")
    if qc_arg is not None:
        _json_arg(args, "quantization_config")
        try:
            resolve_overlay(qc_arg[0])
        except ConfigError as exc:
            raise ConfigError(f"the launch's {qc_arg[1]}: {exc}") from None
        return b.arg("quantization_config", qc_arg[0], qc_arg[1])
    b.put("quantization_config", None, "default", "not given")
    off.append("the launch gives no --quantization-config: without an online overlay the server encodes no "
               "layer online (the fork's Exl3Config takes the online path only with a QuantizationConfigArgs "
               "overlay)")
    return None


def _speculative(b: _Builder, args: ServerArgs) -> None:
    spec = _json_arg(args, "speculative_config")
    if spec is not None:
        b.arg("speculative_config", spec, args.values["speculative_config"][1])
        b.notes.append("the speculative draft (an MTP draft or a draft model) is built with the target's "
                       "--quantization but not its --quantization-config (the fork's speculative.py), so it encodes "
                       "nothing online and makes no look-ups")


def _language_model_only(b: _Builder, args: ServerArgs) -> bool:
    """``--language-model-only``, or image and video limits 0: the vision tower is not built."""
    lmo = _bool_arg(args, "language_model_only")
    if lmo:
        b.arg("language_model_only", True, args.values["language_model_only"][1])
    limits = _json_arg(args, "limit_mm_per_prompt")
    if isinstance(limits, dict):
        def count(v: Any) -> Any:
            return v.get("count") if isinstance(v, dict) else v
        if all(count(limits.get(m)) == 0 for m in ("image", "video")):
            lmo = True
            b.arg("language_model_only", True, args.values["limit_mm_per_prompt"][1] + " (image and video 0)")
    if lmo:
        b.notes.append("the vision tower is not built (image and video limits 0), so it makes no look-ups")
    return lmo


def _weights_format(b: _Builder, args: ServerArgs) -> None:
    """Where the weights come from and which model classes are built: the ones exl3tool plans, else refused."""
    load = _arg(args, "load_format")
    if load is not None:
        b.arg("load_format", load[0], load[1])
        if load[0] not in _LOAD_FORMATS:
            raise ConfigError(f"the launch's {load[1]} {load[0]} is not supported by exl3tool: the weights (or the "
                              f"model path the server hashes) come from elsewhere; formats it follows: "
                              f"{', '.join(_LOAD_FORMATS)}")
    for name, allowed in (("model_impl", ("auto", "vllm")), ("runner", ("auto", "generate")),
                          ("convert", ("auto", "none"))):
        item = _arg(args, name)
        if item is not None:
            b.arg(name, item[0], item[1])
            if item[0] not in allowed:
                raise ConfigError(f"the launch's {item[1]} {item[0]} is not supported by exl3tool: it builds other "
                                  f"model classes than the fork's generative ones it plans ({'/'.join(allowed)})")
    dl = _arg(args, "download_dir")
    if dl is not None:
        b.arg("download_dir", dl[0], dl[1] + ": a Hub model's identity does not depend on it")


def _bits(b: _Builder, launch: ServerLaunch, explicit: Explicit, off: list[str], need_cache: bool) -> int:
    """``VLLM_EXL3_ONLINE_TRELLIS_BITS``: without it the server runs no online Trellis."""
    from exl3tool.cache.settings import trellis_bits

    if explicit.bits is not None:
        return b.put("bits", explicit.bits, "flag", "--bits")
    item = b.env("VLLM_EXL3_ONLINE_TRELLIS_BITS")
    try:
        parsed = trellis_bits({"VLLM_EXL3_ONLINE_TRELLIS_BITS": item.value}) if item is not None else None
    except ConfigError as exc:
        raise ConfigError(f"{exc} (from {item.source}: {item.detail or 'VLLM_EXL3_ONLINE_TRELLIS_BITS'})") from None
    if parsed is not None:
        b.put_env("bits", "VLLM_EXL3_ONLINE_TRELLIS_BITS", item)  # type: ignore[arg-type]
        return b.put("bits", parsed, b.settings["bits"].source, b.settings["bits"].detail)
    bits = b.put("bits", 6, "default", "VLLM_EXL3_ONLINE_TRELLIS_BITS not given")
    b.defaulted.append("VLLM_EXL3_ONLINE_TRELLIS_BITS was not given: without it the server runs no online "
                       "Trellis and looks nothing up; exl3tool plans 6 bits; "
                       + _how_to_pass(launch, "VLLM_EXL3_ONLINE_TRELLIS_BITS"))
    if launch.image_note and not off and need_cache:  # unknown, not absent: the image may set it
        raise ConfigError("VLLM_EXL3_ONLINE_TRELLIS_BITS is not set by the launch, and without it the server "
                          "looks nothing up; " + _how_to_pass(launch, "VLLM_EXL3_ONLINE_TRELLIS_BITS"))
    off.append(f"VLLM_EXL3_ONLINE_TRELLIS_BITS is not set in the server's environment ({_where_env(launch)}): "
               "online Trellis is off and every eligible layer runs plain MXFP8; "
               + _how_to_pass(launch, "VLLM_EXL3_ONLINE_TRELLIS_BITS"))
    return bits


def _cache_mode(b: _Builder, off: list[str]) -> None:
    """``VLLM_EXL3_ONLINE_CACHE_MODE``: off, the server never reads the cache."""
    from exl3tool.cache.settings import cache_mode

    mode_item = b.env("VLLM_EXL3_ONLINE_CACHE_MODE")
    if mode_item is None:
        b.put("cache_mode", "readwrite", "default", "VLLM_EXL3_ONLINE_CACHE_MODE not given")
        return
    mode = cache_mode({"VLLM_EXL3_ONLINE_CACHE_MODE": mode_item.value})
    b.put_env("cache_mode", "VLLM_EXL3_ONLINE_CACHE_MODE", mode_item)
    b.settings["cache_mode"] = Setting(mode, b.settings["cache_mode"].source, b.settings["cache_mode"].detail)
    if mode == "off":
        off.append(f"VLLM_EXL3_ONLINE_CACHE_MODE=off ({mode_item.detail or mode_item.source}): the server "
                   "encodes every layer at start-up and never reads the cache")


def _image_lines(launch: ServerLaunch) -> tuple[str, ...]:
    """Which source gave the image's settings (and what was tried first), for the notes."""
    image = launch.image
    return (image.describe(), *image.notes) if image is not None else ()


_FORK_MODULES = ("exl3.py", "exl3_online_cache.py")


def _mounted_fork_modules(paths: PathMap) -> list[tuple[str, str, str, str]]:
    """The fork modules a container launch's volumes put over its image's (``-v HOST/exl3.py:/opt/venv/lib/python3.12/
    site-packages/vllm/model_executor/layers/quantization/exl3.py``, as its users run a patched exl3.py on a release
    image; or a folder of the vllm package, a site-packages, a venv): (module, its path in the image, the host file,
    the volume as written), for the host files that exist. The image's package is looked for where the fork's and
    the usual images install it, and under any volume whose path ends in the package's own folders."""
    from exl3tool.launch.forkfiles import VLLM_PREFIXES

    if not paths.container or paths.root is not None or not any(m.host for m in paths.mounts):
        return []
    out = []
    for name in _FORK_MODULES:
        rel = f"vllm/model_executor/layers/quantization/{name}"
        parts = rel.split("/")
        targets = [f"{prefix}/{rel}" for prefix in VLLM_PREFIXES]
        for m in paths.mounts:
            inside = posixpath.normpath(m.inside)
            for k in range(1, len(parts) + 1):  # a volume at .../vllm, .../vllm/model_executor, ..., the file itself
                if inside.endswith("/" + "/".join(parts[:k])):
                    targets.append(posixpath.join(inside, *parts[k:]))
            if posixpath.basename(inside) in ("site-packages", "dist-packages"):
                targets.append(posixpath.join(inside, rel))
        for inside in dict.fromkeys(targets):
            covering = [m for m in paths.mounts if m.host and (inside == posixpath.normpath(m.inside) or inside.startswith(
                posixpath.normpath(m.inside).rstrip("/") + "/"))]
            host = paths.to_host(inside) if covering else None
            if host and os.path.isfile(host):
                out.append((name, inside, host, max(covering, key=lambda m: len(m.inside)).spec))
    for name, inside, _, _ in list(out):  # the other module of a package a volume holds: hidden when it lacks it
        other = posixpath.join(posixpath.dirname(inside), next(n for n in _FORK_MODULES if n != name))
        host = paths.to_host(other)
        if host and not os.path.isfile(host) and not any(o[1] == other for o in out):
            out.append((posixpath.basename(other), other, "", next(m.spec for m in paths.mounts if m.host and (
                other.startswith(posixpath.normpath(m.inside).rstrip("/") + "/")))))
    return out


def _modules_with_volumes(mounted: list[tuple[str, str, str, str]], modules: Optional[ForkModules],
                          labels: dict[str, str], image: str, table: str) -> tuple[Optional[ForkModules],
                                                                                   tuple[str, ...]]:
    """The fork modules the server runs when the launch mounts some over its image's: the mounted files, and for
    the one not mounted the image's (its files when read, else its labelled release's); the sentences naming what
    could not be told (each makes the release an assumption: ``cache check`` exits 2 on it)."""
    from exl3tool.releases import git_blob

    def read(host: str) -> bytes:
        try:
            with open(host, "rb") as fh:
                return fh.read(8 << 20)
        except OSError as exc:
            raise ConfigError(f"the launch mounts {host} over the image's vllm package: cannot read it here "
                              f"({exc.strerror or exc})") from None

    by_name: dict[str, tuple[str, str, Optional[bytes]]] = {}
    for name, inside, host, spec in mounted:
        data = read(host) if host else None  # "": the volume's folder hides the image's file and holds none
        if name in by_name and by_name[name][2] != data:
            return modules, (f"the launch mounts different {name} files over the image's vllm packages ({spec}); "
                             "exl3tool cannot tell which one the server imports; give --server-release NAME",)
        by_name[name] = (inside, spec, data)
    base = resolve_release(None, labels, image=image, table_release=table)
    row = base.release if base.source in ("image label", "published-images table") else None
    where = "; ".join(dict.fromkeys(f"-v {spec}" if not spec.startswith(("-", "bind ")) else spec
                                    for _, spec, _ in by_name.values()))
    if "exl3_online_cache.py" in by_name:
        cache_data = by_name["exl3_online_cache.py"][2]
        cache_blob: Optional[str] = git_blob(cache_data) if cache_data is not None else None
    elif modules is not None:
        cache_blob = modules.cache_blob
    else:
        cache_blob = row.cache_module.blob if row is not None and row.cache_module is not None else None
    if "exl3.py" in by_name and by_name["exl3.py"][2] is None:
        return modules, (f"the launch's volume {by_name['exl3.py'][1]} hides the image's exl3.py and holds none, so "
                         "the server's vllm has no EXL3 support exl3tool can read; give --server-release NAME",)
    if "exl3.py" in by_name:
        data = by_name["exl3.py"][2] or b""
        exl3_blob: Optional[str] = git_blob(data)
        text = data.decode("utf-8", "replace")
    elif modules is not None:
        exl3_blob, text = modules.exl3_blob, modules.exl3_text
    elif row is not None and row.exl3_blob:
        exl3_blob, text = row.exl3_blob, ""
    else:
        exl3_blob, text = None, ""
    if row is None and modules is None and len(by_name) < len(_FORK_MODULES):
        missing = next(n for n in _FORK_MODULES if n not in by_name)
        return modules, (f"the launch mounts {where}: the server runs that file with its image's {missing}, and "
                         "neither the image's files nor its labels say which that is; give --server-release NAME "
                         "(the release whose rules the mounted file follows; NAME+pr312 for PR #312's exl3.py) or "
                         "--image-root DIR",)
    if exl3_blob is None:
        return modules, (f"the launch mounts {where}, and exl3tool cannot tell which exl3.py its image holds "
                         f"({base.release.name} records none); give --server-release NAME or --image-root DIR",)
    return ForkModules(f"the launch's volume {where}", cache_blob, exl3_blob, text), ()


def _release(b: _Builder, explicit: Explicit, off: list[str], labels: Optional[dict[str, str]],
             modules: Optional[ForkModules] = None) -> None:
    """The server release whose rules apply, resolved once (``exl3tool.releases.resolve_release``):
    ``--server-release``, else the image's fork modules, else its labels, else the newest; what was assumed is a
    warning; a release that encodes nothing online looks nothing up."""
    image = getattr(b.launch, "image", None)
    labels = labels or (dict(image.labels) if image is not None else {})
    table = image.release if image is not None and image.source == "published-images table" else ""
    mounted = _mounted_fork_modules(b.launch.paths)
    extra: tuple[str, ...] = ()
    if mounted and explicit.server_release is None:
        modules, extra = _modules_with_volumes(mounted, modules, labels, b.launch.image_name, table)
    elif mounted:
        b.notes.append(f"the launch mounts {mounted[0][2]} over the image's {mounted[0][1]}: --server-release "
                       f"{explicit.server_release} names the rules that file follows")
    b.choice = choice = resolve_release(explicit.server_release, labels, image=b.launch.image_name,
                                        table_release=table, modules=modules)
    if extra:
        choice = b.choice = replace(choice, unknown=(*choice.unknown, *extra))
    source = {"--server-release": "flag", "published-images table": "image label"}.get(choice.source, choice.source)
    b.put("server_release", choice.release.name, source, choice.describe())
    b.warnings.extend(choice.unknown)
    if not choice.release.online_cache:
        off.append(no_online_encoding(choice.release))
    for var, item in sorted(b.layers.merged().items()):
        note = variable_note(var, item)
        if note is not None:
            b.notes.append(note)


def _hf_overrides(b: _Builder, args: ServerArgs) -> Optional[str]:
    """The launch's ``--hf-overrides`` (JSON or dotted ``--hf-overrides.key value``), checked and kept as JSON."""
    from exl3tool.checkpoint.overrides import parse_hf_overrides

    raw = _arg(args, "hf_overrides")
    if raw is None:
        return None
    value = parse_hf_overrides(raw[0], f"the launch's {raw[1]}")
    if not value:
        return None
    b.arg("hf_overrides", value, raw[1])
    b.notes.append(f"{raw[1]} is applied to config.json before planning, as the server applies it")
    return json.dumps(value, sort_keys=True)
