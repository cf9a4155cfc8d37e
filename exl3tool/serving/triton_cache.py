"""Where the drop-in encoder's Triton kernels are cached on disk, so a server's first encode does not compile.

Triton compiles a kernel variant the first time a process runs it (0.7-5 s for a layer whose encode then takes
0.05 s) and keeps the result in ``TRITON_CACHE_DIR``, by default ``~/.triton/cache``. In a serving container the
home directory is the image's and is lost at every restart, so each TP rank of every cold start compiled again.
The one directory a deploy already keeps across restarts, writable by the server, is the EXL3 cache root (the
server writes its own entries there). Unless ``TRITON_CACHE_DIR`` is set, the drop-in's calls therefore use
``<cache root>/exl3tool-triton`` (``VLLM_EXL3_ONLINE_CACHE_DIR``, else ``$VLLM_CACHE_ROOT/exl3_online``, as the
server resolves it). exl3tool's cache commands read only ``<cache root>/v1``, so the folder is never taken for an
entry. Triton's cache keys hold the GPU, the Triton version and the kernel source: one folder serves every GPU
model and every exl3tool version without mixing them up.

The variable is set only while a drop-in call runs (Triton reads it at each compile) and put back after, so the
server's own Triton kernels keep their cache where they had it. A cache root that cannot be created or written
(a read-only cache mount) leaves Triton's own default in place: where kernels are cached never changes a result.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["ENV", "FOLDER", "drop_in_triton_cache", "triton_cache_dir"]

ENV = "TRITON_CACHE_DIR"
FOLDER = "exl3tool-triton"
_ENV_GUARD = threading.Lock()
_users = 0  # calls inside drop_in_triton_cache right now (several threads, one per device, may encode at once)
_ours = False  # whether TRITON_CACHE_DIR is the value the first of them set


def triton_cache_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """The folder the drop-in points Triton at: None when ``TRITON_CACHE_DIR`` is set (the user's choice stands)
    or when ``<cache root>/exl3tool-triton`` cannot be created and written."""
    from exl3tool.cache.settings import cache_root

    env = os.environ if environ is None else environ
    if env.get(ENV, "").strip():
        return None
    folder = Path(os.path.abspath(cache_root(env, _running_release()) / FOLDER))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return folder if os.access(folder, os.W_OK | os.X_OK) else None


_SERVER_CACHE_MODULE = "vllm.model_executor.layers.quantization.exl3_online_cache"


def _running_release():
    """The release whose cache root this process's server uses: the one whose cache module is the file the server
    imported (by git blob); the newest when none is (not inside a server, or a module exl3tool does not know:
    where Triton caches kernels never changes a result)."""
    import sys

    from exl3tool.releases import RELEASES, git_blob, newest

    path = getattr(sys.modules.get(_SERVER_CACHE_MODULE), "__file__", None)
    try:
        blob = git_blob(Path(path).read_bytes()) if path else ""
    except OSError:
        blob = ""
    return next((r for r in reversed(RELEASES) if r.cache_module is not None and r.cache_module.blob == blob),
                newest())


@contextlib.contextmanager
def drop_in_triton_cache() -> Iterator[Path | None]:
    """Within the block Triton caches in ``triton_cache_dir()`` (yielded; None: left as it was)."""
    global _users, _ours
    with _ENV_GUARD:
        if _users == 0:
            folder = triton_cache_dir()
            _ours = folder is not None
            if folder is not None:
                os.environ[ENV] = str(folder)
        else:
            folder = Path(os.environ[ENV]) if _ours else None
        _users += 1
    try:
        yield folder
    finally:
        with _ENV_GUARD:
            _users -= 1
            if _users == 0 and _ours:
                os.environ.pop(ENV, None)
                _ours = False
