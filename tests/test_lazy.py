"""Packages whose names load on first use (exl3tool.lazy): the same names as eager imports gave, and importing a
package imports none of its heavy modules."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAZY = ("exl3tool.cache", "exl3tool.plan", "exl3tool.checkpoint", "exl3tool.operations.warm")


@pytest.mark.parametrize("package", LAZY)
def test_every_exported_name_is_the_object_its_module_defines(package):
    pkg = importlib.import_module(package)
    for name in pkg.__all__:
        value = getattr(pkg, name)
        owner = getattr(value, "__module__", None)
        if owner and owner.startswith(package + "."):  # classes and functions: from the module the table names
            assert getattr(importlib.import_module(owner), name) is value, (package, name)
    assert set(pkg.__all__) <= set(dir(pkg))
    with pytest.raises(AttributeError):
        getattr(pkg, "no_such_name")


def test_a_submodule_named_like_its_function_leaves_the_function_on_the_package():
    """`cache.scan` is a module and `cache.scan` the package's function: importing the module keeps the function."""
    importlib.import_module("exl3tool.cache.scan")
    from exl3tool.cache import scan

    assert callable(scan) and not isinstance(scan, type(sys)) and scan.__module__ == "exl3tool.cache.scan"


def test_importing_the_packages_imports_no_torch():
    code = f"import json, sys; [__import__(p) for p in {list(LAZY)!r}]; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    modules = json.loads(out.stdout)
    assert "torch" not in modules and "numpy" not in modules


def test_importing_changes_nothing_in_the_process():
    """No import-time side effects (issue 44): importing the CPU Viterbi leaves numba's threading layer alone (it is
    chosen at the first launch), and the CLI's command classes leave Typer's classes unpatched."""
    code = """
import numba, typer.core
layer, help_type = numba.config.THREADING_LAYER, typer.core.TyperOption.display_type_rich
import exl3tool.kernels.viterbi_numba as v
import exl3tool.cli.commands.group
assert numba.config.THREADING_LAYER == layer, numba.config.THREADING_LAYER
assert typer.core.TyperOption.display_type_rich is help_type
v._threading_layer()  # what quantize_tiles_numba does before its first launch (no JIT compile here)
print(numba.config.THREADING_LAYER)
"""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**env, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["workqueue"]  # chosen before the first launch
