"""The training loop's modules (``loop``, ``batch_size``, ``train/``) sit in no import cycle, at module level or
inside functions (a ``TYPE_CHECKING`` import is for type checkers only), and import no other module's private
names."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "training_core"
LOOP_MODULES = ("training_core.loop", "training_core.batch_size", "training_core.train")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> list[tuple[str, str]]:
    """``(module, name)`` of every import of the package's own modules in ``path``, outside ``TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name in modules]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("training_core"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.append((submodule, "") if submodule in modules else (node.module, alias.name))
    return found


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph, private = {}, []
    for name, path in paths.items():
        imports = _imports(path, set(paths))
        graph[name] = {module for module, _ in imports if module in paths and module != name}
        private += [f"{name} imports {module}.{item}" for module, item in imports if item.startswith("_") and item]
    return graph, private


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for module in graph.get(todo.pop(), ()):
            if module not in seen:
                seen.add(module)
                todo.append(module)
    return seen


def test_the_loops_modules_are_in_no_import_cycle_and_import_no_private_names():
    graph, private = _graph()
    loop_modules = [name for name in graph if name.startswith(LOOP_MODULES)]
    assert "training_core.train.step" in loop_modules
    in_cycles = [name for name in loop_modules if name in _reaches(graph, name)]
    assert in_cycles == []
    assert [line for line in private if line.startswith(LOOP_MODULES)] == []
