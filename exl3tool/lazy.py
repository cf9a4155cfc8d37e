"""Packages whose names load on first use (PEP 562), so that importing a package, or one light module of it (the
CLI's option tables read ``cache.settings`` and ``plan.request``), does not import torch through its siblings.

A package lists, per submodule, the names it re-exports::

    __getattr__, __dir__ = lazy_exports(__name__, {"exl3tool.cache.entry": ("write_entry", ...), ...})
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]) -> tuple[Callable[[str], Any],
                                                                               Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: each name of ``exports`` imported from its submodule on
    first use and then kept on the package, as an eager ``from submodule import name`` would have."""
    where = {name: module for module, names in exports.items() for name in names}
    sys.modules[package].__class__ = _Package
    sys.modules[package].__dict__["_lazy_exports"] = where

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__


class _Package(types.ModuleType):
    """A lazy package. When a submodule shares the name of a name the package exports from it (``cache.scan``,
    the module, and ``scan``, its function), the import system's ``setattr(package, "scan", module)`` keeps the
    function instead, as an eager ``from exl3tool.cache.scan import scan`` in the package left it."""

    def __setattr__(self, name: str, value: Any) -> None:
        module = self.__dict__.get("_lazy_exports", {}).get(name)
        if isinstance(value, types.ModuleType) and value.__name__ == module == f"{self.__name__}.{name}":
            value = getattr(value, name)
        super().__setattr__(name, value)
