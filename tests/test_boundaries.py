"""The seams hold: services reach the engine only through its public, typed surface.

Parsed, not imported (ast), so the check is cheap and sees every module. The rules:
- no module under services/ touches an engine's `scheduler`, imports the engine's
  `RequestStatus`, or reaches a private (underscore) name that another module defines;
- the worker never touches the KV service's internal context (`ctx`);
- nothing under services/ or shared/ has `call_in_engine` or an `engine: Any` parameter.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVICES = sorted((ROOT / "services").rglob("*.py"))
SHARED = sorted((ROOT / "shared").rglob("*.py"))


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _where(path: Path | str, node: ast.AST) -> str:
    name = path.relative_to(ROOT) if isinstance(path, Path) else path
    return f"{name}:{getattr(node, 'lineno', '?')}"


def _own_names(tree: ast.Module) -> set[str]:
    """Names this module defines itself (functions, classes, stored attributes, keywords):
    its own privates are its business."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)  # module globals and dataclass fields
        elif isinstance(node, ast.keyword) and node.arg is not None:
            own.add(node.arg)
    return own


def _private_accesses(tree: ast.Module) -> Iterator[ast.Attribute]:
    """`x._name` of a private name another module defines (dunders are public)."""
    own = _own_names(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not (node.attr.startswith("__") and node.attr.endswith("__"))
                and node.attr not in own):
            yield node


def _violations(path: Path | str, tree: ast.Module) -> list[str]:
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "scheduler":
            found.append(f"{_where(path, node)}: touches an engine's scheduler")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shared."):
            for alias in node.names:
                if alias.name == "RequestStatus":
                    found.append(f"{_where(path, node)}: imports the engine's RequestStatus")
                if alias.name.startswith("_"):
                    found.append(f"{_where(path, node)}: imports private {alias.name}")
    found += [f"{_where(path, n)}: private attribute {n.attr}" for n in _private_accesses(tree)]
    return found


@pytest.mark.parametrize("path", SERVICES, ids=lambda p: str(p.relative_to(ROOT)))
def test_services_use_only_public_engine_surface(path: Path) -> None:
    assert _violations(path, _parse(path)) == []


def test_worker_never_reaches_into_the_kv_service() -> None:
    found = [_where(path, node) for path in SERVICES if "worker" in path.parts
             for node in ast.walk(_parse(path))
             if isinstance(node, ast.Attribute) and node.attr == "ctx"]
    assert found == []


def _untyped_engine_params(tree: ast.Module) -> Iterator[ast.arg]:
    for node in ast.walk(tree):
        if (isinstance(node, ast.arg) and node.arg == "engine" and node.annotation is not None
                and ast.unparse(node.annotation) in ("Any", "typing.Any", "'Any'")):
            yield node


@pytest.mark.parametrize("path", SERVICES + SHARED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_untyped_engine_escape_hatch(path: Path) -> None:
    assert "call_in_engine" not in path.read_text()
    assert [_where(path, a) for a in _untyped_engine_params(_parse(path))] == []


def test_the_checks_catch_what_they_forbid() -> None:
    """The rules fire on a module that breaks each of them (so a pass means something)."""
    tree = ast.parse("from shared.engine.request import RequestStatus, _hidden\n"
                     "def f(engine: Any, svc):\n"
                     "    engine.scheduler.requests\n"
                     "    self._fine = svc._fine\n"
                     "    return svc._private, x.__name__, f._own\n"
                     "def _own(): ...\n")
    found = _violations("probe.py", tree)
    assert [f.split(": ", 1)[1] for f in found] == [
        "imports the engine's RequestStatus", "imports private _hidden",
        "touches an engine's scheduler", "private attribute _private"]
    assert [a.arg for a in _untyped_engine_params(tree)] == ["engine"]
