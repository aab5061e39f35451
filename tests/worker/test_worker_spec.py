"""A worker with --speculative-config on a tiny random model: the HTTP answers equal the
offline engine's with speculation off, and /metrics counts the drafts (vLLM's names)."""

from __future__ import annotations

import io
import json
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from services.bench import report, runner
from services.bench.config import BenchConfig
from services.worker.config import WorkerConfig
from shared.config import EngineConfig
from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams
from tests.support.worker import WorkerThread

PROMPTS = ["one two three one two three one two", "a b c d a b c d a b c d a b"]
KV_BYTES = 16 * 1024 * 1024


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_speculating_worker_matches_offline_and_exports_counters(tiny_dir: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    engine = EngineConfig(model=str(tiny_dir), dtype="float32", kv_cache_memory_bytes=KV_BYTES,
                          speculative_config=spec)  # type: ignore[arg-type]
    offline = LLM(model=str(tiny_dir), dtype="float32", kv_cache_memory_bytes=KV_BYTES)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
    srv = WorkerThread(WorkerConfig(engine=engine, served_model_names=("tiny",))).start(
        ready_timeout=120)
    try:
        got = [post(srv.url + "/v1/completions", {
            "model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True})["choices"][0]["text"] for p in PROMPTS]
        values = counters(srv.url)
        bench = runner.run(BenchConfig(
            base_url=srv.url, model="tiny", input_len=12, output_len=12, num_prompts=4,
            max_concurrency=1, ignore_eos=True, progress=False))
        after = counters(srv.url)
    finally:
        srv.stop()
    assert got == expected
    drafted = values["pdmesh:spec_decode_num_draft_tokens_total"]
    assert drafted > 0
    assert 0 <= values["pdmesh:spec_decode_num_accepted_tokens_total"] <= drafted
    # `pdmesh bench` reports the run's share of the counters, as vLLM's bench serve derives it.
    spec = bench.spec_decode
    delta = {k: after[k] - values[k] for k in after}
    assert spec is not None and spec.drafts == delta["pdmesh:spec_decode_num_drafts_total"] > 0
    assert spec.draft_tokens == delta["pdmesh:spec_decode_num_draft_tokens_total"]
    assert spec.accepted_tokens == delta["pdmesh:spec_decode_num_accepted_tokens_total"]
    assert spec.mean_acceptance_length == 1 + spec.accepted_tokens / spec.drafts
    out = io.StringIO()
    report.print_table(bench, BenchConfig(base_url=srv.url, model="tiny"), out)
    assert "Speculative Decoding" in out.getvalue()


def counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("pdmesh:spec_decode_num_") and "position" not in s.labels}
