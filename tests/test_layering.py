"""Imports only go down: every module of exl3tool imports only from its own package or packages above it in the
layer list of docs/architecture.md, and the packages import each other without a cycle.

Every import counts, also one inside a function or under ``TYPE_CHECKING``: a lazy import still ties the layers.
The package root (``exl3tool/__init__.py``, the lazy public API) is the facade on top: it imports every layer, and no
module of the package imports it (``from exl3tool import __version__`` would point up: the version lives in
``exl3tool.version``, on the ground floor).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "exl3tool"

# docs/architecture.md's list, top first: a unit imports only from units of its own layer or above. ``exl3tool``
# (the package root, imported as ``from exl3tool import x`` or ``import exl3tool``) is the last: nothing imports it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "jsontext", "timing", "text", "knobs", "releases", "lazy", "version"),
    ("format",),
    ("kernels",),
    ("encode",),
    ("cache", "checkpoint"),
    ("plan",),
    ("launch",),
    ("operations", "serving"),
    ("cli", "__main__"),
    ("exl3tool",),
)
LEVEL = {unit: i for i, units in enumerate(LAYERS) for unit in units}
FACADE = PACKAGE / "__init__.py"


def _unit(module: str) -> str:
    """The layer unit of a dotted module name: its first package under exl3tool (``exl3tool`` for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "exl3tool"


def _module_name(path: Path, root: Path = PACKAGE) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, module) of every exl3tool import in ``path`` (a module of the package at ``root``), relative ones
    resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    here = _module_name(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "exl3tool"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "exl3tool":
                continue
            if module == "exl3tool":  # `from exl3tool import x`: x may be a package (a layer of its own)
                found += [(node.lineno, f"exl3tool.{a.name}" if (root / a.name).is_dir()
                           or (root / f"{a.name}.py").exists() else "exl3tool") for a in node.names]
            else:
                found.append((node.lineno, module))
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_unit_has_a_layer():
    units = {_unit(_module_name(p)) for p in MODULES}
    assert units <= set(LEVEL), f"add these to LAYERS (and docs/architecture.md): {sorted(units - set(LEVEL))}"


@pytest.mark.parametrize("path", [p for p in MODULES if p != FACADE], ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_only_go_down(path):
    mine = _unit(_module_name(path))
    upward = [f"line {line}: {module} ({_unit(module)}, layer {LEVEL[_unit(module)] + 1})"
              for line, module in _imports(path) if LEVEL.get(_unit(module), 0) > LEVEL[mine]]
    assert not upward, f"{path.name} ({mine}, layer {LEVEL[mine] + 1}) imports from below: {upward}"


def test_packages_import_each_other_without_a_cycle():
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        if path == FACADE:
            continue
        mine = _unit(_module_name(path))
        graph.setdefault(mine, set()).update(u for _, m in _imports(path) if (u := _unit(m)) != mine)
    state: dict[str, int] = {}

    def visit(unit: str, trail: list[str]) -> None:
        state[unit] = 1
        for nxt in sorted(graph.get(unit, ())):
            if state.get(nxt) == 1:
                raise AssertionError("package import cycle: " + " -> ".join(trail[trail.index(nxt):] + [nxt])
                                     if nxt in trail else f"{unit} -> {nxt}")
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[unit] = 2

    for unit in sorted(graph):
        if unit not in state:
            visit(unit, [unit])


def test_the_check_sees_an_upward_import(tmp_path):
    """The parser finds a lazy relative import, a lazy absolute one and one of the package root going up (so the
    rule above can fail)."""
    probe = tmp_path / "exl3tool" / "format" / "probe.py"
    probe.parent.mkdir(parents=True)
    (tmp_path / "exl3tool" / "cli").mkdir()
    probe.write_text("def f():\n    from ..cli import output\n    import exl3tool.plan.request\n"
                     "    from exl3tool import cli, __version__\n")
    found = [m for _, m in _imports(probe, tmp_path / "exl3tool")]
    assert found == ["exl3tool.cli", "exl3tool.plan.request", "exl3tool.cli", "exl3tool"]
    # `from exl3tool import __version__` points up too: the package root is above every layer
    assert [LEVEL[_unit(m)] > LEVEL["format"] for m in found] == [True, True, True, True]


COMMANDS = PACKAGE / "cli" / "commands"


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (node -> nodes it imports) as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return trail[trail.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, trail + [nxt])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def _command_graph(commands: Path = COMMANDS, root: Path = PACKAGE) -> dict[str, set[str]]:
    """Which command module imports which (lazy imports included; ``commands/__init__`` registers them all by name,
    so it is left out): ``{"encode": {"cache", "options", ...}}``."""
    package = "exl3tool.cli.commands"
    names = {path.stem for path in commands.glob("*.py")} - {"__init__"}
    graph = {}
    for path in sorted(commands.glob("*.py")):
        if path.stem not in names:
            continue
        found = {m.removeprefix(package + ".").split(".")[0] for _, m in _imports(path, root)
                 if m.startswith(package + ".")}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):  # `from exl3tool.cli.commands import x`
            if isinstance(node, ast.ImportFrom) and (node.module == package or (node.level == 1 and not node.module)):
                found |= {a.name for a in node.names if a.name in names}
        graph[path.stem] = found - {path.stem}
    return graph


def test_command_modules_import_each_other_without_a_cycle():
    """Each command module registers its own commands; shared options and views sit in modules of their own, so
    no command module needs another's import to finish first (issue 37: encode, check and cache formed a circle)."""
    graph = _command_graph()
    assert {"warm", "check", "cache", "verify", "options"} <= set(graph)
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))


def test_the_command_cycle_check_sees_a_lazy_circle(tmp_path):
    commands = tmp_path / "exl3tool" / "cli" / "commands"
    commands.mkdir(parents=True)
    (commands / "a.py").write_text("from exl3tool.cli.commands.b import x\n")
    (commands / "b.py").write_text("def f():\n    from exl3tool.cli.commands import c\n")
    (commands / "c.py").write_text("def g():\n    from .a import y\n")
    graph = _command_graph(commands, tmp_path / "exl3tool")
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]


def test_modules_import_each_other_without_a_cycle():
    """No circle of modules, lazy and type-only imports included (issue 51: ``plan``, ``shards`` and ``sharing``
    imported each other around ``LookupJob``, which now stands alone in ``plan/job.py``)."""
    graph = {_module_name(path): {m for _, m in _imports(path)} for path in MODULES if path != FACADE}
    names = set(graph)
    graph = {name: {m if m in names else m.rsplit(".", 1)[0] for m in found} & names - {name}
             for name, found in graph.items()}
    cycle = _find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)
