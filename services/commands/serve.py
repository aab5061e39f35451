"""`pdmesh serve`: run one worker (an OpenAI-compatible server around one engine)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

HELP = ("Serve a model over an OpenAI-compatible HTTP API (one worker: mixed, or the "
        "prefill/decode side of a disaggregated mesh with its KV-transfer service).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from services.worker.config import add_arguments as add_worker_arguments

    add_worker_arguments(parser)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def run(args: argparse.Namespace) -> int:
    from services.common.runner import run_service
    from services.common.tls import exposure_warning
    from services.worker.app import create_app
    from services.worker.config import WorkerConfig

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = WorkerConfig.from_args(args, os.environ)  # TLS files are loaded (checked) here
    except ValueError as exc:
        print(f"pdmesh serve: {exc}", file=sys.stderr)
        return 2
    exposure_warning("the worker's HTTP API", config.host, config.port, config.tls.enabled)
    return run_service(create_app(config), config.host, config.port, config.drain_grace_seconds,
                       config.tls.server_context())
