"""No import cycle among the modules of shared/.

The graph is read from the source (AST), not from a running interpreter, so it also sees the
imports inside functions: a cycle hidden behind a lazy import still makes the two modules
depend on each other. Imports under `if TYPE_CHECKING:` are left out (they never run). An edge
goes to the module itself, not to its parent packages: `from shared.engine.engine import X`
depends on shared.engine.engine; `from shared.model import llama` on shared.model.llama.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "shared"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run (anywhere but an `if TYPE_CHECKING:` body)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the modules it imports, for the modules under shared/ (edges leaving shared/
    dropped)."""
    files = {module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: climb from this module's package
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                           for a in node.names]
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def test_the_graph_sees_known_edges() -> None:
    """The reader itself works: edges that exist in the source are found (incl. lazy ones)."""
    graph = import_graph()
    assert "shared.model.llama" in graph["shared.model.loader"]
    assert "shared.model.loader" in graph["shared.engine.engine"]  # inside from_config
    assert "shared.engine.engine" not in graph["shared.engine"]  # TYPE_CHECKING only


def test_a_cycle_is_reported() -> None:
    """The check fails on a cycle, lazy or not (a planted one, on a copy of the graph)."""
    graph = import_graph()
    graph["shared.model.llama"].add("shared.model.loader")
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        assert {"shared.model.llama", "shared.model.loader"} <= set(e.args[1])
    else:
        raise AssertionError("a planted cycle went unnoticed")


def test_no_import_cycle_in_shared() -> None:
    try:
        TopologicalSorter(import_graph()).prepare()
    except CycleError as e:
        raise AssertionError("import cycle among shared/ modules: "
                             + " -> ".join(e.args[1])) from None
