"""Load: many concurrent streaming clients through the router, past its admission limits.

The mesh (benchmarks/chaos_mesh.py: one router, two prefills, two decodes) runs the router with
`--max-inflight` and `--max-queue`; `--clients` streaming completions start at once. Past the
limits the router must answer 429 with `Retry-After` at once, never time out and never 500.
Clients retry a 429 after its Retry-After up to `--retries` times.

Reported: answers by status, 429s without Retry-After, hung and broken streams, TTFT and
inter-token latency p50/p99 of the completed streams, and the router's CPU seconds per request
(/proc/<pid>/stat user + system over the run, divided by the requests it answered).

    .venv/bin/python benchmarks/load.py                      # 256 clients, embedded model
    .venv/bin/python benchmarks/load.py --clients 64 --max-inflight 8 --max-queue 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import procstat
from chaos import machine
from chaos_mesh import Mesh, MeshSpec
from chaos_traffic import Kind, Outcome, completion_body, stream_request, summary

PROMPT = "Write a short story about a lighthouse keeper who"


@dataclass(frozen=True)
class LoadConfig:
    clients: int = 256
    max_tokens: int = 16
    max_inflight: int = 32
    max_queue: int = 64
    queue_timeout_s: float = 120.0
    retries: int = 0
    hard_timeout_s: float = 300.0


async def _client(session: aiohttp.ClientSession, url: str, i: int, cfg: LoadConfig,
                  attempts: list[Outcome]) -> None:
    body = completion_body(f"{i}: {PROMPT}", cfg.max_tokens)
    for _ in range(cfg.retries + 1):
        out = await stream_request(session, url, body, cfg.hard_timeout_s)
        attempts.append(out)
        if out.status != 429:
            return
        await asyncio.sleep(float(out.retry_after or 1))


async def run(spec: MeshSpec, cfg: LoadConfig, log_dir: Path) -> dict[str, Any]:
    async with Mesh(spec, log_dir) as mesh:
        assert mesh.router is not None and mesh.router.pid is not None
        connector = aiohttp.TCPConnector(limit=0)  # every client its own connection
        async with aiohttp.ClientSession(connector=connector) as session:
            url = mesh.url + "/v1/completions"
            before = procstat.sample(mesh.router.pid)
            start = time.monotonic()
            attempts: list[Outcome] = []
            await asyncio.gather(*(_client(session, url, i, cfg, attempts)
                                   for i in range(cfg.clients)))
            wall = time.monotonic() - start
            after = procstat.sample(mesh.router.pid)
            blocks, _ = await mesh.wait_blocks_freed(session, 2 * spec.lease_s + 10)
    assert before is not None and after is not None
    statuses = Counter(str(o.status) for o in attempts)
    return {
        **summary(attempts), "wall_s": round(wall, 1), "statuses": dict(statuses),
        "429_without_retry_after": sum(o.status == 429 and not o.retry_after for o in attempts),
        "status_500": sum(o.status is not None and o.status >= 500 and o.status != 503
                          for o in attempts),
        "router_cpu_ms_per_request": round((after.cpu_s - before.cpu_s) / len(attempts) * 1000,
                                           2),
        "router_cpu_ms_per_completed": round((after.cpu_s - before.cpu_s) * 1000 / max(
            1, sum(o.kind is Kind.COMPLETED for o in attempts)), 2),
        "blocks_after": blocks,
    }


def verdict(result: dict[str, Any]) -> list[str]:
    """The load goals this run missed (empty: all held)."""
    missed = []
    if result["hung"]:
        missed.append(f"{result['hung']} streams hung")
    if result["status_500"]:
        missed.append(f"{result['status_500']} answers with a 5xx other than 503")
    if result["429_without_retry_after"]:
        missed.append(f"{result['429_without_retry_after']} 429s without Retry-After")
    if result[Kind.BROKEN.value]:
        missed.append(f"{result[Kind.BROKEN.value]} streams broken without an error event")
    if any(result["blocks_after"].values()):
        missed.append(f"KV blocks held afterwards: {result['blocks_after']}")
    return missed


def main(argv: list[str] | None = None) -> int:
    d = LoadConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--clients", type=int, default=d.clients)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--max-inflight", type=int, default=d.max_inflight)
    p.add_argument("--max-queue", type=int, default=d.max_queue)
    p.add_argument("--queue-timeout", type=float, default=d.queue_timeout_s)
    p.add_argument("--retries", type=int, default=d.retries,
                   help="retries of a 429, each after its Retry-After")
    p.add_argument("--hard-timeout", type=float, default=d.hard_timeout_s)
    p.add_argument("--log-dir", type=Path, default=None)
    args = p.parse_args(argv)
    cfg = LoadConfig(args.clients, args.max_tokens, args.max_inflight, args.max_queue,
                     args.queue_timeout, args.retries, args.hard_timeout)
    spec = MeshSpec(args.model, dtype=args.dtype, proxy_first_prefill=False, router_flags=(
        "--max-inflight", str(cfg.max_inflight), "--max-queue", str(cfg.max_queue),
        "--queue-timeout", str(cfg.queue_timeout_s)))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdmesh-load-"))
    result = asyncio.run(run(spec, cfg, log_dir))
    result["missed"] = verdict(result)
    print(json.dumps(result, indent=2))
    print(f"{machine()}; logs in {log_dir}")
    return 1 if result["missed"] else 0


if __name__ == "__main__":
    sys.exit(main())
