"""docs/request-path.md stays true: every `module:symbol` it names imports and resolves."""

from __future__ import annotations

import importlib
import re
from functools import reduce
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "request-path.md"
# `package.module:Name` or `package.module:Name.attribute`, in backticks.
REFERENCE = re.compile(r"`((?:services|shared|kernels)(?:\.\w+)+):(\w+(?:\.\w+)*)`")


def references() -> list[tuple[str, str]]:
    return sorted(set(REFERENCE.findall(DOC.read_text())))


def test_the_doc_names_the_whole_path() -> None:
    modules = {module.split(".")[1] for module, _ in references()}
    assert {"router", "worker", "kv_transfer", "engine"} <= modules, modules


@pytest.mark.parametrize(("module", "symbol"), references(), ids=lambda v: str(v))
def test_reference_resolves(module: str, symbol: str) -> None:
    target = reduce(getattr, symbol.split("."), importlib.import_module(module))
    assert callable(target) or isinstance(target, str), f"{module}:{symbol} is {target!r}"
