"""The router and `pdmesh up`'s supervisor never load torch.

Neither runs a model, but both are `pdmesh` commands, and the CLI builds every command's parser
(serve's included) before it parses. One top-level import of the model loader under the worker's
config once put torch (~190 MB of RSS, ~2 s of start-up) into each of them. Each check runs in a
fresh interpreter, so what the test process has already imported does not hide a regression.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy", "transformers", "safetensors", "gguf")


def heavy_modules_after(code: str) -> list[str]:
    """The HEAVY modules a fresh interpreter holds after running `code`."""
    probe = (f"{code}\nimport json, sys\n"
             f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return list(json.loads(out.strip().splitlines()[-1]))


def test_the_router_command_and_its_app_load_no_model_library() -> None:
    code = """
from services.cli import build_parser
from services.router.app import create_app
from services.router.config import RouterConfig
args = build_parser().parse_args(["router", "--prefill", "http://127.0.0.1:1",
                                  "--decode", "http://127.0.0.1:2"])
import os
create_app(RouterConfig.from_args(args, os.environ))
"""
    assert heavy_modules_after(code) == []


def test_up_plans_its_mesh_without_loading_a_model_library() -> None:
    # plan() checks the worker flags through WorkerConfig.from_args (the preflight) before any
    # child starts: the supervisor that stays alive for the mesh's lifetime must stay light.
    code = """
from services.cli import build_parser
from services.commands.up import plan
args = build_parser().parse_args(["up", "--port", "18000"])
specs, url = plan(args, 2)
assert len(specs) == 3 and url.endswith(":18000"), (specs, url)
"""
    assert heavy_modules_after(code) == []
