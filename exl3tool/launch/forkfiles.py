"""The fork's modules as a server's image holds them: where its rules come from when the image can be read.

An image's labels name the release it was built from, but an image that replaces one of the fork's files (the
``gg-r34-patched`` images swap r34's ``exl3.py`` for PR #312's) keeps them. Where the image's files can be read,
exl3tool takes the rules from the files themselves (``exl3tool.releases.resolve_release`` with ``ForkModules``):

* a mounted root filesystem or an unpacked image folder, ``--image-root DIR`` (``podman image mount IMAGE``, or
  ``docker export $(docker create IMAGE) | tar -x -C DIR``); DIR may also be the ``vllm`` package folder itself, or
  the ``site-packages`` folder holding it;
* the root of a running server, ``/proc/PID/root`` (``--pid`` of a server in a container);
* a saved image, ``--image-archive FILE`` (``docker save IMAGE -o FILE``, ``podman save``, the OCI archive too):
  its manifest and layers are walked in order (``tarfile``; later layers win, whiteouts ``.wh.NAME`` and opaque
  ``.wh..wh..opq`` remove what lies below), and what the vllm package look-up reads (its folders' links, the two
  modules, the package markers) is laid out in a private temporary folder read as an image root, so an archive
  gives the same ``ForkModules`` as ``--image-root`` of the same image. Its configuration (ENV, labels,
  entrypoint) is the image's settings (``read_image_archive``). Nothing is run: ``docker create`` + ``docker cp``
  would read the files too, but exl3tool starts nothing.

The vLLM package is looked for where the fork's images and the usual Python layouts install it; links are
followed as the image would follow them (``cache.serverfs``: an absolute link means the image's path, never this
machine's), and only the two files are read: ``vllm/model_executor/layers/quantization/exl3_online_cache.py`` and
``exl3.py`` (their git blobs name a release's version; ``exl3.py``'s text names its rule for unaligned shards).
"""

from __future__ import annotations

import json
import os
import posixpath
import tarfile
import tempfile
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Callable, Optional

from exl3tool.cache.serverfs import server_realpath
from exl3tool.errors import ConfigError
from exl3tool.releases import ForkModules, git_blob

__all__ = ["read_fork_modules", "VLLM_PREFIXES", "SavedImage", "read_image_archive", "is_image_archive"]

_QUANT = "model_executor/layers/quantization"
_PY = tuple(f"python3.{n}" for n in range(14, 7, -1))
# where images install the vllm package (the fork's: /opt/venv, Python 3.12; upstream vllm-openai: /usr/local ...)
VLLM_PREFIXES = (
    *(f"/opt/venv/lib/{py}/site-packages" for py in _PY),
    *(f"/usr/local/lib/{py}/dist-packages" for py in _PY),
    *(f"/usr/local/lib/{py}/site-packages" for py in _PY),
    *(f"/opt/conda/lib/{py}/site-packages" for py in _PY),
    *(f"/root/.venv/lib/{py}/site-packages" for py in _PY),
    "/usr/lib/python3/dist-packages", "/workspace/vllm", "/vllm-workspace", "/opt/vllm", "/app/vllm",
)
_MAX_BYTES = 4 << 20  # exl3.py is ~270 kB; anything far larger is not the fork's module


class _Root:
    """The image's paths under a root folder here (no mounts: everything is in the image)."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") or "/"

    def to_host(self, path: str) -> Optional[str]:
        return self.root + path if self.root != "/" else path

    def mount_points(self) -> tuple[str, ...]:
        return ()


def _read(view: _Root, path: str) -> Optional[bytes]:
    """The bytes of the image's ``path`` (links followed in the image); None when the image has no such file. A file
    that is there but cannot be read (permissions, far too large for the module) is a ConfigError naming it: taken
    as absent, it would turn an image that encodes online into one that does not."""
    try:
        here = view.to_host(server_realpath(view, path, "the image's vllm module"))
    except ConfigError:
        return None  # a loop of links, or a part exl3tool cannot reach: no file there
    if here is None or not os.path.exists(here):
        return None
    if not os.path.isfile(here):
        raise ConfigError(f"{here}: not a regular file where the image's {posixpath.basename(path)} should be")
    try:
        with open(here, "rb") as fh:
            data = fh.read(_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{here}: cannot read the image's {posixpath.basename(path)} ({exc.strerror or exc})") from None
    if len(data) > _MAX_BYTES:
        raise ConfigError(f"{here}: over {_MAX_BYTES >> 20} MiB, not the fork's {posixpath.basename(path)}")
    return data


def _package(view: _Root, package: str) -> Optional[ForkModules]:
    exl3 = _read(view, f"{package}/{_QUANT}/exl3.py")
    cache = _read(view, f"{package}/{_QUANT}/exl3_online_cache.py")
    init = _read(view, f"{package}/__init__.py")
    if exl3 is None and (init is None or _read(view, f"{package}/{_QUANT}/__init__.py") is None):
        return None  # not a vllm package here
    where = view.to_host(package) or package
    return ForkModules(where, git_blob(cache) if cache is not None else None,
                       git_blob(exl3) if exl3 is not None else None,
                       exl3.decode("utf-8", "replace") if exl3 is not None else "")


def read_fork_modules(root: str, *, required: bool = True) -> Optional[ForkModules]:
    """The fork's modules under ``root``: a root filesystem (the vllm package looked for in ``VLLM_PREFIXES``), a
    ``site-packages`` folder, or the ``vllm`` package folder itself.

    None when no vllm package is there and not ``required``; a ConfigError naming ``root`` and where it looked when
    ``required`` (``--image-root``), or when two packages with different modules are found (which one the server
    imports is the image's Python's choice: give the package folder).
    """
    if not os.path.isdir(root):
        if not required:
            return None
        raise ConfigError(f"--image-root {root}: not a folder (give a mounted image root, an unpacked image, or its "
                          "vllm package folder)")
    view = _Root(os.path.abspath(root))
    for package in ("/", "/vllm"):  # the package folder itself, or a site-packages folder
        found = _package(view, package.rstrip("/") or "")
        if found is not None:  # a vllm package, with or without EXL3 support
            return found
    hits: list[ForkModules] = []
    for prefix in VLLM_PREFIXES:
        found = _package(view, posixpath.join(prefix, "vllm"))
        if found is not None and all(h.where != found.where for h in hits):
            hits.append(found)
    distinct = {(h.cache_blob, h.exl3_blob) for h in hits}
    if len(distinct) > 1:
        raise ConfigError(f"{root} holds {len(hits)} vllm packages with different EXL3 modules ("
                          f"{', '.join(h.where for h in hits[:3])}): give the one the server imports as --image-root")
    if hits:
        return hits[0]
    if required:
        raise ConfigError(f"--image-root {root}: no vllm package there (looked for vllm/{_QUANT} in the folder, and "
                          "under /opt/venv, /usr/local/lib, /opt/conda, /usr/lib/python3 ...): give the image's root, "
                          "its site-packages folder or the vllm package folder")
    return None


# --- a saved image (docker save / podman save / an OCI archive) --------------------------------------------------

_WANTED = tuple(f"{_QUANT}/{n}" for n in ("exl3.py", "exl3_online_cache.py"))
_MARKERS = (f"{_QUANT}/__init__.py",)  # only their presence is read
_MAX_JSON = 64 << 20  # a manifest, index or image config is small


@dataclass(frozen=True)
class SavedImage:
    """A saved image as ``read_image_archive`` reads it: its names, its configuration (ENV, labels, entrypoint) and
    the fork modules its layers hold (None: no vllm package in it)."""

    path: str
    names: tuple[str, ...]  # RepoTags (docker-archive) or ref names (OCI)
    config: dict = field(repr=False)  # the image configuration's "config" object: Env, Labels, Entrypoint, Cmd
    modules: Optional[ForkModules] = None
    layers: int = 0


class _Node:
    __slots__ = ("kind", "target", "data", "children")

    def __init__(self, kind: str, target: str = "", data: Optional[bytes] = None) -> None:
        self.kind, self.target, self.data = kind, target, data  # kind: dir | file | link | other
        self.children: dict[str, _Node] = {}


def _one(exc: BaseException) -> str:
    """An exception's first line (tarfile's errors list every method they tried, one per line)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]


def is_image_archive(path: str) -> bool:
    """Whether ``path`` is a tar archive (a saved image) rather than an inspect document."""
    try:
        return os.path.isfile(path) and tarfile.is_tarfile(path)
    except OSError:
        return False


def _parts(name: str) -> list[str]:
    """A member's path in the image, as components (``./``, a leading ``/`` and ``..`` above the root dropped)."""
    return [p for p in posixpath.normpath("/" + name).split("/") if p]


def _json_member(outer: tarfile.TarFile, name: str, where: str) -> Any:
    try:
        member = outer.getmember(_member_name(outer, name))
        fh = outer.extractfile(member)
        data = fh.read(_MAX_JSON + 1) if fh is not None else b""
    except (KeyError, OSError, tarfile.TarError) as exc:
        raise ConfigError(f"{where}: no {name} in the archive ({_one(exc)})") from None
    if len(data) > _MAX_JSON:
        raise ConfigError(f"{where}: {name} is over {_MAX_JSON >> 20} MiB, not an image's")
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: {name} is not JSON ({_one(exc)})") from None


def _member_name(outer: tarfile.TarFile, name: str) -> str:
    names = set(outer.getnames())
    for candidate in (name, "./" + name, name.lstrip("./")):
        if candidate in names:
            return candidate
    raise KeyError(name)


def _blob(digest: Any, where: str) -> str:
    if not isinstance(digest, str) or ":" not in digest:
        raise ConfigError(f"{where}: a descriptor without a digest ({digest!r})")
    algo, _, hexa = digest.partition(":")
    return f"blobs/{algo}/{hexa}"


def _image_entries(outer: tarfile.TarFile, where: str) -> list[tuple[tuple[str, ...], str, list[str]]]:
    """Each image of the archive: (its names, its config member, its layer members in order)."""
    names = set(n.lstrip("./") if n.startswith("./") else n for n in outer.getnames())
    out: list[tuple[tuple[str, ...], str, list[str]]] = []
    if "manifest.json" in names:  # docker-archive (docker save, podman save): also written by docker's OCI layout
        doc = _json_member(outer, "manifest.json", where)
        for item in doc if isinstance(doc, list) else []:
            if not isinstance(item, dict) or not isinstance(item.get("Config"), str) \
                    or not isinstance(item.get("Layers"), list):
                raise ConfigError(f"{where}: manifest.json holds an entry without Config and Layers")
            tags = tuple(t for t in item.get("RepoTags") or [] if isinstance(t, str))
            out.append((tags, item["Config"], [str(x) for x in item["Layers"]]))
        if out:
            return out
    if "index.json" in names:  # an OCI image layout (podman save --format oci-archive)
        index = _json_member(outer, "index.json", where)
        todo = [(m, ()) for m in (index.get("manifests") or [])] if isinstance(index, dict) else []
        while todo:
            desc, tags = todo.pop(0)
            if not isinstance(desc, dict):
                continue
            ann = desc.get("annotations") or {}
            tags = tags or tuple(v for k, v in ann.items() if isinstance(v, str) and k in (
                "io.containerd.image.name", "org.opencontainers.image.ref.name"))
            doc = _json_member(outer, _blob(desc.get("digest"), where), where)
            if isinstance(doc, dict) and isinstance(doc.get("manifests"), list):  # a nested index (platforms)
                todo.extend((m, tags) for m in doc["manifests"])
                continue
            if not isinstance(doc, dict) or not isinstance(doc.get("layers"), list):
                raise ConfigError(f"{where}: {_blob(desc.get('digest'), where)} is not an image manifest")
            out.append((tags, _blob((doc.get("config") or {}).get("digest"), where),
                        [_blob((layer or {}).get("digest"), where) for layer in doc["layers"]]))
        if out:
            return out
    raise ConfigError(f"{where}: not a saved image (no manifest.json or index.json naming an image with layers): "
                      "save it with `docker save IMAGE -o FILE` or `podman save IMAGE -o FILE`")


def _pick(entries, name: Optional[str], where: str, same: Callable[[str, str], bool]):
    if len(entries) == 1:
        return entries[0]
    hits = [e for e in entries if name and any(same(name, t) for t in e[0])]
    if len(hits) == 1:
        return hits[0]
    tags = ", ".join(t for e in entries for t in e[0][:1]) or "untagged"
    raise ConfigError(f"{where} holds {len(entries)} images ({tags}) and {'none' if not hits else 'several'} "
                      f"named {name or '(no --image given)'}: give --image NAME, or save one image")


def _apply_layer(root: _Node, layer: tarfile.TarFile, where: str) -> None:
    """One layer over the ones below: its whiteouts first (they hide only what lies below), then its entries."""
    deletions: list[list[str]] = []
    opaque: list[list[str]] = []
    additions: list[tuple[list[str], tarfile.TarInfo]] = []
    for member in layer:
        parts = _parts(member.name)
        if not parts:
            continue
        base = parts[-1]
        if base == ".wh..wh..opq":
            opaque.append(parts[:-1])
        elif base.startswith(".wh."):
            deletions.append(parts[:-1] + [base[4:]])
        else:
            additions.append((parts, member))
    for parts in deletions:
        parent = _find(root, parts[:-1])
        if parent is not None:
            parent.children.pop(parts[-1], None)
    for parts in opaque:
        node = _find(root, parts)
        if node is not None:
            node.children = {}
    for parts, member in additions:
        parent = root
        for part in parts[:-1]:  # a parent the layer does not list is a folder (as unpacking makes it)
            child = parent.children.get(part)
            if child is None or child.kind != "dir":
                child = parent.children[part] = _Node("dir")
            parent = child
        name = parts[-1]
        if member.isdir():
            old = parent.children.get(name)
            if old is None or old.kind != "dir":
                parent.children[name] = _Node("dir")
        elif member.issym():
            parent.children[name] = _Node("link", member.linkname)
        elif member.isreg() or member.islnk():
            data = None
            if any("/".join(parts).endswith(w) for w in _WANTED):
                try:
                    fh = layer.extractfile(member)
                    data = fh.read(_MAX_BYTES + 1) if fh is not None else b""
                except (OSError, tarfile.TarError, KeyError) as exc:
                    raise ConfigError(f"{where}: cannot read /{'/'.join(parts)} from its layer ({_one(exc)})") from None
            parent.children[name] = _Node("file", data=data)
        else:
            parent.children[name] = _Node("other")


def _find(root: _Node, parts: list[str]) -> Optional[_Node]:
    node: Optional[_Node] = root
    for part in parts:
        node = node.children.get(part) if node is not None and node.kind == "dir" else None
        if node is None:
            return None
    return node


def _lay_out(root: _Node, into: str) -> None:
    """What the vllm package look-up reads, under ``into``: every link (as a link: ``server_realpath`` follows it
    in the image, never here), the two modules and the package markers (empty: only their presence is read).
    Nothing is written below a link, so no write leaves ``into``."""
    stack: list[tuple[_Node, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        for name, child in node.children.items():
            here = f"{path}/{name}"
            if child.kind == "dir":
                stack.append((child, here))
                continue
            wanted = child.kind == "file" and (
                child.data is not None or any(here.endswith("/" + m) for m in _MARKERS)
                or (name == "__init__.py" and _find(node, _QUANT.split("/")) is not None))
            if child.kind not in ("link",) and not wanted:
                continue
            dest = into + here
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if child.kind == "link":
                os.symlink(child.target, dest)
            else:
                with open(dest, "wb") as fh:
                    fh.write(child.data or b"")


@lru_cache(maxsize=4)
def _saved(path: str, size: int, mtime_ns: int, name: Optional[str], same: Callable[[str, str], bool],
           shown: str) -> SavedImage:
    where = f"--image-archive {shown}"
    try:
        outer = tarfile.open(path, "r:*")
    except tarfile.ReadError:
        raise ConfigError(f"{where}: not a tar archive (nor a gzip, bzip2 or xz one); save the image with `docker "
                          "save IMAGE -o FILE` or `podman save IMAGE -o FILE`") from None
    except (OSError, tarfile.TarError) as exc:
        raise ConfigError(f"{where}: cannot read it ({_one(exc)})") from None
    with outer:
        tags, config_name, layer_names = _pick(_image_entries(outer, where), name, where, same)
        doc = _json_member(outer, config_name, where)
        config = (doc.get("config") or doc.get("Config") or {}) if isinstance(doc, dict) else {}
        root = _Node("dir")
        for n, layer_name in enumerate(layer_names, 1):
            try:
                fh = outer.extractfile(outer.getmember(_member_name(outer, layer_name)))
                head = fh.read(4) if fh is not None else b""
                if head == b"\x28\xb5\x2f\xfd":
                    raise ConfigError(f"{where}: layer {n} ({layer_name}) is zstd-compressed, which exl3tool cannot "
                                      "read; save the image uncompressed (`docker save`, `podman save --format "
                                      "docker-archive`)")
                fh.seek(0)
                with tarfile.open(fileobj=fh, mode="r:*") as layer:
                    _apply_layer(root, layer, where)
            except KeyError:
                raise ConfigError(f"{where}: the manifest names layer {layer_name}, which the archive lacks") from None
            except (OSError, tarfile.TarError, EOFError) as exc:
                raise ConfigError(f"{where}: layer {n} ({layer_name}) is not a readable tar ({_one(exc)})") from None
    with tempfile.TemporaryDirectory(prefix="exl3tool-image-") as tmp:
        _lay_out(root, tmp)
        try:
            mods = read_fork_modules(tmp, required=False)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace(tmp, f"{shown}:").replace("--image-root", where)) from None
        if mods is not None:
            package = mods.where[len(tmp):] or "/"
            mods = replace(mods, where=f"{shown}:{package}")
    return SavedImage(shown, tuple(tags), config if isinstance(config, dict) else {}, mods, len(layer_names))


def read_image_archive(path: str, name: Optional[str] = None,
                       same: Callable[[str, str], bool] = lambda a, b: a == b) -> SavedImage:
    """The saved image at ``path`` (``docker save``, ``podman save``, an OCI archive; ``name``: which image of
    several, by ``same``, the image-reference rule: ``launch.image.same_image``): its names, configuration and fork
    modules. ConfigError (exit 2) naming the file for anything else."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"--image-archive {path}: cannot read it ({exc.strerror or exc})") from None
    if not os.path.isfile(path):
        raise ConfigError(f"--image-archive {path}: not a file (give the tar `docker save IMAGE -o FILE` writes)")
    return _saved(os.path.abspath(path), st.st_size, st.st_mtime_ns, name, same, path)
