"""An image's settings: its ``ENV`` (the lowest layer of a container's environment), labels and entrypoint.

Read, in this order, from:

1. a saved inspect document, ``--image-inspect FILE`` (what ``docker image inspect NAME > FILE`` writes, podman's
   too): the image as it is where it runs, read here without a runtime; or a saved image, ``--image-archive FILE``
   (``docker save``: its configuration, read by ``launch.forkfiles``, which also reads the fork modules in it);
2. ``docker|podman image inspect`` when the runner's CLI is on PATH and the image is present (the runner of the
   launch first). Never a pull: a missing image is said in one line, with how to give it;
3. the table of the fork's published images that ships with exl3tool (``images.json``, data: each row cites the
   Dockerfile, build script and receipt it was read from), for the offline case.

Whichever gave the settings is named (``ImageSettings.source`` and ``describe()``), so a reader can tell an inspected
image from a remembered one. The labels (``local-inference.vllm.integration.tree``, ...) are kept as read:
``LaunchSettings.image_labels`` exposes them to what picks a server release from them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Callable, Optional

from exl3tool.errors import ConfigError
from exl3tool.launch.env import EnvValue

__all__ = ["ImageSettings", "image_env", "read_image", "parse_inspect", "published_images", "table_image",
           "IMAGE_SOURCES", "image_settings", "same_image", "archive_settings"]

_TIMEOUT_S = 30
_FORMAT = "{{json .Config}}"
# where an image's settings came from (ImageSettings.source)
IMAGE_SOURCES = ("inspect file", "image archive", "docker image inspect", "podman image inspect",
                 "published-images table")


@dataclass(frozen=True)
class ImageSettings:
    """An image's ENV, labels and entrypoint, and where they were read (``source``, one of ``IMAGE_SOURCES``)."""

    name: str
    env: dict[str, str]
    labels: dict[str, str]
    entrypoint: Optional[tuple[str, ...]]
    cmd: Optional[tuple[str, ...]]
    source: str
    detail: str = ""  # the file, the runner's path, or the table row's release and first citation
    release: str = ""  # the table's release name (only from the table)
    unknown_env: tuple[str, ...] = ()  # variables the image sets to a value the table does not know
    notes: tuple[str, ...] = field(default=())  # e.g. why the runtime could not inspect it before the table did

    def env_values(self) -> dict[str, EnvValue]:
        """The ENV as the lowest layer of the server's environment, each value saying where it came from."""
        return {k: EnvValue(v, "launch env", f"ENV of the image {self.name} ({self.source})")
                for k, v in self.env.items()}

    def how(self) -> str:
        if self.source in ("inspect file", "image archive"):
            return f"{self.source} {self.detail}"
        if self.source == "published-images table":
            return f"exl3tool's published-images table: {self.release}"
        return f"{self.source.split(' ')[0]} image inspect"

    def describe(self) -> str:
        """One line: which image, and which source gave its ENV, labels and entrypoint."""
        line = f"image {self.name}: ENV, labels and entrypoint from {self.how()}"
        if self.unknown_env:
            line += (f"; the table does not know its {', '.join(self.unknown_env)} (build arguments): pass "
                     "--image-inspect FILE if one of them matters")
        return line

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "detail": self.detail, "release": self.release or None,
                "env": dict(self.env), "labels": dict(self.labels),
                "entrypoint": list(self.entrypoint) if self.entrypoint is not None else None,
                "cmd": list(self.cmd) if self.cmd is not None else None, "unknown_env": list(self.unknown_env),
                "notes": list(self.notes)}


def _strings(value: Any, where: str) -> Optional[tuple[str, ...]]:
    if value is None:
        return None
    if isinstance(value, str):  # podman may print a shell-form entrypoint as one string
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} is not a list of strings")
    return tuple(value)


def _from_config(config: Any, name: str, source: str, detail: str, where: str) -> ImageSettings:
    """Settings from an inspect document's ``Config`` object (or a bare ``Config.Env`` list)."""
    if isinstance(config, list):  # an ENV list alone (`--format '{{json .Config.Env}}'`)
        config = {"Env": config}
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: no Config object (expected the output of `docker image inspect NAME`)")
    env: dict[str, str] = {}
    for item in config.get("Env") or []:
        if not isinstance(item, str):
            raise ConfigError(f"{where}: Config.Env holds {item!r}, not NAME=VALUE")
        key, eq, value = item.partition("=")
        if eq:
            env[key] = value
    labels = config.get("Labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise ConfigError(f"{where}: Config.Labels is not an object of strings")
    return ImageSettings(name, env, dict(labels), _strings(config.get("Entrypoint"), f"{where}: Config.Entrypoint"),
                         _strings(config.get("Cmd"), f"{where}: Config.Cmd"), source, detail)


def _names(doc: dict) -> list[str]:
    return [n for k in ("RepoTags", "RepoDigests") for n in (doc.get(k) or []) if isinstance(n, str)]


def parse_inspect(text: str, where: str, name: Optional[str] = None) -> ImageSettings:
    """An image's settings from ``docker|podman image inspect`` output (a list of image objects, or one object).

    With several images in the document, ``name`` picks the one whose RepoTags/RepoDigests hold it."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} is not JSON ({exc.msg} at line {exc.lineno}); write it with "
                          "`docker image inspect NAME > FILE`") from None
    items = doc if isinstance(doc, list) else [doc]
    items = [d for d in items if isinstance(d, dict)]
    if not items:
        raise ConfigError(f"{where} holds no image (expected the output of `docker image inspect NAME`)")
    chosen = items[0]
    if name is not None and len(items) > 1:
        hits = [d for d in items if any(same_image(name, n) for n in _names(d))]
        if len(hits) != 1:
            raise ConfigError(f"{where} holds {len(items)} images and {'none' if not hits else 'several'} named "
                              f"{name}; save one: `docker image inspect {name} > FILE`")
        chosen = hits[0]
    label = name or next(iter(_names(chosen)), "") or str(chosen.get("Id", "the image"))
    settings = _from_config(chosen.get("Config"), label, "inspect file", where, where)
    if name is not None and _names(chosen) and not any(same_image(name, n) for n in _names(chosen)):
        settings = _with_note(settings, f"{where} is the inspect document of {', '.join(_names(chosen)[:2])}, not "
                                        f"of {name}: its settings are used as given")
    return settings


def _with_note(s: ImageSettings, note: str) -> ImageSettings:
    from dataclasses import replace

    return replace(s, notes=(*s.notes, note))


def _normal(name: str) -> str:
    for prefix in ("docker.io/", "index.docker.io/", "registry-1.docker.io/"):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


def same_image(a: str, b: str) -> bool:
    """Whether two image references name the same image: equal (Docker Hub's host dropped), or the same digest."""
    a, b = _normal(a.strip()), _normal(b.strip())
    if a == b:
        return True
    da, db = a.partition("@")[2], b.partition("@")[2]
    if da and db and da == db:
        return a.partition("@")[0].rsplit(":", 1)[0] == b.partition("@")[0].rsplit(":", 1)[0]
    return False


@lru_cache(maxsize=1)
def published_images() -> tuple[dict, ...]:
    """The rows of ``images.json``: the fork's published images' settings (docs/images.md)."""
    text = resources.files("exl3tool.launch").joinpath("images.json").read_text(encoding="utf-8")
    doc = json.loads(text)
    return tuple(doc["images"])


def table_image(name: str) -> Optional[ImageSettings]:
    """The published-images table's settings of ``name`` (a tag or a digest reference), or None."""
    for row in published_images():
        if any(same_image(name, n) for n in row["names"]):
            src = row["sources"][0]
            return ImageSettings(
                name, dict(row["env"]), dict(row["labels"]), tuple(row["entrypoint"]) if row["entrypoint"] else None,
                tuple(row["cmd"]) if row.get("cmd") else None, "published-images table",
                f"{src['repo']} {src['file']} @ {src['commit'][:12]}", row["release"], tuple(row.get("unknown_env", ())))
    return None


@lru_cache(maxsize=32)
def _inspect(path: str, image: str) -> tuple[Optional[ImageSettings], str]:
    tool = os.path.basename(path)
    try:
        done = subprocess.run([path, "image", "inspect", "--format", _FORMAT, image],
                              capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"`{tool} image inspect {image}` did not run ({exc})"
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no output"])[0][:160]
        return None, f"`{tool} image inspect {image}` failed ({first})"
    where = f"`{tool} image inspect {image}`"
    try:
        config = json.loads(done.stdout.strip() or "null")
        return _from_config(config, image, f"{tool} image inspect", path, where), ""
    except (json.JSONDecodeError, ConfigError) as exc:
        return None, f"{where} printed no image configuration ({str(exc)[:120]})"


def read_image(name: str, *, runner: Optional[str] = None, inspect_file: Optional[str] = None,
               which: Callable[[str], Optional[str]] = shutil.which) -> tuple[Optional[ImageSettings], str]:
    """The settings of image ``name`` and "" ; or None and why they could not be read (one sentence, with the fix).

    ``inspect_file`` (``--image-inspect``) wins; then the runner's CLI (``podman`` first for a podman launch), then
    the other; then the published-images table. Nothing is pulled.
    """
    if inspect_file is not None:
        from exl3tool.launch.forkfiles import is_image_archive

        if is_image_archive(inspect_file):  # a saved image (--image-archive): its configuration is in it
            return archive_settings(inspect_file, name or None), ""
        try:
            with open(inspect_file, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise ConfigError(f"--image-inspect {inspect_file}: cannot read it ({exc.strerror or exc})") from None
        return parse_inspect(text, f"--image-inspect {inspect_file}", name or None), ""
    if not name:
        return None, "the launch names no image"
    order = ("podman", "docker") if runner == "podman" else ("docker", "podman")
    tools = [(t, p) for t in order if (p := which(t))]
    reasons = []
    for _tool, path in tools:
        settings, why = _inspect(path, name)
        if settings is not None:
            return settings, ""
        reasons.append(why)
    if not tools:
        reasons.append(f"neither docker nor podman is on PATH to read the image {name}")
    table = table_image(name)
    if table is not None:
        return _with_note(table, "; ".join(reasons)), ""
    return None, "; ".join(reasons) + (" and it is not one of the fork's published images exl3tool knows "
                                       "(docs/images.md); exl3tool never pulls: `docker pull` it, or save `docker image "
                                       f"inspect {name} > FILE` where it is and pass --image-inspect FILE")


def archive_settings(path: str, name: Optional[str] = None) -> ImageSettings:
    """The settings of the image saved at ``path`` (``docker save``, ``podman save``: ``launch.forkfiles``), the one
    ``name`` names where it holds several."""
    from exl3tool.launch.forkfiles import read_image_archive

    saved = read_image_archive(path, name, same_image)
    where = f"--image-archive {path}"
    settings = _from_config(saved.config, name or next(iter(saved.names), "") or os.path.basename(path),
                            "image archive", path, where)
    if name is not None and saved.names and not any(same_image(name, n) for n in saved.names):
        settings = _with_note(settings, f"{where} is the saved image {', '.join(saved.names[:2])}, not {name}: its "
                                        "settings and files are used as given")
    return settings


def image_settings(name: Optional[str], inspect_file: Optional[str], runner: Optional[str] = None) -> ImageSettings:
    """``--image NAME`` / ``--image-inspect FILE`` given: the settings, or a ConfigError (exit 2) saying why not."""
    settings, why = read_image(name or "", runner=runner, inspect_file=inspect_file)
    if settings is None:
        raise ConfigError(f"--image {name}: its settings could not be read: {why}")
    return settings


def image_env(runner: str, image: str, inspect_file: Optional[str] = None,
              ) -> tuple[dict[str, EnvValue], str, Optional[ImageSettings]]:
    """The image's ``ENV`` (name -> value), "" and its settings when read; else an empty mapping, why it could not
    be read, and None."""
    settings, why = read_image(image, runner=runner, inspect_file=inspect_file)
    if settings is None:
        return {}, why, None
    return settings.env_values(), "", settings
