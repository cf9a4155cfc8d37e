"""The package root's public API: about fifteen names, imported on first use, each documented."""

from __future__ import annotations

import inspect
import subprocess
import sys

import exl3tool


def test_import_is_light_and_names_load_on_use():
    """``import exl3tool`` pulls in no torch (the CLI's start depends on it); using a name imports its module."""
    code = ("import sys, exl3tool; assert 'torch' not in sys.modules, 'torch at import'; "
            "exl3tool.ServerRequest; assert 'exl3tool.plan.request' in sys.modules; print(exl3tool.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == exl3tool.__version__


def test_every_public_name_resolves_to_its_definition_with_docs():
    names = [n for n in exl3tool.__all__ if n != "__version__"]
    assert 12 <= len(names) <= 20, names
    for name in names:
        value = getattr(exl3tool, name)
        assert value.__name__ == name and value.__module__ == exl3tool._API[name], name
        doc = inspect.getdoc(value) or ""
        assert doc, f"{name} has no docstring"
        if inspect.isfunction(value):
            assert "Args:" in doc and "Returns:" in doc, f"{name}: docstring without Args/Returns"
    assert set(dir(exl3tool)) >= set(names)


def test_an_unknown_name_is_an_attribute_error():
    try:
        exl3tool.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("exl3tool.no_such_name resolved")


def test_py_typed_ships():
    from pathlib import Path

    assert (Path(exl3tool.__file__).parent / "py.typed").is_file()
    # with the published images' table (data the launch reads, docs/images.md)
    assert 'exl3tool = ["py.typed", "launch/images.json"]' in (
        Path(exl3tool.__file__).parents[1] / "pyproject.toml").read_text()
    assert (Path(exl3tool.__file__).parent / "launch" / "images.json").is_file()
