"""`python -m services.router ...`: the same as `pdmesh router ...`."""

from __future__ import annotations

import argparse
import sys

from services.commands import router


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.router", description=router.HELP)
    router.add_arguments(parser)
    return router.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
