"""exl3tool: encode dense layers into EXL3 trellis weights ahead of time, into the serving stack's cache.

The public API, importable from here (each name is imported on first use, so ``import exl3tool`` and the CLI's
start stay light: no torch until a name that needs it is used)::

    request = exl3tool.ServerRequest(model="/models/m", tp_sizes=(2,))  # or filled from a launch: apply_launch
    checkpoint, plan, store = exl3tool.prepare(request)   # the look-ups the server will make, each looked up
    summary = exl3tool.warm(request)                        # encode the misses into the cache
    report = exl3tool.check(request)                        # every look-up, and why each miss misses

The layers underneath (imports only go down): ``format`` <- ``kernels`` <- ``encode`` <- ``cache``,
``checkpoint`` <- ``plan`` <- ``launch`` <- ``operations``, ``serving`` <- ``cli`` (docs/architecture.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from exl3tool.version import __version__  # defined on the ground floor: every layer stamps it

# name -> the module that defines it
_API: dict[str, str] = {
    "ServerRequest": "exl3tool.plan.request",
    "prepare": "exl3tool.plan.request",
    "warm": "exl3tool.operations.warm.run",
    "check": "exl3tool.operations.check",
    "verify_plan": "exl3tool.operations.verify",
    "plan_hydrate": "exl3tool.operations.hydrate",
    "hydrate": "exl3tool.operations.hydrate",
    "encode_linear": "exl3tool.encode.online",
    "EncodedLinear": "exl3tool.format.encoded",
    "dequantize": "exl3tool.format.decode",
    "CacheKey": "exl3tool.cache.key",
    "CacheStore": "exl3tool.cache.store",
    "server_identities": "exl3tool.cache.identity",
    "open_checkpoint": "exl3tool.checkpoint.source",
    "plan_layers": "exl3tool.checkpoint.plan",
    "load_launch": "exl3tool.launch.load",
    "resolve_launch": "exl3tool.launch.resolve",
    "apply_launch": "exl3tool.launch.request",
}

__all__ = ["__version__", *_API]

# old name -> new name (CHANGELOG "Renamed"): still answered for one release, not listed in __all__
_RENAMED: dict[str, str] = {"WarmRequest": "ServerRequest"}

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, eagerly
    from exl3tool.cache.identity import server_identities
    from exl3tool.cache.key import CacheKey
    from exl3tool.cache.store import CacheStore
    from exl3tool.checkpoint.plan import plan_layers
    from exl3tool.checkpoint.source import open_checkpoint
    from exl3tool.encode.online import encode_linear
    from exl3tool.format.decode import dequantize
    from exl3tool.format.encoded import EncodedLinear
    from exl3tool.launch.load import load_launch
    from exl3tool.launch.request import apply_launch
    from exl3tool.launch.resolve import resolve_launch
    from exl3tool.operations.check import check
    from exl3tool.operations.hydrate import hydrate, plan_hydrate
    from exl3tool.operations.verify import verify_plan
    from exl3tool.operations.warm.run import warm
    from exl3tool.plan.request import ServerRequest, prepare


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562) and keep the name here."""
    if name in _RENAMED:
        return __getattr__(_RENAMED[name])
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'exl3tool' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
