"""/metrics: vLLM's names with the pdmesh: prefix, per-app registries, request accounting."""

from __future__ import annotations

from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fake_engine import FakeEngine
from tests.support.worker import MODEL, start_client, worker_config

GAUGES = ("pdmesh:num_requests_running", "pdmesh:num_requests_waiting", "pdmesh:kv_cache_usage_perc")
COUNTERS = ("pdmesh:prompt_tokens", "pdmesh:generation_tokens", "pdmesh:request_success",
            "pdmesh:num_preemptions", "pdmesh:prefix_cache_queries", "pdmesh:prefix_cache_hits")
HISTOGRAMS = ("pdmesh:time_to_first_token_seconds", "pdmesh:inter_token_latency_seconds",
              "pdmesh:e2e_request_latency_seconds", "pdmesh:request_queue_time_seconds",
              "pdmesh:request_prefill_time_seconds", "pdmesh:request_decode_time_seconds")


async def scrape(client: TestClient) -> dict[str, dict[tuple, float]]:
    resp = await client.get("/metrics")
    assert resp.status == 200
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(await resp.text()):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    key = tuple(sorted({"model_name": MODEL, **labels}.items()))
    return samples.get(name, {}).get(key, 0.0)


async def test_names_types_and_accounting(client: TestClient) -> None:
    before = await scrape(client)
    for name in GAUGES:
        assert value(before, name) == 0.0 and name in before
    for name in ("pdmesh:num_preemptions_total", "pdmesh:prefix_cache_queries_total"):
        assert name in before
    assert not any(name.endswith("_created") for name in before)
    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "n": 2})
    stream = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True})
    assert (await stream.read()).endswith(b"data: [DONE]\n\n")
    after = await scrape(client)
    assert value(after, "pdmesh:request_success_total", finished_reason="length") == 3
    assert value(after, "pdmesh:generation_tokens_total") == 4 + 4 + 3
    assert value(after, "pdmesh:prompt_tokens_total") > 0
    for name in HISTOGRAMS:  # one observation per finished choice, ITL one per later token
        if name != "pdmesh:inter_token_latency_seconds":
            assert value(after, name + "_count") == 3, name
    assert value(after, "pdmesh:inter_token_latency_seconds_count") == 3 + 3 + 2
    ttft_buckets = [dict(k)["le"] for k in after["pdmesh:time_to_first_token_seconds_bucket"]]
    assert "0.001" in ttft_buckets and "2560.0" in ttft_buckets


async def test_registries_are_per_app(client: TestClient) -> None:
    other = await start_client(worker_config(), FakeEngine())
    try:
        await other.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert value(await scrape(other), "pdmesh:generation_tokens_total") == 2
        assert value(await scrape(client), "pdmesh:generation_tokens_total") == 0
    finally:
        await other.close()


def test_spec_decode_counters_under_vllm_names() -> None:
    from services.worker.metrics import EngineStatsCollector
    from shared.engine.stats import EngineStats

    class Engine:
        def stats(self) -> EngineStats:
            return EngineStats(0, 0, 8, 8, 0.0, 0, 0, 0, 16, 0, spec_num_drafts=3,
                               spec_num_draft_tokens=11, spec_num_accepted_tokens=7,
                               spec_accepted_per_position=(3, 3, 1))

    collector = EngineStatsCollector(lambda: Engine(), MODEL)  # type: ignore[arg-type,return-value]
    got = {(s.name, s.labels.get("position")): s.value for family in collector.collect()
           for s in family.samples}
    assert got["pdmesh:spec_decode_num_drafts_total", None] == 3
    assert got["pdmesh:spec_decode_num_draft_tokens_total", None] == 11
    assert got["pdmesh:spec_decode_num_accepted_tokens_total", None] == 7
    per_pos = "pdmesh:spec_decode_num_accepted_tokens_per_pos_total"
    assert [got[per_pos, str(i)] for i in range(3)] == [3, 3, 1]


def test_lent_threads_are_on_metrics() -> None:
    """A worker in a core share (shared/engine/core_share.py) shows the threads its last step
    ran on and how many steps ran on threads a sibling lent."""
    from services.worker.metrics import EngineStatsCollector
    from shared.engine.stats import EngineStats

    class Engine:
        def stats(self) -> EngineStats:
            return EngineStats(1, 0, 8, 8, 0.0, 0, 0, 0, 16, 0, num_threads=2,
                               num_borrowed_thread_steps=5)

    collector = EngineStatsCollector(lambda: Engine(), MODEL)  # type: ignore[arg-type,return-value]
    got = {s.name: s.value for family in collector.collect() for s in family.samples}
    assert got["pdmesh:engine_threads"] == 2
    assert got["pdmesh:engine_borrowed_thread_steps_total"] == 5
