"""A launch line read with shell rules, and the server's own flags read as the fork's parser reads them.

``split_commands`` tokenises once (``shlex``: quotes, ``\\``-newline continuations, ``;``/``&&``/``|``/newline
between commands, ``#`` comments); ``find_server`` finds where the server starts inside wrappers
(``setsid ./launcher vllm serve``, ``env A=1 vllm serve``, ``bash -c '...'``); ``parse_server_args`` walks the
server's arguments against the flag tables in ``flags.py`` with the fork's rules (``FlexibleArgumentParser``:
``--model`` moved to the positional, ``--config FILE`` YAML expanded between the model and the rest, ``_``/``-``
in names, ``--flag.key value`` dotted JSON, ``-O3``, unique prefixes of long names).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field, replace
from collections.abc import Mapping
from typing import Callable, Optional

from exl3tool.errors import ConfigError
from exl3tool.launch.flags import VLLM_BOOLEANS, VLLM_FLAGS, VLLM_SHORT, server_flag
from exl3tool.launch.script import HOST_VIEW, SHELLS, ScriptView, script_changes
from exl3tool.launch.wrappers import ASSIGNMENT, Guest, follow

__all__ = ["ServerArgs", "ServerStart", "Level", "ShellScript", "split_commands", "find_server", "shell_script",
           "parse_server_args", "API_SERVER_MODULE", "ASSIGNMENT"]

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_CLI_MODULES = ("vllm.entrypoints.cli.main", "vllm")  # `python -m vllm.entrypoints.cli.main serve ...`
_SEPARATORS = {";", "&&", "||", "|", "&", "\n", ";;", "|&"}
_SANDBOX_OWN = ("/dev", "/proc", "/sys", "/run", "/tmp", "/etc", "/var/run")  # a script's sandbox makes its own


def split_commands(text: str) -> list[list[str]]:
    """Shell words of ``text``, one list per simple command (split at ``;``, ``&&``, ``||``, ``|``, newlines).

    >>> split_commands("cd /x && vllm serve /m --tp 2 # start")
    [['cd', '/x'], ['vllm', 'serve', '/m', '--tp', '2']]
    """
    text = re.sub(r"\\\r?\n", " ", text)  # line continuations
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|\n")
    lexer.whitespace_split = True
    lexer.whitespace = " \t\r"
    lexer.commenters = ""
    try:
        words = list(lexer)
    except ValueError as exc:  # "No closing quotation", "No escaped character"
        raise ConfigError(f"--launch: cannot read it with shell rules ({exc}); quote it as the shell would") from None
    commands: list[list[str]] = [[]]
    comment = False
    for word in words:
        if word in _SEPARATORS or (word and set(word) <= set(";&|\n")):
            commands.append([])
            comment = False
        elif comment or word.startswith("#"):
            comment = True
        else:
            commands[-1].append(word)
    return [c for c in commands if c]


@dataclass(frozen=True)
class Level:
    """A shell script the server's command was found in: the wrapper words that ran that shell, what the script
    exported for the server, where it started it, and how it was run (``bash -lc``)."""

    wrappers: tuple[str, ...]
    exports: tuple[tuple[str, str, str], ...]  # (name, value, where)
    workdir: Optional[str]
    how: str


@dataclass(frozen=True)
class ServerStart:
    """Where the server's command starts in one command's words, and what came before it."""

    kind: str  # "vllm" | "api_server" | "docker" | "podman"
    index: int  # first word of the server's own arguments (after `serve`, the module, or `run`)
    entry: str  # how it is started, for people ("vllm serve", "python -m vllm.entrypoints.openai.api_server")
    prefix: tuple[str, ...] = ()  # the words before it in its own command: wrappers, NAME=VALUE (launch.wrappers)
    words: tuple[str, ...] = ()  # the command it was found in, when that is inside a script (bash -c '...')
    levels: tuple[Level, ...] = ()  # the scripts it was found in, outermost first
    notes: tuple[str, ...] = ()

    @property
    def env(self) -> tuple[tuple[str, str], ...]:
        """The NAME=VALUE words among its own prefix."""
        return tuple((m.group(1), m.group(2)) for w in self.prefix if (m := ASSIGNMENT.match(w)))

    @property
    def exports(self) -> tuple[tuple[str, str, str], ...]:
        """What the scripts it was found in exported for it, outermost first."""
        return tuple(e for level in self.levels for e in level.exports)

    @property
    def workdir(self) -> Optional[str]:
        """Where the innermost script that cd'd started it."""
        return next((level.workdir for level in reversed(self.levels) if level.workdir), None)

    @property
    def script(self) -> str:
        """The shell that ran it (``bash -lc``), when it was inside a script."""
        return self.levels[-1].how if self.levels else ""


def _is_python(word: str) -> bool:
    return re.fullmatch(r"python(\d+(\.\d+)?)?", word.rsplit("/", 1)[-1]) is not None


def _basename(word: str) -> str:
    return word.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class ShellScript:
    """A shell's ``-c`` script in a command's words: the words that run the shell (before it; ``su``'s own without
    its ``-c``), the script, ``$0`` and ``"$@"`` (``bash -c SCRIPT NAME ARGS...``), and how it was run."""

    wrappers: tuple[str, ...]
    script: str
    args: tuple[str, ...]
    how: str


def shell_script(words: list[str]) -> Optional[ShellScript]:
    """The ``-c`` script in ``words``: ``bash -lc S [NAME [ARGS...]]``, ``sh -ec S``, ``zsh -x -c S``, ``bash --login
    -c S``, ``su [-] [USER] -c S`` / ``su --command=S``; None when no shell runs a script.

    >>> shell_script(["/bin/bash", "-lic", "exec vllm serve \"$@\"", "--", "/m"])
    ShellScript(wrappers=(), script='exec vllm serve "$@"', args=('--', '/m'), how='bash -lic')
    """
    for i, word in enumerate(words):
        base = _basename(word)
        if base in SHELLS:
            j, has_c = i + 1, False
            while j < len(words) and words[j][:1] in ("-", "+") and words[j] not in ("-", "--", "+"):
                opt = words[j]
                if opt.startswith("--"):
                    j += 2 if opt in ("--rcfile", "--init-file") else 1
                    continue
                has_c = has_c or (opt[0] == "-" and "c" in opt[1:])
                j += 2 if ("o" in opt[1:] or "O" in opt[1:]) else 1  # -o pipefail: the option's name follows
            if words[j:j + 1] == ["--"]:
                j += 1
            if has_c and j < len(words):
                return ShellScript(tuple(words[:i]), words[j], tuple(words[j + 1:]),
                                   " ".join([base, *words[i + 1:j]]))
        elif base in ("su", "runuser"):
            skip = False
            for j in range(i + 1, len(words)):
                w = words[j]
                if skip:
                    skip = False
                    continue
                if w in ("-s", "--shell", "-g", "--group", "-G", "--supp-group", "-w", "--whitelist-environment",
                         "-u", "--user"):
                    skip = True  # its value (-s /bin/bash is su's shell, not a command)
                    continue
                if w == "--" or _basename(w) in SHELLS:
                    break  # runuser -u USER -- bash -c S: the shell's script
                if w in ("-c", "--command") and j + 1 < len(words):
                    return ShellScript(tuple(words[:j] + words[j + 2:]), words[j + 1], (), f"{base} {w}")
                if w.startswith("--command="):
                    return ShellScript(tuple(words[:j] + words[j + 1:]), w.partition("=")[2], (),
                                       f"{base} --command")
    return None


def find_server(words: list[str], env: Optional[Mapping[str, str]] = None,
                view: ScriptView = HOST_VIEW) -> Optional[ServerStart]:
    """The server's start in ``words``: ``vllm serve``, ``python -m <api_server>``, ``python .../vllm serve``, a
    ``docker``/``podman`` ``run``, or inside a shell's ``-c`` script; None when there is none. Words before it are
    its prefix (wrappers and ``NAME=VALUE`` words, followed by ``launch.wrappers``).

    ``env`` is the environment a ``-c`` script runs with (the wrapper words before the shell applied to it, as they
    apply); None only finds where the server is. ``view`` is where such a script runs (this host, or a container's
    view: its volumes).
    """
    for i, word in enumerate(words):
        base = _basename(word)
        start: Optional[ServerStart] = None
        if base == "vllm" and i + 1 < len(words) and words[i + 1] == "serve":
            start = ServerStart("vllm", i + 2, "vllm serve")
        elif base in ("docker", "podman", "nvidia-docker"):
            rest = words[i + 1:]
            if "run" in rest and "compose" not in rest[:rest.index("run")]:  # `docker compose run SERVICE`: compose's
                start = ServerStart("podman" if base == "podman" else "docker", i + 2 + rest.index("run"),
                                    f"{base} run")
        elif _is_python(word):
            j = i + 1
            while j < len(words) and words[j].startswith("-") and words[j] != "-m":
                j += 1  # interpreter options (-u, -X dev); not their values, which are rare before -m
            if j + 1 < len(words) and words[j] == "-m":
                module = words[j + 1]
                if module == API_SERVER_MODULE:
                    start = ServerStart("api_server", j + 2, f"python -m {API_SERVER_MODULE}")
                elif module in _CLI_MODULES and j + 2 < len(words) and words[j + 2] == "serve":
                    start = ServerStart("vllm", j + 3, f"python -m {module} serve")
            elif j + 1 < len(words) and _basename(words[j]) == "vllm" and words[j + 1] == "serve":
                start = ServerStart("vllm", j + 2, "vllm serve")  # the console script run by its interpreter
        if start is not None:
            return replace(start, prefix=tuple(words[:i]))
    shell = shell_script(words)  # bash -lc 'vllm serve ...', su -c '...': the server inside one word
    if shell is None:
        return None
    strict = env is not None
    base_env = dict(env or {})
    script_view = view
    if strict:  # the wrappers before the shell apply to the script's environment and filesystem
        guest = follow(shell.wrappers, Guest(), environ=base_env, cwd=view.cwd or os.getcwd(), entry=shell.how,
                       inside=view.mounts is not None)
        base_env = guest.environ(base_env)
        if guest.moved:  # the script runs in the wrapper's binds (the sandbox keeps its own /dev, /proc, /tmp, ...)
            script_view = ScriptView(tuple((m.host, m.inside) for m in guest.paths.mounts
                                           if m.host and not any(m.inside == p or m.inside.startswith(p + "/")
                                                                 for p in _SANDBOX_OWN)),
                                     view.launcher_dirs, guest.workdir)
        elif guest.workdir:
            script_view = replace(view, cwd=guest.workdir)
    else:
        base_env.update((m.group(1), m.group(2)) for w in shell.wrappers if (m := ASSIGNMENT.match(w)))
    where = f"the {shell.how} script"
    try:
        start = script_view.read(["bash", "-c", shell.script, *shell.args], environ=base_env, where=where,
                                 is_server=lambda w, cwd: find_server(w, view=replace(
                                     script_view, cwd=cwd or script_view.cwd)) is not None)
    except ConfigError:
        if strict:
            raise
        return None
    if start is None:
        return None
    found = find_server(list(start.argv), start.env if strict else None,
                        replace(script_view, cwd=start.cwd or script_view.cwd))
    if found is None:
        return None
    exports, notes = script_changes(start, base_env, where)
    flags = shell.how.split(" ", 1)[-1]
    if shell.how.split()[0] in SHELLS and ("l" in flags.lstrip("-") or "--login" in flags):
        notes.append(f"{shell.how}: a login shell also reads the user's profile (/etc/profile, ~/.profile), which "
                     "exl3tool does not follow; pass what it sets with -e or --env-file")
    level = Level(shell.wrappers, tuple((n, v, w) for n, (v, w) in exports.items()), start.cwd or None, shell.how)
    return replace(found, words=found.words or tuple(start.argv), levels=(level, *found.levels),
                   notes=(*start.notes, *notes, *found.notes))


@dataclass(frozen=True)
class ServerArgs:
    """The server's flags that matter to a look-up, as the fork's parser leaves them, and the rest listed.

    ``values`` maps a setting name (``model``, ``tp_size``, ...) to ``(raw value, how it was given)``; the last
    one given wins, as in argparse. ``refused`` holds ``(flag, why)`` for flags exl3tool cannot reproduce.
    """

    entry: str
    values: dict[str, tuple[str, str]] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()  # known flags that do not change a look-up (with their values)
    unknown: tuple[str, ...] = ()  # flags the fork's parser does not know
    refused: tuple[tuple[str, str], ...] = ()
    config_file: Optional[str] = None  # --config FILE, as the launch names it


def _normalise(arg: str) -> list[str]:
    """The fork's rewriting of one word: ``_`` -> ``-`` in a long name (up to the first ``.``), ``-O3``."""
    if arg.startswith("--"):
        key, eq, value = arg.partition("=")
        head, dot, tail = key[2:].partition(".")
        return [f"--{head.replace('_', '-')}{dot}{tail}{eq}{value}"]
    if arg.startswith("-O") and arg != "-O" and not arg.startswith("-O-"):
        return ["--optimization-level", arg[3:] if arg[2:3] == "=" else arg[2:]]
    return [arg]


def _yaml_args(path: str, read_text: Callable[[str], str]) -> list[str]:
    """A ``--config`` YAML file as the flags it stands for (true -> ``--key``, false -> nothing, lists, dicts as
    JSON), as the fork's ``load_config_file`` expands it."""
    import yaml

    if path.rsplit(".", 1)[-1] not in ("yaml", "yml"):
        raise ConfigError(f"the launch's --config {path}: the server takes a .yaml or .yml file only")
    try:
        data = yaml.safe_load(read_text(path))
    except OSError as exc:
        raise ConfigError(f"the launch's --config {path}: cannot read it ({exc.strerror or exc}); put the file "
                          "where exl3tool can read it (a container path is read through the launch's volumes)"
                          ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"the launch's --config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"the launch's --config {path}: must be a YAML mapping of flag names to values")
    out: list[str] = []
    for key, value in data.items():
        if isinstance(value, bool):
            out += [f"--{key}"] if value else []
        elif isinstance(value, list):
            out += [f"--{key}", *map(str, value)] if value else []
        elif isinstance(value, dict):
            out += [f"--{key}", json.dumps(value)]
        else:
            out += [f"--{key}", str(value)]
    return out


def _expand_config(args: list[str], serve: bool,
                   read_text: Callable[[str], str]) -> tuple[list[str], Optional[str], int, int]:
    """Insert ``--config FILE``'s flags where the fork puts them (after the positional model, before the rest, so
    the command line wins), before any name is normalised (the fork's ``FlexibleArgumentParser.parse_args`` pulls the
    file in first, then turns ``_`` into ``-`` in every ``--`` word, the file's included); returns the normalised
    words, the file, and where its words start and how many there are.

    The fork looks for the word ``--config`` itself: ``--config=FILE`` is left to argparse, which keeps the path and
    reads nothing (nothing reads ``args.config`` after that), so that file is not read here either."""
    hits = [i for i, a in enumerate(args) if a == "--config"]

    def norm(part: list[str]) -> list[str]:
        return [w for a in part for w in _normalise(a)]

    if not hits:
        return norm(args), None, -1, 0
    if len(hits) > 1:
        raise ConfigError("the launch gives --config twice (the server refuses more than one config file)")
    i = hits[0]
    if i + 1 >= len(args):
        raise ConfigError("the launch's --config has no file (the server refuses it too)")
    path, rest = args[i + 1], args[:i] + args[i + 2:]
    extra = _yaml_args(path, read_text)
    model_first = serve and rest and not rest[0].startswith("-")
    at = 1 if model_first else 0
    head, mid, tail = norm(rest[:at]), norm(extra), norm(rest[at:])
    return head + mid + tail, path, len(head), len(mid)


def _long_name(flag: str) -> Optional[str]:
    """A long name (without --) as argparse matches it: exact, ``no-`` of a boolean, or a unique prefix."""
    if flag in VLLM_FLAGS or (flag.startswith("no-") and flag[3:] in VLLM_BOOLEANS):
        return flag
    matches = [f for f in VLLM_FLAGS if f.startswith(flag)]
    return matches[0] if len(matches) == 1 else None


def parse_server_args(args: list[str], *, entry: str, serve: bool,
                      read_text: Callable[[str], str] = lambda p: open(p).read()) -> ServerArgs:
    """Read the server's arguments (after ``serve`` or the module) as the fork's parser does.

    ``serve`` is True for ``vllm serve`` (a positional model, ``--model`` moved to it); the OpenAI api_server
    module takes ``--model`` only. ``read_text`` reads a ``--config`` file (through the launch's volumes).

    >>> parse_server_args(["/m", "-tp", "2", "--port", "8000"], entry="vllm serve", serve=True).values["tp_size"]
    ('2', '-tp')
    """
    words, config_file, config_at, config_len = _expand_config(list(args), serve, read_text)
    values: dict[str, tuple[str, str]] = {}
    ignored: list[str] = []
    unknown: list[str] = []
    refused: list[tuple[str, str]] = []
    dotted: dict[str, dict] = {}
    positional: list[str] = []

    def how(i: int, spelled: str) -> str:
        in_config = config_file is not None and config_at <= i < config_at + config_len
        return f"{spelled} in --config {config_file}" if in_config else spelled

    def set_value(setting: str, value: str, spelled: str, i: int) -> None:
        values[setting] = (value, how(i, spelled))

    i = 0
    last_flag: Optional[str] = None  # for the extra values of list-typed flags
    while i < len(words):
        word = words[i]
        if word == "--":
            positional.extend(words[i + 1:])
            break
        if not word.startswith("-") or word == "-":
            if serve and not positional and "model" not in values:
                positional.append(word)
            elif last_flag is not None:
                ignored.append(f"{last_flag} ... {word}")  # a further value of a list-typed flag
            else:
                positional.append(word)
            i += 1
            continue
        key, eq, inline = word.partition("=")
        at = i
        if "." in key and key.lstrip("-"):  # dotted: --quantization-config.ignore+ lm_head, -cc.level=3
            base, _, path = key.partition(".")
            if eq:
                raw = inline
                i += 1
            elif i + 1 < len(words):
                raw = words[i + 1]
                i += 2
            else:
                raw = ""
                i += 1
            name = base[2:] if base.startswith("--") else VLLM_SHORT.get(base, base.lstrip("-"))
            keys = path.split(".")
            append = keys[-1].endswith("+")
            if append:
                keys[-1] = keys[-1][:-1]
                value: object = raw.split(",")
            else:
                try:
                    value = json.loads(raw)
                except json.JSONDecodeError:
                    value = raw
            node = dotted.setdefault(name, {})
            for k in keys[:-1]:
                if not isinstance(node.get(k), dict):
                    node[k] = {}
                node = node[k]
            if append and isinstance(node.get(keys[-1]), list):
                node[keys[-1]] += value  # type: ignore[operator]
            else:
                node[keys[-1]] = value
            last_flag = None
            continue
        if key.startswith("--"):
            name = _long_name(key[2:])
            spelled = key
        else:
            name = VLLM_SHORT.get(key)
            spelled = key
        if name is None:
            took = ""
            if not eq and i + 1 < len(words) and not words[i + 1].startswith("-"):
                took = words[i + 1]
                i += 1
            unknown.append(word + (f" {took}" if took else ""))
            last_flag = None
            i += 1
            continue
        boolean = name in VLLM_BOOLEANS or (name.startswith("no-") and name[3:] in VLLM_BOOLEANS)
        if boolean:
            raw = "false" if name.startswith("no-") else "true"
            name = name[3:] if name.startswith("no-") else name
            i += 1
        elif eq:
            raw = inline
            i += 1
        elif i + 1 < len(words):
            raw = words[i + 1]
            i += 2
        else:
            raise ConfigError(f"the launch's {spelled} has no value (the server refuses it too)")
        last_flag = None if boolean else spelled
        row = server_flag(name)
        if row is None:
            ignored.append(spelled if boolean else f"{spelled} {raw}")
        elif row.refused:
            refused.append((spelled, row.why))
        elif row.setting == "speculative_config" and name != "speculative-config":
            set_value("speculative_config", json.dumps({name[5:]: raw}), spelled, at)
        elif row.setting:
            set_value(row.setting, raw, spelled, at)
        elif row.name != "config":
            ignored.append((spelled if boolean else f"{spelled} {raw}") + (f" ({row.why})" if row.why else ""))
        elif eq:  # --config=FILE: argparse keeps the path, the fork reads no file (only the word --config is pulled)
            ignored.append(f"{word} (the fork reads a --config file only given as two words, --config FILE: "
                           "with '=' argparse keeps the path and nothing reads the file, so its flags do not apply)")
    for name, tree in dotted.items():  # appended after everything, as the fork does: they win
        row = server_flag(name)
        spelled = f"--{name}.*"
        if row is not None and row.refused:
            refused.append((spelled, row.why))
        elif row is not None and row.setting:
            values[row.setting] = (json.dumps(tree), spelled)
        elif name in VLLM_FLAGS:
            ignored.append(f"{spelled} {json.dumps(tree)}")
        else:
            unknown.append(f"{spelled} {json.dumps(tree)}")
    if serve and positional:
        if "model" in values and values["model"][1] == "--model":  # from --config, the positional wins
            raise ConfigError(f"the launch names the model twice: {positional[0]!r} and --model "
                              f"{values['model'][0]!r} (the server refuses it too)")
        values["model"] = (positional[0], "positional")
        positional = positional[1:]
    for word in positional:
        ignored.append(f"{word} (a positional argument the server does not use)")
    return ServerArgs(entry, values, tuple(ignored), tuple(unknown), tuple(refused), config_file)
