"""The server's environment, in layers: the launch's own, ``--env-file`` files, then exl3tool's environment.

Docker's env-file format (``docker run --env-file``): one ``NAME=VALUE`` a line, the value taken literally to the
end of the line (no quotes removed, no ``$`` expanded), ``NAME`` alone takes the variable from the environment
of the process reading the file (unset there: left out), lines starting with ``#`` and blank lines skipped.

A launcher's ``DRY_RUN=1`` output (``printf 'KEY=%q\n'`` lines, then ``Command: ...``) is the other form
exl3tool's ``--env-file`` takes: a file with a ``Command:`` line, or with a value only bash's ``%q`` prints (``''``,
``$'...'``), is read as bash reads those assignments (quoting undone) and an empty value is unset, as the server
reads ``VLLM_EXL3_*`` variables (blank is unset; docs/launch.md).
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from exl3tool.errors import ConfigError

__all__ = ["EnvValue", "EnvLayers", "read_env_file", "is_dry_run_output", "shell_word", "DRY_RUN_COMMAND"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


DRY_RUN_COMMAND = "Command:"  # the line a launcher's DRY_RUN=1 output ends with: the server's command, %q-quoted
_PERCENT_Q_ONLY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=(''|\$'.*')\s*$")  # values only bash's %q prints
_ANSI_C = {"a": "\a", "b": "\b", "e": "\x1b", "E": "\x1b", "f": "\f", "n": "\n", "r": "\r", "t": "\t",
           "v": "\v", "\\": "\\", "'": "'", '"': '"', "?": "?"}


def is_dry_run_output(lines: list[str]) -> bool:
    """A launcher's ``DRY_RUN=1`` output: a ``Command:`` line, or a value only ``printf %q`` prints (``''``,
    ``$'...'``; Docker's env-file would keep those quote characters as the value)."""
    return any(line.startswith(DRY_RUN_COMMAND) or _PERCENT_Q_ONLY.match(line.strip()) for line in lines)


def _ansi_c(body: str) -> str:
    """The text of bash's ``$'...'`` quoting (``\\n``, ``\\t``, ``\\xHH``, ``\\NNN``, ``\\'``)."""
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\" or i + 1 == len(body):
            out.append(c)
            i += 1
            continue
        nxt = body[i + 1]
        if nxt in _ANSI_C:
            out.append(_ANSI_C[nxt])
            i += 2
        elif nxt == "x":
            digits = re.match(r"[0-9A-Fa-f]{1,2}", body[i + 2:])
            out.append(chr(int(digits.group(), 16)) if digits else "\\x")
            i += 2 + (len(digits.group()) if digits else 0)
        elif nxt in "01234567":
            digits = re.match(r"[0-7]{1,3}", body[i + 1:])
            assert digits is not None
            out.append(chr(int(digits.group(), 8)))
            i += 1 + len(digits.group())
        else:
            out.append(c + nxt)
            i += 2
    return "".join(out)


def shell_word(text: str) -> list[str]:
    """Words of ``text`` as bash splits and unquotes them (no expansion: ``%q`` output has none), ``$'...'`` too.

    >>> shell_word("\\{\\\"a\\\":1\\} '' $'x\\ty'")
    ['{"a":1}', '', 'x\ty']
    """
    parts = re.split(r"(\$'(?:[^'\\]|\\.)*')", text)
    if len(parts) == 1:
        return shlex.split(text, posix=True)
    # $'...' pieces: decoded, then quoted again for shlex (a word may join plain and $'...' pieces)
    rebuilt = "".join(shlex.quote(_ansi_c(p[2:-1])) if p.startswith("$'") else p for p in parts)
    return shlex.split(rebuilt, posix=True)


@dataclass(frozen=True)
class EnvValue:
    """One variable's value and where it came from (``source``: a kind, ``detail``: the file, line or flag)."""

    value: str
    source: str  # "launch env" | "env file" | "process env"
    detail: str = ""


def read_env_file(path: str, *, environ: Optional[Mapping[str, str]] = None, label: str = "--env-file",
                  source: str = "env file", dry_run_form: bool = True) -> dict[str, EnvValue]:
    """Read a Docker-format env file, or (``dry_run_form``) a launcher's DRY_RUN output: ``KEY=%q`` lines read as
    bash reads them, an empty value unset, the ``Command:`` line skipped. An unreadable file or a bad line is a
    ConfigError naming it (exit 2). ``dry_run_form=False``: Docker's reading only (a ``docker run --env-file``)."""
    env = os.environ if environ is None else environ
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise ConfigError(f"{label} {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{label} {path}: not a text file (Docker's env-file format: NAME=VALUE lines)") from None
    if dry_run_form and is_dry_run_output(lines):
        return read_dry_run_env(lines, path, label=label, source=source)
    out: dict[str, EnvValue] = {}
    for number, line in enumerate(lines, 1):
        text = line.lstrip()
        if not text or text.startswith("#"):
            continue
        name, eq, value = text.partition("=")
        if not name or not _NAME.match(name) or (not eq and any(c.isspace() for c in name)):
            raise ConfigError(f"{label} {path} line {number}: {line.strip()[:60]!r} is not NAME=VALUE (Docker's "
                              "env-file format)")
        where = f"{path}:{number}"
        if eq:
            out[name] = EnvValue(value, source, where)
        elif name in env:  # `NAME` alone: the reading process's value, as docker takes it
            out[name] = EnvValue(env[name], source, f"{where} (NAME alone: taken from this environment)")
    return out


def read_dry_run_env(lines: list[str], path: str, *, label: str = "--env-file",
                     source: str = "env file") -> dict[str, EnvValue]:
    """The ``KEY=%q`` lines of a launcher's DRY_RUN output: bash's quoting undone, an empty value left out (unset:
    the launchers print ``${KEY:-}``, and the server reads a blank ``VLLM_EXL3_*`` value as unset)."""
    out: dict[str, EnvValue] = {}
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#") or text.startswith(DRY_RUN_COMMAND):
            continue
        name, eq, value = text.partition("=")
        if not eq or not _NAME.match(name):
            continue  # the launcher's other output ("Process-group interfaces: ..."), not an assignment
        try:
            words = shell_word(value)
        except ValueError:
            raise ConfigError(f"{label} {path} line {number}: {text[:60]!r} is not a KEY=%q line (unbalanced "
                              "quotes)") from None
        if len(words) > 1:
            raise ConfigError(f"{label} {path} line {number}: {text[:60]!r} is not a KEY=%q line (more than one "
                              "word)")
        if words and words[0] != "":
            out[name] = EnvValue(words[0], source, f"{path}:{number} (a launcher's DRY_RUN output, read as bash)")
    return out


@dataclass(frozen=True)
class EnvLayers:
    """The server's environment in precedence order: the launch's own, then ``--env-file``s, then ours.

    ``process`` is None when our environment does not reach the server (never used for ``HOME``: a container's
    home is the image's).
    """

    launch: Mapping[str, EnvValue]
    files: Mapping[str, EnvValue]
    process: Optional[Mapping[str, str]]
    container: bool = False
    hidden: frozenset[str] = frozenset()  # names a wrapper removed from ours before the server (env -u, sudo -u)

    def _seen(self, name: str) -> bool:
        return not (self.container and name == "HOME") and name not in self.hidden

    def get(self, name: str) -> Optional[EnvValue]:
        """The value the server sees for ``name`` by this precedence, or None when nothing names it."""
        if name in self.launch:
            return self.launch[name]
        if name in self.files:
            return self.files[name]
        if self.process is not None and name in self.process and self._seen(name):
            return EnvValue(self.process[name], "process env")
        return None

    def merged(self) -> dict[str, str]:
        """Every variable by precedence, as one mapping (what the server's environment holds for our purposes)."""
        out: dict[str, str] = {}
        if self.process is not None:
            out.update({k: v for k, v in self.process.items() if self._seen(k)})
        out.update({k: v.value for k, v in self.files.items()})
        out.update({k: v.value for k, v in self.launch.items()})
        return out
