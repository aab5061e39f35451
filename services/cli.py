"""The `pdmesh` console script: one subcommand per module under `services.commands`.

Each command module defines `HELP: str`, `add_arguments(parser)` and `run(args) -> int`.
Modules are imported lazily so `pdmesh doctor` works even when torch is broken.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

COMMANDS: dict[str, str] = {
    "generate": "services.commands.generate",
    "doctor": "services.commands.doctor",
    "make-model": "services.commands.make_model",
    "serve": "services.commands.serve",
    "router": "services.commands.router",
    "up": "services.commands.up",
    "bench": "services.commands.bench",
    "quantize": "services.commands.quantize",
    "kernels": "services.commands.kernels",
}


def _available() -> dict[str, str]:
    return {name: mod for name, mod in COMMANDS.items() if importlib.util.find_spec(mod) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdmesh", description="Disaggregated LLM-serving mesh.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, modname in _available().items():
        module = importlib.import_module(modname)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
