"""Write the directory the vLLM fork loads as ``VLLM_EXL3_ENCODER_SOURCE`` with exl3tool as its encoder.

The fork requires ``<root>/modules/quant/exl3_lib/quantize.py`` and calls its ``quantize_exl3``; without
``VLLM_EXL3_ENCODER_REVISION`` its encoder identity hashes every ``.py`` file under the root. The export holds
one ``.py`` file, whose bytes depend only on the exl3tool version, so the identity changes exactly when the
encoder does. The file refuses to load under another exl3tool version than the one that wrote it (an upgrade
without a re-export would keep the identity while changing the encoder). A marker file (not ``.py``, so not
hashed) tells a later export that the directory is one of ours; anything else non-empty is refused unless
forced. The directory is replaced in one rename: a server starting meanwhile sees the old or the new export.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from exl3tool.version import __version__
from exl3tool.errors import ConfigError

__all__ = ["MARKER", "QUANTIZE_PY", "ExportResult", "quantize_py_text", "read_marker", "write_encoder_source",
           "is_current_export"]

QUANTIZE_PY = ("modules", "quant", "exl3_lib", "quantize.py")
MARKER = ".exl3tool-encoder-source.json"
_MARKER_KIND = "exl3tool-encoder-source"


def quantize_py_text(version: str = __version__) -> str:
    """The generated ``quantize.py``: a version check and a re-export of ``exl3tool.serving.quantize_api``."""
    return f'''"""EXL3 encoder for the vLLM fork: exl3tool {version}'s quantize_exl3 (written by `exl3tool encoder-source`).

The fork loads this file from VLLM_EXL3_ENCODER_SOURCE and calls quantize_exl3 with exllamav3's convention; the
work is done by the installed exl3tool. Do not edit: the server's encoder identity hashes this file's bytes.
"""

import exl3tool

if exl3tool.__version__ != "{version}":
    raise ImportError(
        "this encoder source was written by exl3tool {version} but exl3tool " + exl3tool.__version__ + " is "
        "installed; re-run `exl3tool encoder-source " + __file__.rsplit("/modules/", 1)[0] + " --force` so the "
        "encoder identity follows the encoder"
    )

from exl3tool.serving.quantize_api import quantize_exl3  # noqa: E402

__all__ = ["quantize_exl3"]
'''


def _marker_text(version: str = __version__) -> str:
    return json.dumps({"kind": _MARKER_KIND, "exl3tool_version": version, "files": ["/".join(QUANTIZE_PY)]},
                      indent=2, sort_keys=True) + "\n"


@dataclass(frozen=True)
class ExportResult:
    """What ``write_encoder_source`` did. ``replaced``: ``none`` (new directory), ``empty``, ``export`` (an
    earlier export), ``forced`` (a directory that was not one); ``unchanged`` when the export was already current."""

    path: str
    exl3tool_version: str
    files: tuple[str, ...]
    replaced: str
    previous_version: str | None = None

    def as_json(self, encoder) -> dict:
        """The `encoder-source --json` document (docs/cache.md), with ``encoder``, the encoder identity the
        export gives (``cache.resolve_encoder_identity`` of ``path``)."""
        return {
            "path": self.path,
            "exl3tool_version": self.exl3tool_version,
            "files": list(self.files),
            "replaced": self.replaced,
            "previous_version": self.previous_version,
            "server_env": {"VLLM_EXL3_ENCODER_SOURCE": self.path},
            "encoder": {"identity": encoder.identity, "mode": encoder.mode, "root": encoder.root,
                        "payload": encoder.payload},
        }


def read_marker(path: str | os.PathLike) -> dict | None:
    """The marker of an earlier export in ``path``, or None when ``path`` holds none (or an unreadable one)."""
    try:
        data = json.loads((Path(path) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("kind") == _MARKER_KIND else None


def _current(path: Path) -> bool:
    """True when ``path`` holds exactly this version's export (same files, same bytes, nothing else hashed)."""
    py = [p for p in path.rglob("*.py")]
    target = path.joinpath(*QUANTIZE_PY)
    try:
        return (py == [target] and target.read_text(encoding="utf-8") == quantize_py_text()
                and (path / MARKER).read_text(encoding="utf-8") == _marker_text())
    except OSError:
        return False


def is_current_export(path: str | os.PathLike) -> bool:
    """Whether ``path`` is this exl3tool version's export, exactly (its only ``.py`` file the generated one)."""
    return _current(Path(path))


def _write_tree(root: Path, *, chmod_root: bool = True) -> None:
    """The export's files, world-readable (the server may run as another user)."""
    target = root.joinpath(*QUANTIZE_PY)
    target.parent.mkdir(parents=True, exist_ok=True)
    for folder in target.parents:
        if folder == root:
            break
        folder.chmod(0o755)
    if chmod_root:
        root.chmod(0o755)
    target.write_text(quantize_py_text(), encoding="utf-8")
    (root / MARKER).write_text(_marker_text(), encoding="utf-8")
    for file in (target, root / MARKER):
        file.chmod(0o644)


def write_encoder_source(path: str | os.PathLike, *, force: bool = False) -> ExportResult:
    """Write (or replace) the encoder source directory at ``path``; see the module docstring for the rules.

    Raises ConfigError for a non-empty directory that is not an earlier export (unless ``force``), a path that is
    a file, ``/`` or the home directory, and OSError-derived ConfigErrors for what cannot be written.
    """
    root = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    files = ("/".join(QUANTIZE_PY), MARKER)
    if root == Path(root.anchor) or root == Path.home():
        raise ConfigError(f"{root}: refusing to export the encoder source to the filesystem root or the home "
                          "directory; name a directory of its own, e.g. /opt/exl3tool-encoder")
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root} exists and is not a directory; name a new or empty directory")
    replaced, previous = "none", None
    if root.is_dir():
        marker = read_marker(root)
        if marker is not None:
            previous = str(marker.get("exl3tool_version"))
            if _current(root):
                return ExportResult(str(root), __version__, files, "unchanged", previous)
            replaced = "export"
        elif not any(root.iterdir()):
            replaced = "empty"
        elif force:
            replaced = "forced"
        else:
            raise ConfigError(f"{root} is not empty and is not an earlier `exl3tool encoder-source` export (no {MARKER}); "
                              "every .py file under it would enter the server's encoder identity. Name a new or empty "
                              "directory, or pass --force to replace its whole content")
    try:
        if replaced == "empty":  # written in place: an empty directory may be a mount point, which cannot be renamed
            _write_tree(root, chmod_root=False)
            return ExportResult(str(root), __version__, files, replaced, previous)
        root.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.new-", dir=root.parent))
        try:
            _write_tree(staging)
            if replaced == "none":
                staging.rename(root)
            else:
                old = Path(tempfile.mkdtemp(prefix=f".{root.name}.old-", dir=root.parent))
                old.rmdir()
                root.rename(old)
                staging.rename(root)
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    except OSError as exc:
        existing = next((p for p in root.parents if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise ConfigError(f"{root}: {existing} is a file, not a directory; name a directory under directories "
                              "only") from None
        # a failure in the staging folder beside DIR (.DIR.new-*) is a failure to write DIR's parent
        where = Path(os.fspath(exc.filename)) if exc.filename else root
        staged = where.parts[len(root.parent.parts):len(root.parent.parts) + 1]
        if where.parts[:len(root.parent.parts)] == root.parent.parts and staged and staged[0].startswith(
                f".{root.name}."):
            where = root.parent
        raise ConfigError(f"{root}: cannot write the encoder source in {where} ({exc.strerror or exc}); check the "
                          "path and its permissions") from None
    return ExportResult(str(root), __version__, files, replaced, previous)
