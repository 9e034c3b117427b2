"""``training_core``'s modules sit in no import cycle, at module level or inside functions (a ``TYPE_CHECKING``
import is for type checkers only), and none imports another module's private (``_name``) names."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "training_core"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module ``node`` imports from, resolving ``from .x import y`` against ``importer``."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_only(tree: ast.AST) -> set[int]:
    return {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }


def _imports(path: Path, modules: set[str]) -> list[tuple[str, str]]:
    """``(module, name)`` of every import of the package's own modules in ``path``, outside ``TYPE_CHECKING``
    (``name`` is ``""`` where a module itself is imported), plus ``(module, attribute)`` for each ``_attribute``
    read off an imported module."""
    importer, tree = _module_name(path), ast.parse(path.read_text())
    type_only = _type_only(tree)
    found, aliases = [], {}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.append((alias.name, ""))
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, importer, path.name == "__init__.py")
            if source.split(".")[0] != "training_core":
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    found.append((submodule, ""))
                    aliases[alias.asname or alias.name] = submodule
                else:
                    found.append((source, alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)
            if owner in aliases:
                found.append((aliases[owner], node.attr))
    return found


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph, private = {}, []
    for name, path in paths.items():
        imports = _imports(path, set(paths))
        graph[name] = {module for module, _ in imports if module in paths and module != name}
        private += [f"{name} imports {module}.{item}" for module, item in imports if item.startswith("_")]
    return graph, private


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str]:
    """A shortest import path from ``start`` back to itself, or ``[]``."""
    paths, todo = {start: [start]}, [start]
    while todo:
        current = todo.pop(0)
        for module in sorted(graph.get(current, ())):
            if module == start:
                return [*paths[current], start]
            if module not in paths:
                paths[module] = [*paths[current], module]
                todo.append(module)
    return []


def _canonical(cycle: list[str]) -> str:
    """``cycle`` (first module repeated last) as it reads from its smallest module: one cycle, one string."""
    ring = cycle[:-1]
    start = ring.index(min(ring))
    ring = ring[start:] + ring[:start]
    return " -> ".join([*ring, ring[0]])


def test_the_walk_sees_function_level_imports_and_skips_type_checking_ones():
    graph, _ = _graph()
    assert "training_core.train.step" in graph
    assert "training_core.config" in graph["training_core.data"]
    assert len(graph) > 40


def test_no_module_of_training_core_is_in_an_import_cycle():
    graph, _ = _graph()
    cycles = {_canonical(cycle) for name in graph if (cycle := _cycle_through(graph, name))}
    assert sorted(cycles) == []


def test_no_module_of_training_core_imports_another_modules_private_names():
    _, private = _graph()
    assert sorted(set(private)) == []


MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS_PENDING: dict[str, str] = {}
"""Functions allowed over :data:`MAX_FUNCTION_LINES` lines for now, each with why; none may be added, and an entry
whose function was split must go."""


def _long_functions() -> dict[str, int]:
    """``module.qualified.name`` -> length in lines (from ``def`` to its last line) of every function, method and
    nested function of ``training_core`` over :data:`MAX_FUNCTION_LINES`."""
    found: dict[str, int] = {}

    def walk(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = f"{scope}.{getattr(child, 'name', '')}"
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (lines := child.end_lineno - child.lineno + 1) > MAX_FUNCTION_LINES:
                    found[name] = lines
            walk(child, name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else scope)

    for path in PACKAGE.rglob("*.py"):
        walk(ast.parse(path.read_text()), _module_name(path))
    return found


def test_no_function_of_training_core_is_over_60_lines():
    """Small functions with one job: a longer one is split (the developers' guide)."""
    found = _long_functions()
    assert {name: lines for name, lines in found.items() if name not in LONG_FUNCTIONS_PENDING} == {}
    assert sorted(set(LONG_FUNCTIONS_PENDING) - set(found)) == [], "split since: remove from LONG_FUNCTIONS_PENDING"
