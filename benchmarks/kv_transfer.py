"""KV-transfer throughput: a 2,000-token SmolLM2-shaped KV between two KV services on loopback.

SmolLM2-135M geometry: 30 layers, 3 KV heads, head dim 64, bf16, block size 16, so one
request is 125 blocks of 360 KiB = 43.9 MiB. Raw loopback TCP (asyncio streams, 1 MiB
writes, the same byte count, the same process layout) is measured in the same run.

    .venv/bin/python benchmarks/kv_transfer.py [--layout in-process|two-process|both] [--iters 8]
                                               [--pd] [--pd-iters 2]

With `--pd`, the same run then measures P/D against a mixed worker on the real SmolLM2 (TTFT
and total latency in pull and push mode) and how much push overlaps the transfer with the
prompt's compute (benchmarks/kv_pd.py). The load average is printed next to every figure:
on a shared 2-core box the wall-clock rates swing with it.

"pull" is `fetch` end to end as a decode worker sees it: allocation, streaming 4 MiB chunks
into the cache, per-block digest verification (the handshake is cached after round 0, which
is not counted). "push" is `receive` while the prefill runs `send`: registration, chunked
writes, completion, verification. Everything runs on uvloop, as the workers do.

In-process, one event-loop thread does both sides' work, so its CPU time per transfer is also
reported, with the process's minor page faults per transfer (an exact count, independent of
the load: fresh multi-MiB buffers fault page by page; reused ones do not).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import uvloop
from aiohttp import web
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.kv_transfer.app import start_server  # noqa: E402
from services.kv_transfer.config import KVTransferConfig  # noqa: E402
from services.kv_transfer.service import KVTransferService  # noqa: E402
from services.kv_transfer.store import InMemoryBlockStore  # noqa: E402
from shared.protocol.compat import ModelKVSpec  # noqa: E402
from shared.protocol.messages import TokenLogprobWire  # noqa: E402
from shared.protocol.pd import KVTransferParams  # noqa: E402

TOKENS, BLOCK, LAYERS, KVH, HD = 2000, 16, 30, 3, 64
NBYTES = LAYERS * 2 * 125 * BLOCK * KVH * HD * 2
SPEC = ModelKVSpec("HuggingFaceTB/SmolLM2-135M-Instruct", "bench", "bfloat16", "bfloat16",
                   LAYERS, KVH, HD, ModelKVSpec.rope_items({"rope_theta": 100000.0}))
FIRST = TokenLogprobWire(token_id=1)
GIB = 1024**3


@dataclass
class Side:
    service: KVTransferService
    store: InMemoryBlockStore
    runner: web.AppRunner


async def side(role: str, mode: str, num_blocks: int) -> Side:
    store = InMemoryBlockStore(LAYERS, num_blocks, BLOCK, KVH, HD, torch.bfloat16)
    cfg = KVTransferConfig(role=role, mode=mode, port=0, lease_seconds=600.0,
                           push_deadline_seconds=60.0)
    service = KVTransferService(cfg, SPEC, store, CollectorRegistry())
    return Side(service, store, await start_server(cfg, service))


async def prefilled(p: Side, request_id: str) -> list[int]:
    """Play the prefill engine: random KV in fresh blocks, held for `request_id`."""
    ids = await p.store.allocate(TOKENS)
    assert ids is not None
    p.store.kv_cache[:, :, ids] = torch.randn(LAYERS, 2, len(ids), BLOCK, KVH, HD).bfloat16()
    p.store.hold(request_id, ids)
    return ids


@dataclass(frozen=True)
class Sample:
    gib_s: float  # wall-clock throughput
    cpu_ms: float  # CPU time of the event-loop thread during the transfer
    faults: int = 0  # minor page faults of this process during the transfer (load-independent)


def sample(nbytes: int, wall_s: float, cpu_s: float, faults: int = 0) -> Sample:
    return Sample(nbytes / wall_s / GIB, cpu_s * 1000, faults)


def minor_faults() -> int:
    """Page faults so far: fresh multi-MiB buffers fault page by page, reused ones do not."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


async def pull_once(d: Side, params: KVTransferParams, settle: list[Side]) -> Sample:
    cpu, faults = time.thread_time(), minor_faults()
    kv = await d.service.pull.decode.fetch(params)
    cpu, faults = time.thread_time() - cpu, minor_faults() - faults
    await d.store.free(kv.block_ids)
    for s in settle:  # the lease release goes out in the background
        await s.service.ctx.drain()
    return sample(kv.num_bytes, kv.seconds, cpu, faults)


async def push_once(p: Side, d: Side, i: int) -> Sample:
    ids = await prefilled(p, f"p{i}")
    cpu, faults = time.thread_time(), minor_faults()
    recv = asyncio.ensure_future(
        d.service.push.decode.receive(f"t{i}", p.service.identity.node.address, TOKENS))
    await p.service.push.prefill.send(f"t{i}", f"p{i}", ids, TOKENS, FIRST)
    kv = await recv
    cpu, faults = time.thread_time() - cpu, minor_faults() - faults
    await d.store.free(kv.block_ids)
    return sample(kv.num_bytes, kv.seconds, cpu, faults)


async def tcp_sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while await reader.read(1 << 20):
            pass
    finally:
        writer.close()


async def start_tcp_sink() -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(tcp_sink, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def raw_send(port: int) -> Sample:
    """Raw loopback TCP: the same byte count in 1 MiB writes, asyncio streams."""
    payload = memoryview(os.urandom(1 << 20))
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    start, cpu = time.perf_counter(), time.thread_time()
    for _ in range(NBYTES >> 20):
        writer.write(payload)
        await writer.drain()
    writer.close()
    await writer.wait_closed()
    return sample(NBYTES >> 20 << 20, time.perf_counter() - start, time.thread_time() - cpu)


async def in_process(iters: int) -> dict[str, list[Sample]]:
    """Raw TCP, pull and push rounds interleaved, so all three see the same machine load."""
    server, port = await start_tcp_sink()
    pp, pd = await side("prefill", "pull", 130), await side("decode", "pull", 130)
    sp, sd = await side("prefill", "push", 130), await side("decode", "push", 130)
    out: dict[str, list[Sample]] = {"raw TCP": [], "KV pull": [], "KV push": []}
    for i in range(iters + 1):  # round 0 includes handshakes and warm-up: not counted
        params = await pp.service.pull.prefill.offer(f"r{i}", await prefilled(pp, f"r{i}"), TOKENS, FIRST)
        round_ = {"raw TCP": await raw_send(port), "KV pull": await pull_once(pd, params, [pd, pp]),
                  "KV push": await push_once(sp, sd, i)}
        for name, value in round_.items():
            out[name] += [value] if i else []
    await asyncio.gather(*(s.runner.cleanup() for s in (pp, pd, sp, sd)))
    server.close()
    return out


async def serve_prefill(iters: int) -> None:
    """Child of the two-process layout: a TCP sink and a prefill with iters+1 leases."""
    _, port = await start_tcp_sink()
    print(port, flush=True)
    p = await side("prefill", "pull", 125 * (iters + 1) + 1)
    for i in range(iters + 1):
        params = await p.service.pull.prefill.offer(f"r{i}", await prefilled(p, f"r{i}"), TOKENS, FIRST)
        print(json.dumps(params.to_wire()), flush=True)
    await asyncio.Event().wait()


async def two_process(iters: int) -> dict[str, list[Sample]]:
    child = subprocess.Popen([sys.executable, __file__, "--serve-prefill", str(iters)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        params = [KVTransferParams.from_wire(json.loads(child.stdout.readline()))
                  for _ in range(iters + 1)]
        d = await side("decode", "pull", 130)
        out: dict[str, list[Sample]] = {"raw TCP": [], "KV pull": []}
        for i, one in enumerate(params):
            raw, pulled = await raw_send(port), await pull_once(d, one, [d])
            if i:
                out["raw TCP"].append(raw)
                out["KV pull"].append(pulled)
        await d.runner.cleanup()
        return out
    finally:
        child.terminate()
        child.wait()


def report(name: str, samples: list[Sample], raw: dict | None = None, cpu: bool = True) -> dict:
    rates = [s.gib_s for s in samples]
    med, cpu_ms = statistics.median(rates), statistics.median(s.cpu_ms for s in samples)
    faults = statistics.median(s.faults for s in samples)
    ratio = f"; {med / raw['median_gib_s']:.2f}x raw TCP" if raw else ""
    cpu_text = f"; loop CPU {cpu_ms:5.1f} ms, {faults:.0f} page faults" if cpu else ""
    print(f"{name:22s} median {med:5.2f} GiB/s (min {min(rates):.2f}, max {max(rates):.2f}; "
          f"{NBYTES / med / GIB * 1000:5.1f} ms per 2k-token KV{cpu_text}{ratio})", flush=True)
    return {"name": name, "median_gib_s": round(med, 3), "min": round(min(rates), 3),
            "max": round(max(rates), 3), "loop_cpu_ms": round(cpu_ms, 1) if cpu else None,
            "page_faults": faults if cpu else None}


def load_average() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def run_layout(layout: str, iters: int) -> list[dict]:
    print(f"{layout}: {load_average()}", flush=True)
    runs = uvloop.run(in_process(iters) if layout == "in-process" else two_process(iters))
    print(f"{layout} done: {load_average()}", flush=True)
    cpu = layout == "in-process"  # one loop thread does all the work only then
    raw = report(f"raw TCP, {layout}", runs.pop("raw TCP"), cpu=cpu)
    return [raw] + [report(f"{name}, {layout}", samples, raw, cpu=cpu)
                    for name, samples in runs.items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=["in-process", "two-process", "both"], default="both")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--pd", action="store_true", help="also P/D vs mixed on SmolLM2")
    ap.add_argument("--pd-iters", type=int, default=2)
    ap.add_argument("--serve-prefill", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_prefill is not None:
        uvloop.run(serve_prefill(args.serve_prefill))
        return 0
    torch.set_num_threads(1)
    print(f"{NBYTES / 2**20:.1f} MiB per request ({TOKENS} tokens, {LAYERS} layers, "
          f"{KVH} KV heads x {HD}, bf16, block {BLOCK}); {os.cpu_count()} CPUs")
    layouts = ["in-process", "two-process"] if args.layout == "both" else [args.layout]
    results = [r for layout in layouts for r in run_layout(layout, args.iters)]
    print(json.dumps(results))
    if args.pd:
        import kv_pd  # benchmarks/ is on sys.path when run as a script

        print(f"P/D: {load_average()}", flush=True)
        pd = asyncio.run(kv_pd.run(args.pd_iters, TOKENS, 256, 16))
        kv_pd.report(pd, TOKENS, 256, 16)
        print(f"P/D done: {load_average()}")
        print(json.dumps(pd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
