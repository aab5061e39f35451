"""A stand-in for `pdmesh serve` (same flags) that runs a fake worker, for `pdmesh up` tests and
benchmarks/router.py: `python -m tests.support.fake_serve ...` from the repository root."""

from __future__ import annotations

import argparse
import os

from aiohttp import web

from tests.support.fake_worker import FakeWorker


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--model", "--role", "--transfer-mode", "--host", "--log-level", "--core-share"):
        parser.add_argument(flag)
    for flag in ("--port", "--kv-port", "--threads"):
        parser.add_argument(flag, type=int)
    parser.add_argument("--fake-token-delay", type=float, default=0.0,
                        help="seconds between streamed tokens (benchmarks)")
    args = parser.parse_args()
    worker = FakeWorker(args.role, transfer_mode=args.transfer_mode, model=args.model,
                        token_delay=args.fake_token_delay)
    print(f"fake {args.role} worker on {args.host}:{args.port} (pid {os.getpid()})", flush=True)
    web.run_app(worker.app(), host=args.host, port=args.port, print=None,
                handler_cancellation=True)


if __name__ == "__main__":
    main()
