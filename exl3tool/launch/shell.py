"""Shell scripts that start a server, read by running them under the system's bash in the read-only sandbox of
``launch.script`` (docs/launch.md): ``run_script`` is what ``parse.find_server`` calls for a shell's ``-c``
script (``bash -lc '...'``) and ``load`` for a script file; ``script_changes`` turns a recorded start into what
the script exported for the server.

This replaced exl3tool's own shell reader (a Python walk of quoting, expansions and ``if``, about 1,100 lines),
which accepted none of the fork's 10 public launchers as operators run them; bash accepts 9
(benchmarks/launcher_evidence.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Optional

from exl3tool.errors import ConfigError
from exl3tool.launch.script import SHELLS, LauncherStart, read_launcher

__all__ = ["ScriptResult", "run_script", "run_file", "script_changes", "container_view", "SHELLS", "LOOKUP_PREFIXES"]

LOOKUP_PREFIXES = ("VLLM_", "HF_", "XDG_", "HUGGINGFACE_", "TRANSFORMERS_")
# the container a -c script found by parse.find_server runs in: its volumes, the launcher folders
_VIEW: ContextVar[Optional[tuple[tuple[tuple[str, str], ...], tuple[str, ...]]]] = ContextVar("view", default=None)


@contextmanager
def container_view(mounts: Sequence[tuple[str, str]], launcher_dirs: Sequence[str] = ()) -> Iterator[None]:
    """Scripts read inside this block run in a container's view (its volumes), not on this host."""
    token = _VIEW.set((tuple(mounts), tuple(launcher_dirs)))
    try:
        yield
    finally:
        _VIEW.reset(token)


@dataclass
class ScriptResult:
    """The server's command a script starts, with what the script set up for it."""

    words: list[str]  # the server's command, as bash passed it
    line: int  # always 0: bash ran the script, no line of it is singled out
    prefix_env: list[tuple[str, str]]  # kept for callers: bash puts NAME=VALUE prefixes in the environment
    exports: dict[str, tuple[str, str]]  # variables the script set or changed for the server: name -> (value, where)
    unexported: dict[str, int]  # kept for callers: bash exports what the server gets, nothing else is seen
    workdir: Optional[str]  # where the server starts (None: where the script started)
    environ: dict[str, str]  # the server's whole environment
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def script_changes(start: LauncherStart, environ: Mapping[str, str], where: str) -> tuple[
        dict[str, tuple[str, str]], list[str]]:
    """What the script exported for the server that ``environ`` did not hold (name -> (value, where)), and notes
    for look-up variables it removed."""
    how = f"set by {where} (run by bash{', its DRY_RUN=1 mode' if start.how == 'DRY_RUN=1' else ''})"
    exports = {k: (v, how) for k, v in start.env.items() if environ.get(k) != v and k != "PATH"}
    notes = [f"{where} unsets {k}: the server does not get it" for k in environ
             if k not in start.env and k.startswith(LOOKUP_PREFIXES)]
    notes += [f"{where} sets {k} but does not export it: the server does not see it" for k in start.unexported]
    return exports, notes


def _result(start: LauncherStart, environ: Mapping[str, str], where: str, workdir: Optional[str]) -> ScriptResult:
    exports, notes = script_changes(start, environ, where)
    cwd = start.cwd if start.cwd and start.cwd != workdir else None
    return ScriptResult(list(start.argv), 0, [], exports, {}, cwd, dict(start.env), [], [*start.notes, *notes])


def run_script(text: str, *, environ: Mapping[str, str], is_server: Callable[[list[str], Optional[str]], bool],
               where: str, workdir: Optional[str] = None,
               read_file: Optional[Callable[[str], Optional[str]]] = None, strict: bool = True,
               mounts: Optional[Sequence[tuple[str, str]]] = None,
               launcher_dirs: Sequence[str] = ()) -> Optional[ScriptResult]:
    """Run ``text`` with ``bash -c`` in the sandbox, starting with ``environ``; the last recorded command that
    ``is_server(words, cwd)`` accepts is the server's. None when the script starts none.

    ``strict`` False (only looking whether a script starts a server): a script that fails gives None instead of
    the ConfigError naming its error. ``read_file`` is unused (bash reads what it reads); ``mounts`` run it in a
    container's view (``launch.script``).
    """
    del read_file
    view = _VIEW.get()
    if mounts is None and view is not None:
        mounts, launcher_dirs = view[0], (*launcher_dirs, *view[1])
    try:
        start = read_launcher(["bash", "-c", text], environ=environ, cwd=workdir, mounts=mounts,
                              launcher_dirs=launcher_dirs, is_server=lambda w: is_server(w, None), where=where)
    except ConfigError:
        if strict:
            raise
        return None
    return None if start is None else _result(start, environ, where, workdir)


def run_file(path: str, args: Sequence[str], *, environ: Mapping[str, str],
             is_server: Callable[[list[str]], bool], where: str, workdir: Optional[str] = None,
             mounts: Optional[Sequence[tuple[str, str]]] = None, launcher_dirs: Sequence[str] = (),
             strict: bool = True) -> Optional[ScriptResult]:
    """Run the script file ``path`` (a path as the script's own machine sees it) with ``args``, as ``run_script``."""
    try:
        start = read_launcher(["bash", path, *args], environ=environ, cwd=workdir, mounts=mounts,
                              launcher_dirs=launcher_dirs, is_server=is_server, where=where)
    except ConfigError:
        if strict:
            raise
        return None
    return None if start is None else _result(start, environ, where, workdir)
