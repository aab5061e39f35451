"""The chaos matrix: faults injected into a real mesh while streaming requests are in flight.

One router, two prefills and two decodes (benchmarks/chaos_mesh.py), pull mode, one KV secret;
the first prefill's KV listener sits behind a fault-injecting proxy (benchmarks/kv_proxy.py).
For each fault, `--concurrency` streaming completions are started through the router, the fault
is injected once about half of them have their first token, the worker is brought back, and
the row reports, from the clients' side and the mesh's:

  completed     streams that ended with a finish_reason and [DONE], no error event
  failed        streams that got an error (in-stream error event, or an error status with the
                OpenAI envelope), and how long after the fault each learned it (p50/max)
  broken        streams cut without an error event or [DONE] (lost silently)
  hung          streams that were still open at the hard client timeout (must be 0)
  blocks        KV blocks in use on every worker afterwards, once leases expired (must be 0)
  stop/again    seconds until the router stops routing to the victim (from the fault) and
                routes to it again (from its restart or SIGCONT); "-" where not expected

It reports what the mesh does today, whatever that is: a fault the mesh does not survive shows
up as failed, broken or hung requests, not as an exception of this script.

    .venv/bin/python benchmarks/chaos.py                          # all faults, embedded model
    .venv/bin/python benchmarks/chaos.py --faults kill_decode,client_close --stop-seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from chaos_mesh import Mesh, MeshSpec, Proc
from chaos_traffic import Kind, Outcome, completion_body, percentile, stream_request

PROMPT = "The history of the printing press begins in the fifteenth century, when"


@dataclass(frozen=True)
class ChaosConfig:
    concurrency: int = 16
    max_tokens: int = 24
    hard_timeout_s: float = 30.0  # a stream still open after this is "hung"
    stop_s: float = 40.0  # SIGSTOP duration
    client_closes: int = 100
    cuts: int = 3  # KV connections the proxy resets
    detect_timeout_s: float = 30.0  # how long to wait for the router to notice a fault


@dataclass
class Timing:
    """When the router stopped routing to the victim (s after the fault) and routed to it
    again (s after its recovery); None = not within the wait, or not expected (note says)."""

    stop_routing_s: float | None = None
    route_again_s: float | None = None
    note: str = ""
    injected: int = 1  # faults injected (KV connections cut, clients closed, else 1)


@dataclass
class FaultRow:
    fault: str
    sent: int
    completed: int
    failed: int
    broken: int
    hung: int
    closed: int
    learn_p50_s: float | None
    learn_max_s: float | None
    blocks_after: dict[str, int | None]
    blocks_freed_s: float
    stop_routing_s: float | None
    route_again_s: float | None
    note: str
    injected: int
    errors: list[str] = field(default_factory=list)

    @property
    def leaked_blocks(self) -> int:
        return sum(b or 0 for b in self.blocks_after.values())


@dataclass
class Ctx:
    """What a fault needs: the mesh, a session, the settings, and the running streams."""

    mesh: Mesh
    session: aiohttp.ClientSession
    cfg: ChaosConfig
    progress: list[Outcome]
    # Streams a fault started itself (to make traffic it needs); they count in its row.
    extra: list[asyncio.Future[Outcome]] = field(default_factory=list)


Inject = Callable[[Ctx], Awaitable[Timing]]


async def _outage(ctx: Ctx, victim: Proc, down: Callable[[], None],
                  up: Callable[[], None], hold_s: float = 0.0) -> Timing:
    """Take `victim` down (`down`), measure until the router stops routing to it, keep it down
    `hold_s` in all, bring it up (`up`) and measure until the router routes to it again."""
    t0 = time.monotonic()
    down()
    stop = await ctx.mesh.wait_usable(ctx.session, victim, False,
                                      hold_s or ctx.cfg.detect_timeout_s, since=t0)
    await asyncio.sleep(max(0.0, t0 + hold_s - time.monotonic()))
    t1 = time.monotonic()
    up()
    again = await ctx.mesh.wait_usable(ctx.session, victim, True, ctx.mesh.spec.ready_timeout_s,
                                       since=t1)
    wait = hold_s or ctx.cfg.detect_timeout_s
    note = f"victim {victim.name}" + (
        "" if stop is not None else f"; the router kept it in rotation for {wait:g}s")
    return Timing(stop, again, note)


def _restart(victim: Proc, extra: tuple[str, ...] = ()) -> Callable[[], None]:
    def restart() -> None:
        victim.kill9()
        victim.start(extra)

    return restart


async def kill_decode(ctx: Ctx) -> Timing:
    victim = await ctx.mesh.busiest(ctx.session, "decode")
    return await _outage(ctx, victim, victim.kill9, _restart(victim))


async def kill_prefill(ctx: Ctx) -> Timing:
    victim = await ctx.mesh.busiest(ctx.session, "prefill")
    return await _outage(ctx, victim, victim.kill9, _restart(victim))


async def stop_decode(ctx: Ctx) -> Timing:
    victim = await ctx.mesh.busiest(ctx.session, "decode")
    return await _outage(ctx, victim, lambda: victim.signal(signal.SIGSTOP),
                         lambda: victim.signal(signal.SIGCONT), ctx.cfg.stop_s)


async def stop_prefill_mid_pull(ctx: Ctx) -> Timing:
    """SIGSTOP the proxied prefill as soon as KV bytes flow from it (a pull in progress)."""
    victim, proxy = ctx.mesh.by_role("prefill")[0], ctx.mesh.proxy
    assert proxy is not None, "this fault needs the KV proxy in front of prefill-0"
    flowing = await proxy.wait_flowing(ctx.cfg.hard_timeout_s)
    timing = await _outage(ctx, victim, lambda: victim.signal(signal.SIGSTOP),
                           lambda: victim.signal(signal.SIGCONT), ctx.cfg.stop_s)
    if not flowing:
        timing.note = "no KV pull seen through the proxy: stopped anyway"
    return timing


async def cut_kv(ctx: Ctx) -> Timing:
    """Reset KV connections prefill-0 -> decode in the middle of a body, `cuts` times."""
    proxy = ctx.mesh.proxy
    assert proxy is not None, "this fault needs the KV proxy in front of prefill-0"
    before = proxy.cuts
    proxy.arm_cut(after_bytes=1024, count=ctx.cfg.cuts)
    deadline = time.monotonic() + ctx.cfg.hard_timeout_s
    url = ctx.mesh.url + "/v1/completions"
    next_extra = time.monotonic() + 1.0
    while proxy.cuts - before < ctx.cfg.cuts and time.monotonic() < deadline:
        # The running streams may have pulled their KV already (a fast mesh prefills them
        # all before half stream): then new requests make the pulls to cut, one every 0.5 s.
        # The router sends about half of them through prefill-0's proxy.
        if time.monotonic() >= next_extra and len(ctx.extra) < 8 * ctx.cfg.cuts:
            body = completion_body(f"cut {len(ctx.extra)}: {PROMPT}", ctx.cfg.max_tokens)
            ctx.extra.append(asyncio.ensure_future(stream_request(
                ctx.session, url, body, ctx.cfg.hard_timeout_s)))
            next_extra = time.monotonic() + 0.5
        await asyncio.sleep(0.05)
    proxy.disarm()
    return Timing(note=f"{proxy.cuts - before} KV connections reset mid-body; the prefill "
                       "stays healthy, so no routing change is expected",
                  injected=proxy.cuts - before)


async def restart_new_weights(ctx: Ctx) -> Timing:
    """Restart a decode with another dtype: its compat hash changes, so it lands in a group
    of its own (no prefill shares it) and the router must not pair it with the old prefills."""
    victim = await ctx.mesh.busiest(ctx.session, "decode")
    other = "float32" if ctx.mesh.spec.dtype != "float32" else "bfloat16"
    t0 = time.monotonic()
    victim.kill9()
    stop = await ctx.mesh.wait_usable(ctx.session, victim, False, ctx.cfg.detect_timeout_s,
                                      since=t0)
    victim.start(("--dtype", other))
    # Healthy again but incompatible: routing to it again would be the defect.
    again = await ctx.mesh.wait_usable(ctx.session, victim, True, 5.0)
    note = (f"{victim.name} restarted with --dtype {other} (new compat hash): "
            + ("the router routes to it (unexpected)" if again is not None
               else "healthy but unpaired, not routed to (expected)"))
    return Timing(stop, again, note)


async def client_close(ctx: Ctx) -> Timing:
    closed = sum(o.kind is Kind.CLOSED for o in ctx.progress)
    return Timing(note=f"{closed} clients closed after 2 tokens", injected=closed)


FAULTS: dict[str, Inject] = {
    "kill_decode": kill_decode, "kill_prefill": kill_prefill, "stop_decode": stop_decode,
    "stop_prefill_mid_pull": stop_prefill_mid_pull, "cut_kv": cut_kv,
    "restart_new_weights": restart_new_weights, "client_close": client_close,
}


async def run_fault(mesh: Mesh, name: str, cfg: ChaosConfig) -> FaultRow:
    url = mesh.url + "/v1/completions"
    async with aiohttp.ClientSession() as session:
        await mesh.wait_all_usable(session, mesh.spec.ready_timeout_s)
        if name == "client_close":
            outcomes = await _closing_clients(session, url, cfg)
            t_fault = time.monotonic()
            timing = await client_close(Ctx(mesh, session, cfg, outcomes))
        else:
            outcomes, t_fault, timing = await _streams_with_fault(mesh, session, url, name, cfg)
        await _restore(mesh, session)
        blocks, freed_s = await mesh.wait_blocks_freed(session, 2 * mesh.spec.lease_s + 10)
    failed = [o for o in outcomes if o.kind in (Kind.ERROR_EVENT, Kind.HTTP_ERROR)]
    learn = [o.ended - max(o.started, t_fault) for o in failed]
    return FaultRow(
        name, len(outcomes), sum(o.kind is Kind.COMPLETED for o in outcomes), len(failed),
        sum(o.kind is Kind.BROKEN for o in outcomes), sum(o.kind is Kind.HUNG for o in outcomes),
        sum(o.kind is Kind.CLOSED for o in outcomes), _r(percentile(learn, 50)),
        _r(max(learn) if learn else None), blocks, round(freed_s, 2), _r(timing.stop_routing_s),
        _r(timing.route_again_s), timing.note, timing.injected,
        sorted({(o.error or "")[:120] for o in outcomes if o.error}))


async def _streams_with_fault(mesh: Mesh, session: aiohttp.ClientSession, url: str, name: str,
                              cfg: ChaosConfig) -> tuple[list[Outcome], float, Timing]:
    progress: list[Outcome] = []
    tasks = [asyncio.ensure_future(stream_request(
        session, url, completion_body(f"{i}: {PROMPT}", cfg.max_tokens), cfg.hard_timeout_s,
        progress=progress)) for i in range(cfg.concurrency)]
    deadline = time.monotonic() + cfg.hard_timeout_s
    # In flight: half of them streaming (the rest queued in the engines or mid-prefill).
    while (sum(bool(o.token_times) for o in progress) < cfg.concurrency // 2
           and time.monotonic() < deadline and not all(t.done() for t in tasks)):
        await asyncio.sleep(0.02)
    t_fault = time.monotonic()
    ctx = Ctx(mesh, session, cfg, progress)
    timing = await FAULTS[name](ctx)
    outcomes = list(await asyncio.gather(*tasks, *ctx.extra))
    return outcomes, t_fault, timing


async def _closing_clients(session: aiohttp.ClientSession, url: str,
                           cfg: ChaosConfig) -> list[Outcome]:
    """`client_closes` streams, `concurrency` at a time, each closed after 2 tokens."""
    sem = asyncio.Semaphore(cfg.concurrency)

    async def one(i: int) -> Outcome:
        async with sem:
            body = completion_body(f"{i}: {PROMPT}", cfg.max_tokens)
            return await stream_request(session, url, body, cfg.hard_timeout_s,
                                        close_after_tokens=2)

    return list(await asyncio.gather(*(one(i) for i in range(cfg.client_closes))))


async def _restore(mesh: Mesh, session: aiohttp.ClientSession) -> None:
    """Every worker back as it started (alive, running, original flags) and routed to."""
    for w in mesh.workers:
        w.signal(signal.SIGCONT)
        if not w.alive() or w.extra:
            w.kill9()
            w.start()
    await mesh.wait_all_usable(session, mesh.spec.ready_timeout_s)


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


async def run(spec: MeshSpec, cfg: ChaosConfig, faults: list[str],
              log_dir: Path) -> list[FaultRow]:
    rows = []
    async with Mesh(spec, log_dir) as mesh:
        for name in faults:
            rows.append(await run_fault(mesh, name, cfg))
            print(json.dumps(asdict(rows[-1])), flush=True)
    return rows


def table(rows: list[FaultRow]) -> str:
    """The Markdown table of the README's Reliability section."""
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:g}"

    lines = ["| fault | sent | completed | failed (error event) | learned p50 / max s | broken "
             "| hung | blocks held after | router stop / again s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sent = f"{r.sent} ({r.closed} closed)" if r.closed else str(r.sent)
        lines.append(f"| {r.fault} | {sent} | {r.completed} | {r.failed} | "
                     f"{f(r.learn_p50_s)} / {f(r.learn_max_s)} | {r.broken} | {r.hung} | "
                     f"{r.leaked_blocks} | {f(r.stop_routing_s)} / {f(r.route_again_s)} |")
    return "\n".join(lines)


def machine() -> str:
    """CPU kind, core count and load average, for the figures' caption."""
    model = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"CPU {model}, {os.cpu_count()} cores, load average {load}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = ChaosConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma-separated subset of {', '.join(FAULTS)}")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--hard-timeout", type=float, default=d.hard_timeout_s,
                   help="seconds after which an open stream counts as hung")
    p.add_argument("--stop-seconds", type=float, default=d.stop_s, help="SIGSTOP duration")
    p.add_argument("--client-closes", type=int, default=d.client_closes)
    p.add_argument("--cuts", type=int, default=d.cuts, help="KV connections the proxy resets")
    p.add_argument("--lease-seconds", type=float, default=10.0,
                   help="the workers' --kv-lease-seconds")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="extra router flag (repeatable), e.g. --router-arg=--breaker-cooldown=5")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    args.faults = [f for f in args.faults.split(",") if f]
    unknown = set(args.faults) - set(FAULTS)
    if unknown:
        p.error(f"unknown faults: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = ChaosConfig(args.concurrency, args.max_tokens, args.hard_timeout, args.stop_seconds,
                      args.client_closes, args.cuts)
    spec = MeshSpec(args.model, dtype=args.dtype, lease_s=args.lease_seconds,
                    router_flags=tuple(args.router_arg))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdmesh-chaos-"))
    rows = asyncio.run(run(spec, cfg, args.faults, log_dir))
    print(table(rows))
    print(f"{machine()}; logs in {log_dir}")
    if args.json:
        doc: dict[str, Any] = {"config": asdict(cfg), "machine": machine(),
                               "rows": [asdict(r) for r in rows]}
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
