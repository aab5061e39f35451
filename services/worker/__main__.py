"""`python -m services.worker ...`: the same as `pdmesh serve ...`."""

from __future__ import annotations

import argparse
import sys

from services.commands import serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.worker", description=serve.HELP)
    serve.add_arguments(parser)
    return serve.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
