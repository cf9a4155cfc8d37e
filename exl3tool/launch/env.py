"""The server's environment, in layers: the launch's own, ``--env-file`` files, then exl3tool's environment.

Docker's env-file format (``docker run --env-file``): one ``NAME=VALUE`` a line, the value taken literally to the
end of the line (no quotes removed, no ``$`` expanded), ``NAME`` alone takes the variable from the environment
of the process reading the file (unset there: left out), lines starting with ``#`` and blank lines skipped.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from exl3tool.errors import ConfigError

__all__ = ["EnvValue", "EnvLayers", "read_env_file"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class EnvValue:
    """One variable's value and where it came from (``source``: a kind, ``detail``: the file, line or flag)."""

    value: str
    source: str  # "launch env" | "env file" | "process env"
    detail: str = ""


def read_env_file(path: str, *, environ: Optional[Mapping[str, str]] = None, label: str = "--env-file",
                  source: str = "env file") -> dict[str, EnvValue]:
    """Read a Docker-format env file; an unreadable file or a bad line is a ConfigError naming it (exit 2)."""
    env = os.environ if environ is None else environ
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise ConfigError(f"{label} {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{label} {path}: not a text file (Docker's env-file format: NAME=VALUE lines)") from None
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

    def get(self, name: str) -> Optional[EnvValue]:
        """The value the server sees for ``name`` by this precedence, or None when nothing names it."""
        if name in self.launch:
            return self.launch[name]
        if name in self.files:
            return self.files[name]
        if self.process is not None and name in self.process and not (self.container and name == "HOME"):
            return EnvValue(self.process[name], "process env")
        return None

    def merged(self) -> dict[str, str]:
        """Every variable by precedence, as one mapping (what the server's environment holds for our purposes)."""
        out: dict[str, str] = {}
        if self.process is not None:
            out.update({k: v for k, v in self.process.items() if not (self.container and k == "HOME")})
        out.update({k: v.value for k, v in self.files.items()})
        out.update({k: v.value for k, v in self.launch.items()})
        return out
