"""`pdmesh bench` end to end against the fake OpenAI server: subprocess runs and in-process runs."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import sys
from pathlib import Path

import pytest

from services.bench import runner
from services.bench.config import BenchConfig
from shared.protocol.pd import ApiKind
from tests.support.fake_openai import KV_BYTES, PHASES, FakeOpenAI, serve

ROOT = Path(__file__).resolve().parents[2]
# matplotlib is the optional `bench` extra: without it --plot must fail clearly, after the JSON
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


async def start_bench(base_url: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "bench", "--base-url", base_url, "--model", "m",
        "--no-progress", *args, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)


async def run_bench(base_url: str, *args: str) -> tuple[int, str, str]:
    proc = await start_bench(base_url, *args)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    return proc.returncode, out.decode(), err.decode()


async def test_plain_openai_server(tmp_path: Path) -> None:
    fake = FakeOpenAI()
    result = tmp_path / "out.json"
    async with serve(fake) as url:
        rc, out, err = await run_bench(
            url, "--input-len", "24", "--output-len", "6", "--num-prompts", "12",
            "--max-concurrency", "3", "--request-rate", "inf", "--ignore-eos",
            "--goodput", "ttft:10000", "tpot:10000", "e2el:10000", "--percentiles", "50,90,99",
            "--save-result", str(result))
    assert rc == 0, err
    assert "Serving Benchmark Result" in out and "Phase breakdown" not in out
    data = json.loads(result.read_text())
    assert (data["schema"], data["version"], data["partial"]) == ("pdmesh.bench.result", 1, False)
    assert (data["completed"], data["failed"], data["num_prompts"]) == (12, 0, 12)
    assert data["total_input_tokens"] == 12 * 24 and data["total_output_tokens"] == 12 * 6
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    assert data["output_throughput"] == pytest.approx(72 / data["duration"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for key in ("mean", "median", "std", "p50", "p90", "p99"):
            assert isinstance(data[f"{key}_{metric}_ms"], float)
    assert data["phases"] == {} and data["errors_by_type"] == {}
    assert data["client"]["percent_of_core"] >= 0 and data["config"]["prompt_format"] == "ids"
    reqs = data["requests"]
    assert len(reqs) == 12 and all(r["status"] == "ok" and r["output_tokens"] == 6 for r in reqs)
    assert all(r["output_tokens_source"] == "usage" and len(r["itl_s"]) == 5 for r in reqs)
    # what went on the wire: token-id prompts of the requested length, vLLM's extras
    assert all(len(b["prompt"]) == 24 and b["ignore_eos"] and b["max_tokens"] == 6
               and b["stream_options"] == {"include_usage": True} for b in fake.bodies)


async def test_phase_header_errors_and_plot(tmp_path: Path) -> None:
    fake = FakeOpenAI(phases="header", fail_every=4)
    result, png = tmp_path / "out.json", tmp_path / "out.png"
    async with serve(fake) as url:
        rc, out, err = await run_bench(
            url, "--endpoint", "/v1/chat/completions", "--input-len", "16", "--output-len", "4",
            "--num-prompts", "12", "--max-concurrency", "4", "--save-result", str(result),
            "--plot", str(png))
    assert rc == (0 if HAS_MATPLOTLIB else 1), err
    data = json.loads(result.read_text())
    assert (data["completed"], data["failed"]) == (9, 3)
    assert data["errors_by_type"] == {"http_503:ServiceUnavailableError": 3}
    assert list(data["phases"]) == list(PHASES)
    for name, seconds in PHASES.items():
        assert data["phases"][name]["mean_ms"] == pytest.approx(seconds * 1000)
        assert data["phases"][name]["count"] == 9
    assert data["kv_transfer"]["total_bytes"] == 9 * KV_BYTES
    assert data["disagg_decisions"] == {"remote_prefill": 9}
    assert "Phase breakdown" in out and "kv_transfer" in out
    if HAS_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "needs matplotlib" in err and not png.exists()


async def test_sigint_saves_partial_results(tmp_path: Path) -> None:
    fake = FakeOpenAI(token_delay_s=0.02)
    result = tmp_path / "partial.json"
    async with serve(fake) as url:
        proc = await start_bench(url, "--input-len", "8", "--output-len", "10",
                                 "--num-prompts", "60", "--max-concurrency", "2",
                                 "--save-result", str(result))
        # A readiness wait, not a timing check: the bench process imports and starts slowly on a
        # loaded box (15 s was once not enough with the whole suite running beside it), and its
        # 60 requests take >= 6 s once going, so SIGINT still lands mid-run.
        deadline = asyncio.get_running_loop().time() + 90
        while fake.finished < 4 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert fake.finished >= 4, "the bench never got going"
        proc.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 130, err.decode()
    data = json.loads(result.read_text())
    assert data["partial"] is True and "(PARTIAL)" in out.decode()
    assert 4 <= data["completed"] < 60 and data["failed"] == 0
    assert data["not_sent"] > 0
    assert data["completed"] + data["cancelled"] + data["not_sent"] == 60


async def test_bad_flags_exit_2() -> None:
    rc, _, err = await run_bench("http://127.0.0.1:9", "--goodput", "itl:5")
    assert rc == 2 and "goodput" in err


def config(url: str, **kw: object) -> BenchConfig:
    return BenchConfig(base_url=url, model="m", progress=False, **kw)


async def test_usage_chunk_phases_in_process() -> None:
    fake = FakeOpenAI(phases="usage")
    async with serve(fake) as url:
        result = await runner.bench(config(url, input_len=8, output_len=3, num_prompts=4))
    assert result.completed == 4 and list(result.phases) == list(PHASES)  # no "total"
    for name, seconds in PHASES.items():
        assert result.phases[name].mean_ms == pytest.approx(seconds * 1000)
    assert result.kv_transfer.total_bytes == 4 * KV_BYTES
    assert result.disagg_decisions == {"remote_prefill": 4}
    assert result.requests_retried == 2  # the fake reports one retry on odd requests


async def test_no_tokenizer_and_no_usage_fall_back() -> None:
    fake = FakeOpenAI(usage=False, tokenize_endpoints=False)
    async with serve(fake) as url:
        result = await runner.bench(config(url, input_len=8, output_len=5, num_prompts=3))
    assert result.completed == 3 and result.total_output_tokens == 15
    assert all(r.output_tokens_source == "chunks" for r in result.records)
    assert result.unknown_input_lens == 3 and result.total_input_tokens == 0
    assert all(isinstance(b["prompt"], str) for b in fake.bodies)  # word prompts


async def test_chat_ttft_waits_for_text_not_the_role_chunk() -> None:
    fake = FakeOpenAI(token_delay_s=0.05)
    async with serve(fake) as url:
        result = await runner.bench(config(url, endpoint=ApiKind.CHAT, input_len=4,
                                           output_len=2, num_prompts=1))
    (record,) = result.records
    # the role chunk comes at once; the first text chunk only after one token delay
    assert record.ttft_s >= 0.045 and len(record.itl_s) == 1 and record.itl_s[0] >= 0.045
