"""`pdmesh up`: a whole mesh on loopback in one command (router + prefill + decode workers)."""

from __future__ import annotations

import argparse
import json
import secrets
import shlex
import socket
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.router.supervisor import ChildSpec

HELP = ("Start a router and N prefill + N decode workers on loopback, restarting any that "
        "exits; Ctrl-C stops them all.")

DEFAULT_MODEL = "smollm2-135m-instruct"  # shared.config.DEFAULT_MODEL, without importing it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kernels.tier import TIER_CHOICES  # light: no torch
    from services.worker import parsers_config  # light: the parser registries, no torch

    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="every worker's --model (an org/name is read from the local "
                             "Hugging Face cache)")
    parser.add_argument("--revision", default=None,
                        help="every worker's --revision (org/name models; default: main)")
    parser.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers")
    parser.add_argument("--decode", type=int, default=1, metavar="N", help="decode workers")
    parser.add_argument("--transfer-mode", choices=["pull", "push"], default="pull")
    parser.add_argument("--port", type=int, default=8000, help="router port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker (default: cores / workers)")
    parser.add_argument("--no-core-share", action="store_true",
                        help="keep each worker on its own --threads: by default the workers "
                             "share one core ledger and a busy worker runs on the threads of "
                             "an idle one too (shared/engine/core_share.py)")
    parser.add_argument("--ready-timeout", type=float, default=900.0,
                        help="seconds to wait for the mesh to become healthy")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds children get to stop before SIGKILL")
    parser.add_argument("--serve-cmd", default=None,
                        help="command that starts a worker (default: this Python's "
                             "`-m services.cli serve`); the worker flags are appended")
    parser.add_argument("--worker-log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="workers' log level (their access logs are at INFO)")
    parser.add_argument("--disagg-min-tokens", type=_min_tokens, default="auto",
                        metavar="N|auto",
                        help="the router's threshold: shorter prompts are served whole by a "
                             "decode worker (default auto: learned from measured costs)")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for the router (repeatable)")
    parser.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for every worker (repeatable)")
    parser.add_argument("--restart-delay", type=float, default=1.0,
                        help="seconds before restarting a child that exited once the mesh is "
                             "up; doubled on each restart in a row")
    parser.add_argument("--restart-max-delay", type=float, default=30.0,
                        help="cap of the restart backoff, in seconds")
    parser.add_argument("--kernel-tier", default=None, choices=TIER_CHOICES,
                        help="every worker's --kernel-tier (default: $PDMESH_KERNEL_TIER, which "
                             "the workers inherit, else auto)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="speculative decoding JSON (as `pdmesh serve`), passed to the "
                             "decode (and mixed) workers: speculation runs on the decode side")
    # Passed to every worker: a decode parses the answers, and a prefill tells the router so.
    parsers_config.add_arguments(parser)
    from services.common import tls  # light: ssl only

    tls.add_arguments(parser.add_argument_group(
        "TLS (passed to the router and every worker; the mesh's URLs become https://)"))
    parser.add_argument("--kv-require-client-cert", action="store_true",
                        help="every worker's KV listener requires client certificates (mTLS)")


def _min_tokens(value: str) -> str:
    """Checks `--disagg-min-tokens` here, so a bad value stops `up` before any child starts.

    `auto` is up's default (the router's stays 0): on one box both engines compute a prompt
    token at the same speed and the KV moves over loopback, which is what the learned
    threshold's cost model assumes (services/router/disagg_threshold.py)."""
    from services.router.disagg_threshold import AUTO, parse_min_tokens  # light: no torch

    tokens = parse_min_tokens(value)
    return AUTO if tokens is None else str(tokens)


def ensure_kv_secret(environ: MutableMapping[str, str]) -> bool:
    """Give the mesh a random KV secret unless PDMESH_KV_SECRET (or _FILE) names one; True if
    one was made. It goes to the children through the environment they inherit: never on a
    command line (argv is public in `ps`), never printed."""
    from services.kv_transfer.config import KV_SECRET_ENV, KV_SECRET_FILE_ENV

    if environ.get(KV_SECRET_ENV) or environ.get(KV_SECRET_FILE_ENV):
        return False
    environ[KV_SECRET_ENV] = secrets.token_hex(32)
    return True


def _free_port(host: str, start: int, taken: set[int]) -> int:
    """The first port >= start that is bindable now and not already handed out."""
    for port in range(start, start + 1000):
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise RuntimeError(f"no free port from {start}")


def worker_flags(role: str, args: argparse.Namespace, port: int, kv_port: int,
                 threads: int) -> list[str]:
    flags = ["--model", args.model, "--role", role, "--host", args.host, "--port", str(port),
             "--threads", str(threads), "--log-level", args.worker_log_level]
    if role != "mixed":
        flags += ["--transfer-mode", args.transfer_mode, "--kv-port", str(kv_port)]
    if getattr(args, "kernel_tier", None):
        flags += ["--kernel-tier", args.kernel_tier]
    if getattr(args, "revision", None):
        flags += ["--revision", args.revision]
    if getattr(args, "core_share_file", None):
        flags += ["--core-share", str(args.core_share_file)]
    if getattr(args, "speculative_config", None) and role != "prefill":
        flags += ["--speculative-config", args.speculative_config]
    from services.worker.parsers_config import forwarded_flags

    if role != "mixed" and getattr(args, "kv_require_client_cert", False):
        flags.append("--kv-require-client-cert")
    return flags + forwarded_flags(args) + tls_flags(args) + list(
        getattr(args, "worker_arg", None) or ())


def tls_flags(args: argparse.Namespace) -> list[str]:
    """The --tls-* flags given to `up`, for a child (the router or a worker)."""
    flags: list[str] = []
    for flag in ("--tls-cert", "--tls-key", "--tls-ca"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value:
            flags += [flag, value]
    return flags


def scheme(args: argparse.Namespace) -> str:
    return "https" if getattr(args, "tls_cert", None) else "http"


def preflight(flags: list[str]) -> str | None:
    """Why this build's `pdmesh serve` would refuse these flags, or None (checked in-process,
    before anything starts: the worker's own parser and config)."""
    import contextlib
    import io
    import os

    from services.commands import serve
    from services.worker.config import WorkerConfig

    parser = argparse.ArgumentParser(add_help=False)
    serve.add_arguments(parser)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            known, unknown = parser.parse_known_args(flags)
        if unknown:
            return f"unknown flags {' '.join(unknown)}"
        WorkerConfig.from_args(known, os.environ)
    except (SystemExit, ValueError) as exc:
        return str(exc) or "flags refused"
    return None


def plan(args: argparse.Namespace, cpu_count: int) -> tuple[list[ChildSpec], str]:
    """The child specs (router first) and the router URL. Without --serve-cmd the P/D worker
    flags are checked first; a build whose workers cannot take them yet gets mixed workers."""
    from services.router.supervisor import ChildSpec

    if args.prefill < 1 or args.decode < 1:
        raise ValueError("--prefill and --decode must be >= 1")
    serve = shlex.split(args.serve_cmd) if args.serve_cmd else [
        sys.executable, "-m", "services.cli", "serve"]
    roles = [("prefill", args.prefill), ("decode", args.decode)]
    threads = args.threads or max(1, cpu_count // (args.prefill + args.decode))
    if not args.serve_cmd:
        refused = preflight(worker_flags("prefill", args, args.port + 1, args.port + 101, 1))
        if refused is not None:
            print(f"[up] this build's `pdmesh serve` cannot run a prefill worker ({refused}); "
                  f"starting {args.prefill + args.decode} mixed worker(s) instead", flush=True)
            roles = [("mixed", args.prefill + args.decode)]
    taken = {args.port}
    workers, router = [], [sys.executable, "-m", "services.cli", "router", "--host", args.host,
                           "--port", str(args.port), *tls_flags(args)]
    for role, count in roles:
        for i in range(count):
            port = _free_port(args.host, args.port + 1, taken)
            kv_port = _free_port(args.host, args.port + 101, taken)
            argv = [*serve, *worker_flags(role, args, port, kv_port, threads)]
            workers.append(ChildSpec(f"{role}-{i}", tuple(argv)))
            router += ["--worker" if role == "mixed" else f"--{role}",
                       f"{scheme(args)}://{args.host}:{port}"]
    if roles[0][0] != "mixed":
        router += ["--disagg-min-tokens", getattr(args, "disagg_min_tokens", "auto")]
    router += args.router_arg  # last: a --router-arg wins over what up chose
    url = f"{scheme(args)}://{args.host}:{args.port}"
    return [ChildSpec("router", tuple(router)), *workers], url


def banner(url: str, model: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}]})
    sdk = ("from openai import OpenAI\n"
           f"client = OpenAI(base_url='{url}/v1', api_key='unused')\n"
           f"reply = client.chat.completions.create(model='{model}', "
           "messages=[{'role': 'user', 'content': 'Hello!'}])\n"
           "print(reply.choices[0].message.content)")
    return "\n".join([
        f"[up] mesh ready: {url}  (metadata: {url}/v1/router/metadata)",
        "[up] try it:",
        f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'",
        "[up] or with the openai SDK:",
        *("  " + line for line in sdk.splitlines()),
        "[up] Ctrl-C stops everything.",
    ])


def run(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from services.common import tls
    from services.router.supervisor import RestartPolicy
    from services.worker.parsers_config import ParsersConfig
    from shared.config import kernel_tier_from_env
    from shared.speculative_config import SpeculativeConfig

    if ensure_kv_secret(os.environ):
        print("[up] generated a random KV secret for this mesh (set PDMESH_KV_SECRET to choose "
              "one; it is never printed)", flush=True)
    try:
        kernel_tier_from_env(os.environ)  # the workers inherit it: refuse a bad one up front
        SpeculativeConfig.parse(args.speculative_config)  # likewise, before any worker starts
        ParsersConfig.from_args(args, os.environ)  # likewise (and not a reason to go mixed)
        if not getattr(args, "no_core_share", False):
            args.core_share_file = core_share_file()
        specs, url = plan(args, os.cpu_count() or 1)
        ssl_context = tls.from_args(args).client_context() if args.tls_cert else None
        policy = RestartPolicy(initial_s=args.restart_delay, max_s=args.restart_max_delay)
    except (ValueError, RuntimeError) as exc:
        print(f"pdmesh up: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_up(specs, url, args, policy, ssl_context))
    finally:
        if getattr(args, "core_share_file", None):
            args.core_share_file.unlink(missing_ok=True)


def core_share_file() -> Path:
    """A fresh path for the workers' core ledger: in /dev/shm where there is one (memory, not
    disk: every step reads it), else the temp folder. The first worker creates the file."""
    import os
    import tempfile

    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return folder / f"pdmesh-cores-{os.getpid()}-{secrets.token_hex(4)}"


async def _up(specs: list[ChildSpec], url: str, args: argparse.Namespace, policy: Any,
              ssl_context: Any = None) -> int:
    import asyncio
    import signal

    from services.router.supervisor import Supervisor

    sup = Supervisor(specs, grace_s=args.grace)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await sup.start()
    try:
        ready = asyncio.ensure_future(sup.wait_healthy(url + "/health", args.ready_timeout,
                                                       ssl_context))
        await asyncio.wait({ready, asyncio.ensure_future(stop.wait())},
                           return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            ready.cancel()
            return 0
        if not ready.result():
            failed = sup.exited()
            sup.say(f"[up] {failed.spec.name} exited with {failed.proc.returncode}" if failed
                    else f"[up] {url}/health not ready after {args.ready_timeout:.0f}s")
            return 1
        sup.say(banner(url, args.model))
        # From here on a child that exits is restarted (a worker whose engine failed exits 1
        # on purpose); before, an exit is a start-up failure and ends `up` (above).
        await sup.supervise(stop, policy)
        return 0
    finally:
        sup.say("[up] stopping")
        await sup.stop()
