"""shared/protocol is a leaf: it imports the standard library, msgpack and itself, nothing else.

Each module is imported in a fresh interpreter (so nothing a test already imported hides a
dependency), and the modules it pulled in are compared with what a leaf may load. Only the
tensor codec (tensors.py) may bring torch and xxhash.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = sorted(p.stem for p in (ROOT / "shared" / "protocol").glob("*.py")
                  if p.stem != "__init__")
FORBIDDEN = ("torch", "xxhash", "shared.model", "shared.engine", "shared.pipeline", "shared.config",
             "services", "kernels")
TENSOR_CODEC_MAY_LOAD = ("torch", "xxhash")

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(sys.modules)))
"""


def modules_loaded_by(module: str) -> set[str]:
    """The names in sys.modules after importing `module` in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", PROBE, module], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return set(json.loads(out))


def offending(loaded: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden))


def test_every_protocol_module_is_probed() -> None:
    assert {"codec", "compat", "messages", "tensors"} <= set(PROTOCOL)


@pytest.mark.parametrize("name", PROTOCOL)
def test_protocol_module_is_a_leaf(name: str) -> None:
    forbidden = tuple(f for f in FORBIDDEN if name != "tensors" or f not in TENSOR_CODEC_MAY_LOAD)
    loaded = modules_loaded_by(f"shared.protocol.{name}")
    assert f"shared.protocol.{name}" in loaded  # the probe imported what it says
    assert offending(loaded, forbidden) == []


def test_the_probe_sees_a_heavy_import() -> None:
    """The check can fail: a module that does import torch is caught."""
    assert "torch" in offending(modules_loaded_by("shared.engine.runner"), FORBIDDEN)
