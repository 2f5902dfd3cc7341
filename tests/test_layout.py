"""The package's layout holds: imports point downward through its layers, no module imports itself back, and no
module or class outgrows what one reader can hold (the exceptions are named in docs/development.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "early_exit_router"
# Lowest first: a module may import from its own layer and the ones before it.
LAYERS = ["_version", "config_checks", "config", "data", "models", "heads", "routing", "decode", "integrations",
          "api", "bench", "training", "cli", "__init__"]  # fmt: skip
MAX_MODULE_LINES = 500  # every module, the public facade's included
MAX_CLASS_LINES = 300
# The public facade's class, larger on purpose (every method is public API with its contract): see docs/development.md.
LARGER = {"api.py": "EarlyExitRouter"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def imports() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports (lazily inside functions too)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        found = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("early_exit_router"):
                found.add(node.module)
                for alias in node.names:  # `from package import module`
                    candidate = f"{node.module}.{alias.name}"
                    if (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists():
                        found.add(candidate)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("early_exit_router"))
        found.discard(name)
        if path.name == "__init__.py":  # a package's __init__ may gather its own submodules
            found -= {m for m in found if m.startswith(name + ".")}
    return graph


def test_every_import_points_to_the_same_or_a_lower_layer():
    upward = [
        (module, target)
        for module, targets in imports().items()
        for target in targets
        if LAYERS.index(layer(target)) > LAYERS.index(layer(module))
    ]
    assert not upward, f"imports from a lower layer to a higher one: {sorted(upward)}"


def test_no_import_circle():
    graph = imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                raise AssertionError(f"import circle: {' -> '.join(path[path.index(target) :] + [target])}")
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_no_module_is_over_500_lines():
    too_long = [
        f"{path.relative_to(PACKAGE)}: {lines} lines"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not too_long, too_long


def test_classes_stay_readable():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        larger = LARGER.get(str(path.relative_to(PACKAGE)))
        for node in ast.walk(ast.parse(text)):
            size = node.end_lineno - node.lineno + 1 if isinstance(node, ast.ClassDef) else 0
            if size > MAX_CLASS_LINES and larger != node.name:
                too_long.append(f"{path.relative_to(PACKAGE)}: class {node.name} {size} lines")
    assert not too_long, too_long


def test_the_decode_core_is_the_only_decode_loop():
    """One implementation of each decode operation: nothing outside decode/ fills layers, verifies or stops."""
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "decode":
            continue
        text = path.read_text()
        for marker in ("def deep_pass", "def accept_greedy", "def accept_sampled", "def ends_generation", "def flush("):
            assert marker not in text, f"{path.relative_to(PACKAGE)} defines {marker} outside decode/"
