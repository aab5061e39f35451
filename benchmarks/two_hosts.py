"""P/D and PP across a link we control: two network namespaces ("hosts" A and B) joined by a
veth pair, each direction rate-limited with tc tbf (see two_hosts_link.py), on SmolLM2 bf16.

    sudo .venv/bin/python benchmarks/two_hosts.py [--rates 10gbit,1gbit] [--prompts 200,2000]
        [--requests 3] [--concurrency 4] [--output-len 32] [--push-deadline 120] [--no-pp]

Host A (10.77.0.1): the prefill workers (pull and push), the routers, and this client.
Host B (10.77.0.2): the decode workers and, as the no-transfer baseline, one mixed worker
(behind its own router in A, so its request and stream cross the same link).
Every worker is a real `pdmesh serve` with one torch thread, pinned with taskset: A's on core 0,
B's on core 1. All share one random PDMESH_KV_SECRET (KV peers on a non-loopback address
refuse unsigned traffic). Per link rate: a raw TCP calibration (A -> B, 64 MiB, one Python
socket), then per prompt length and path a sequential cell (`--requests`) and, with
`--concurrency`, that many requests at once, through services/bench (streamed /v1/completions, random
token-id prompts, ignore_eos). PP: a mixed worker with --pp-size 2 whose rank 0 runs in A and
whose stage 1 enters B (--pp-stage-netns), gloo on the veth addresses, against the same
worker with both stages in A on loopback; the stage process is re-pinned to core 1.

The namespaces are created and deleted here; traffic only flows between them. Every exit
path (return, exception, SIGINT, SIGTERM, and atexit as a last resort) kills the process
groups started and deletes the namespaces. Without root or `ip netns`, it says why and exits 0.
Results: a table on stdout and benchmarks/results/two-hosts-<time>.json.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from two_hosts_link import Link, LinkPlan, format_rate, parse_rate  # noqa: E402
from two_hosts_report import (  # noqa: E402
    HEADER,
    Row,
    format_row,
    kv_columns,
    kv_delta,
    kv_sums,
    median_ms,
    pd_vs_mixed,
)

MODEL = "smollm2-135m-instruct"
CALIBRATION_BYTES = 64 << 20
PORTS = {"pull_p": 8101, "push_p": 8102, "pull_d": 8201, "push_d": 8202, "mixed": 8203,
         "pp": 8104, "r_pull": 9001, "r_push": 9002, "r_mixed": 9003}


def preflight(euid: int, ip_path: str | None) -> str | None:
    """Why this machine cannot run the benchmark, or None when it can."""
    if euid != 0:
        return "needs root (creating network namespaces and tc qdiscs); skipped"
    if ip_path is None:
        return "needs iproute2's `ip` (ip netns) and `tc`; skipped"
    if not Path("/proc/self/ns/net").exists():
        return "this kernel has no network namespaces; skipped"
    return None


class Procs:
    """Every process group this benchmark started; `stop_all` is safe on any exit path."""

    def __init__(self) -> None:
        self.procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        self.logdir = Path(tempfile.mkdtemp(prefix="two-hosts-"))

    def start(self, name: str, ns: str, cores: str, argv: Sequence[str],
              env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = self.logdir / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", ns, "taskset", "-c", cores,
                                     sys.executable, "-m", "services.cli", *argv],
                                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs[name] = (proc, log)
        return proc

    def check(self, name: str) -> None:
        proc, log = self.procs[name]
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def stop(self, name: str) -> None:
        proc, _ = self.procs.pop(name)
        _kill_group(proc)

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group (the worker and its pipeline stages), SIGKILL after 15 s."""
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def wait_ready(procs: Procs, name: str, url: str, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs.check(name)
        if _get(url + "/health")[0] == 200:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{name} at {url} not healthy after {timeout_s:.0f} s")


def calibrate(plan: LinkPlan, netns_b: str) -> float:
    """Raw TCP goodput A -> B in bits/s: a sink thread that entered B, this thread in A."""
    from shared.pipeline.netns import enter_netns

    ready, port, result = threading.Event(), 9999, {}

    def sink() -> None:
        enter_netns(netns_b)
        with socket.create_server((plan.addr_b, port)) as srv:
            ready.set()
            conn, _ = srv.accept()
            with conn:
                got = 0
                while chunk := conn.recv(1 << 20):
                    got += len(chunk)
                result["bytes"] = got
                conn.sendall(b"k")

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    ready.wait(10)
    block = b"\0" * (1 << 20)
    with socket.create_connection((plan.addr_b, port)) as conn:
        start = time.perf_counter()
        for _ in range(CALIBRATION_BYTES // len(block)):
            conn.sendall(block)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
        seconds = time.perf_counter() - start
    thread.join(10)
    return result.get("bytes", 0) * 8 / seconds


def serve_argv(role: str, port: int, host: str, extra: Sequence[str] = ()) -> list[str]:
    return ["serve", "--model", MODEL, "--role", role, "--host", host, "--port", str(port),
            "--threads", "1", "--no-prefix-caching", "--kv-cache-memory", "512MiB",
            "--log-level", "WARNING", *extra]


def pd_argv(role: str, mode: str, port: int, host: str, push_deadline_s: float) -> list[str]:
    return serve_argv(role, port, host, ["--dtype", "bfloat16", "--transfer-mode", mode,
                                         "--kv-host", host, "--kv-port", str(port + 1000),
                                         "--kv-push-deadline-seconds", str(push_deadline_s)])


def start_mesh(procs: Procs, plan: LinkPlan, env: dict[str, str],
               push_deadline_s: float) -> dict[str, str]:
    """Start the P/D workers, the mixed baseline and the routers; returns the router URLs."""
    a, b = f"http://{plan.addr_a}", f"http://{plan.addr_b}"
    for mode in ("pull", "push"):
        for role, side, ns, core, addr in (("prefill", "p", plan.ns_a, "0", plan.addr_a),
                                           ("decode", "d", plan.ns_b, "1", plan.addr_b)):
            procs.start(f"{mode}_{side}", ns, core,
                        pd_argv(role, mode, PORTS[f"{mode}_{side}"], addr, push_deadline_s), env)
    procs.start("mixed", plan.ns_b, "1",
                serve_argv("mixed", PORTS["mixed"], plan.addr_b, ["--dtype", "bfloat16"]), env)
    for name, host in (("pull_p", a), ("pull_d", b), ("push_p", a), ("push_d", b),
                       ("mixed", b)):
        wait_ready(procs, name, f"{host}:{PORTS[name]}")
    routers = {}
    for path, legs in (("pull", ["--prefill", f"{a}:{PORTS['pull_p']}",
                                 "--decode", f"{b}:{PORTS['pull_d']}"]),
                       ("push", ["--prefill", f"{a}:{PORTS['push_p']}",
                                 "--decode", f"{b}:{PORTS['push_d']}"]),
                       ("mixed", ["--worker", f"{b}:{PORTS['mixed']}"])):
        port = PORTS[f"r_{path}"]
        procs.start(f"r_{path}", plan.ns_a, "0,1",
                    ["router", *legs, "--host", "127.0.0.1", "--port", str(port),
                     "--log-level", "WARNING"], env)
        routers[path] = f"http://127.0.0.1:{port}"
    for path, url in routers.items():
        wait_ready(procs, f"r_{path}", url)
    return routers


def bench_cell(url: str, prompt_len: int, output_len: int, requests: int, concurrency: int,
               seed: int) -> Any:
    from services.bench.config import BenchConfig, PromptFormat
    from services.bench.runner import run

    return run(BenchConfig(base_url=url, model=MODEL, input_len=prompt_len, output_len=output_len,
                           num_prompts=requests, max_concurrency=concurrency, ignore_eos=True,
                           seed=seed, prompt_format=PromptFormat.IDS, tokenizer_model=MODEL,
                           progress=False, request_timeout_s=300.0))


def measure(url: str, link: str, rate_bit: int | None, path: str, prompt_len: int,
            args: argparse.Namespace, concurrency: int, seed: int,
            kv_urls: Sequence[str] = ()) -> Row:
    from services.bench.client import RequestStatus

    before = [kv_sums(_get(u + "/metrics")[1]) for u in kv_urls]
    requests = args.requests if concurrency == 1 else concurrency  # one wave at once
    result = bench_cell(url, prompt_len, args.output_len, requests, concurrency, seed)
    after = [kv_sums(_get(u + "/metrics")[1]) for u in kv_urls]
    nbytes, secs = 0, 0.0
    if path in ("pull", "push"):
        for b, a in zip(before, after, strict=True):
            db, ds = kv_delta(b, a, path)
            nbytes, secs = nbytes + db, secs + ds
    ok = [r for r in result.records if r.status is RequestStatus.OK]
    for r in result.records:
        if r.status is not RequestStatus.OK:
            print(f"  {path} request {r.index} failed: {r.http_status} {r.error}", flush=True)
            break
    gbit, frac = kv_columns(nbytes, secs, rate_bit)
    row = Row(link=link, prompt_len=prompt_len, path=path, concurrency=concurrency,
              requests=len(ok), failed=result.failed,
              ttft_ms=median_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
              t2_ms=median_ms([r.itl_s[0] for r in ok if r.itl_s]),
              itl_ms=median_ms([g for r in ok for g in r.itl_s[1:]]),
              e2el_ms=median_ms([r.e2el_s for r in ok if r.e2el_s is not None]),
              kv_bytes=nbytes, kv_s=round(secs, 4), kv_gbit_s=gbit, line_frac=frac,
              load1=os.getloadavg()[0])
    print(format_row(row), flush=True)
    return row


def run_pd(procs: Procs, link: Link, env: dict[str, str], args: argparse.Namespace,
           rates: list[int]) -> tuple[list[Row], dict[str, float]]:
    plan = link.plan
    routers = start_mesh(procs, plan, env, args.push_deadline)
    kv = {"pull": [f"http://{plan.addr_b}:{PORTS['pull_d']}"],
          "push": [f"http://{plan.addr_a}:{PORTS['push_p']}"], "mixed": []}
    for url in routers.values():  # warm-up, not counted: kernels, first handshake
        bench_cell(url, max(args.prompts), 4, 1, 1, seed=999)
    rows, calibration, seed = [], {}, 0
    for rate in rates:
        link.shape(rate)
        calibration[format_rate(rate)] = calibrate(plan, plan.ns_b)
        print(f"link {format_rate(rate)}: raw TCP A->B "
              f"{calibration[format_rate(rate)] / 1e9:.2f} Gbit/s", flush=True)
        print(HEADER, flush=True)
        for prompt_len in args.prompts:
            for conc in (1, args.concurrency) if args.concurrency > 1 else (1,):
                for path in args.paths:
                    seed += 1
                    rows.append(measure(routers[path], format_rate(rate), rate, path, prompt_len,
                                        args, conc, seed, kv[path]))
    for name in ("r_pull", "r_push", "r_mixed", "pull_p", "pull_d", "push_p", "push_d", "mixed"):
        procs.stop(name)
    return rows, calibration


def pin_stage(procs: Procs, name: str, core: str) -> bool:
    """Move the pipeline's stage process (a multiprocessing spawn child) to its own core;
    True when it runs in another network namespace than rank 0 (it crossed the link)."""
    proc, _ = procs.procs[name]
    # /proc/PID/task/TID/children lists the children each thread forked (the engine thread
    # spawns the stages, not the main one).
    children = [pid for task in Path(f"/proc/{proc.pid}/task").iterdir()
                for pid in (task / "children").read_text().split()]
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            subprocess.run(["taskset", "-a", "-p", "-c", core, pid], check=True,
                           capture_output=True)
            return os.readlink(f"/proc/{pid}/ns/net") != os.readlink(f"/proc/{proc.pid}/ns/net")
    raise RuntimeError(f"{name}: no pipeline stage process among {children}")


def run_pp(procs: Procs, link: Link, env: dict[str, str], args: argparse.Namespace,
           rates: list[int]) -> list[Row]:
    plan, rows, seed = link.plan, [], 100
    url = f"http://{plan.addr_a}:{PORTS['pp']}"
    placements: list[tuple[str, list[str], list[int | None]]] = [
        ("loopback", [], [None]),
        ("link", ["--pp-master-addr", plan.addr_a, "--pp-stage-addrs", plan.addr_b,
                  "--pp-stage-netns", plan.ns_b], list(rates))]
    for placement, flags, link_rates in placements:
        host = "127.0.0.1" if placement == "loopback" else plan.addr_a
        url = f"http://{host}:{PORTS['pp']}"
        procs.start("pp", plan.ns_a, "0", serve_argv("mixed", PORTS["pp"], host,
                                                     ["--pp-size", "2", *flags]), env)
        wait_ready(procs, "pp", url)
        if pin_stage(procs, "pp", "1") != (placement == "link"):
            raise RuntimeError(f"PP stage 1 is not where the {placement} placement puts it")
        bench_cell(url, max(args.prompts), 4, 1, 1, seed=998)
        for rate in link_rates:
            if rate is not None:
                link.shape(rate)
            label = format_rate(rate) if rate is not None else "loopback"
            for prompt_len in args.prompts:
                seed += 1
                rows.append(measure(url, label, rate, "pp", prompt_len, args, 1, seed))
        procs.stop("pp")
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="10gbit,1gbit")
    ap.add_argument("--prompts", default="200,2000")
    ap.add_argument("--requests", type=int, default=3, help="sequential requests per cell")
    ap.add_argument("--concurrency", type=int, default=4,
                    help="also a cell of this many requests sent at once (<= 1: none)")
    ap.add_argument("--push-deadline", type=float, default=120.0,
                    help="--kv-push-deadline-seconds of the push workers: a push decode "
                         "registers on arrival, so it waits out the prefill's whole queue "
                         "(the workers' default, 30 s, fails 2,000-token prompts at "
                         "concurrency 4 on one core)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--paths", default="mixed,pull,push", help="P/D cells to run")
    ap.add_argument("--no-pp", action="store_true")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    args.rate_list = [parse_rate(r) for r in args.rates.split(",")]
    args.prompts = [int(p) for p in args.prompts.split(",")]
    args.paths = [p for p in args.paths.split(",") if p]
    if not set(args.paths) <= {"mixed", "pull", "push"}:
        ap.error(f"--paths takes mixed, pull and push, got {args.paths}")
    return args


def run(args: argparse.Namespace) -> int:
    from shared.pipeline.netns import enter_netns, setns_net

    tag = f"{os.getpid()}"
    link = Link(LinkPlan(ns_a=f"pdm-a-{tag}", ns_b=f"pdm-b-{tag}"))
    procs = Procs()
    home = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    def cleanup() -> None:
        procs.stop_all()
        setns_net(home)  # back out of A before its namespace goes
        for error in link.close():
            print(f"cleanup: {error}", file=sys.stderr)

    def on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    atexit.register(cleanup)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    env = {**os.environ, "PDMESH_KV_SECRET": secrets.token_hex(32)}
    try:
        link.create()
        enter_netns(link.plan.ns_a)  # this client is a process on host A
        started = time.time()
        rows, calibration = run_pd(procs, link, env, args, args.rate_list) if args.paths else ([], {})
        if not args.no_pp:
            rows += run_pp(procs, link, env, args, args.rate_list)
        report(args, rows, calibration, time.time() - started)
        shutil.rmtree(procs.logdir, ignore_errors=True)
    except BaseException:
        print(f"two_hosts: failed; process logs in {procs.logdir}", file=sys.stderr)
        raise
    finally:
        cleanup()
        atexit.unregister(cleanup)
    return 0


def cpu_kind() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                  if line.startswith("Model name")), "unknown CPU")
    bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    return f"{model}{', avx512_bf16' if bf16 else ', no avx512_bf16'}"


def report(args: argparse.Namespace, rows: list[Row], calibration: dict[str, float],
           wall_s: float) -> None:
    print("\n" + HEADER)
    for row in rows:
        print(format_row(row))
    print("\nP/D against one mixed worker (same link, same prompts):")
    for line in pd_vs_mixed(rows):
        print("  " + line)
    stamp = datetime.now(UTC)
    doc = {"schema": "pdmesh.two_hosts", "version": 1, "date": stamp.isoformat(),
           "cpu": cpu_kind(), "loadavg": os.getloadavg(), "wall_s": round(wall_s, 1),
           "model": MODEL, "output_len": args.output_len, "requests": args.requests,
           "concurrency": args.concurrency, "calibration_bit_s": calibration,
           "rows": [r.to_json() for r in rows]}
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / f"two-hosts-{stamp:%Y%m%d-%H%M}.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\n{doc['cpu']}; load average {doc['loadavg']}; {wall_s:.0f} s; saved {out}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    why = preflight(os.geteuid(), shutil.which("ip") and shutil.which("tc"))
    if why is not None:
        print(f"two_hosts: {why}")
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
