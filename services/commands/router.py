"""`pdmesh router`: the OpenAI front door that pairs prefill and decode workers."""

from __future__ import annotations

import argparse
import logging
import os
import sys

HELP = "Run the router in front of prefill, decode and mixed workers."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from services.router.config import add_arguments as add_router_arguments

    add_router_arguments(parser)
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def run(args: argparse.Namespace) -> int:
    from services.common.runner import run_service
    from services.common.tls import exposure_warning
    from services.router.app import create_app
    from services.router.config import RouterConfig

    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = RouterConfig.from_args(args, os.environ)  # TLS files are loaded (checked) here
    except ValueError as exc:
        print(f"pdmesh router: {exc}", file=sys.stderr)
        return 2
    exposure_warning("the router", config.host, config.port, config.tls.enabled)
    return run_service(create_app(config), config.host, config.port, config.drain_grace_s,
                       config.tls.server_context())
