"""Prometheus metrics of one worker, named like vLLM's with the `pdmesh:` prefix.

Each app owns its own `CollectorRegistry` (several apps can live in one test process).
Engine-side figures (running/waiting, KV usage, preemptions, prefix-cache counters) are read
from `engine.stats()` at scrape time by `EngineStatsCollector`; request figures (tokens,
finished reasons, latencies) are recorded by `ChoiceTimer` as responses are produced.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.task_metrics import AsyncioTaskCollector
from services.worker.engine_client import EngineClient
from shared.engine.outputs import RequestOutput

PREFIX = "pdmesh:"
# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineStatsCollector(Collector):
    """Gauges and engine-owned counters, read from `engine.stats()` at each scrape."""

    def __init__(self, engine: Callable[[], EngineClient | None], model_name: str) -> None:
        self._engine = engine
        self._model = model_name

    def _families(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        g = [GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"]) for name, doc in (
            ("num_requests_running", "Number of requests in model execution batches."),
            ("num_requests_waiting", "Number of requests waiting to be processed."),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            ("engine_threads", "Threads the engine's last step ran on (with a core share: its "
                               "own plus those lent by idle sibling workers)."))]
        c = [CounterMetricFamily(PREFIX + name, doc, labels=["model_name"]) for name, doc in (
            ("num_preemptions", "Cumulative number of preemptions from the engine."),
            ("prefix_cache_queries", "Prefix-cache queries, in tokens."),
            ("prefix_cache_hits", "Prefix-cache hits, in tokens."),
            ("non_finite_logits", "Requests failed because the model produced NaN or "
                                  "infinite logits."),
            ("spec_decode_num_drafts", "Speculative drafts proposed (a request in a step)."),
            ("spec_decode_num_draft_tokens", "Speculative draft tokens proposed."),
            ("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."),
            ("engine_borrowed_thread_steps", "Engine steps that ran on threads lent by an idle "
                                             "sibling worker (core share)."))]
        return g + c

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        if engine is None:
            return
        s = engine.stats()
        families = self._families()
        values = (s.num_running, s.num_waiting, s.kv_usage, s.num_threads, s.num_preemptions,
                  s.prefix_cache_queries, s.prefix_cache_hits, s.num_non_finite_logits,
                  s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens,
                  s.num_borrowed_thread_steps)
        for family, value in zip(families, values, strict=True):
            family.add_metric([self._model], float(value))
            yield family
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative draft tokens accepted, per position in the draft.",
            labels=["model_name", "position"])
        for i, count in enumerate(s.spec_accepted_per_position):
            per_position.add_metric([self._model, str(i)], float(count))
        yield per_position


class WorkerMetrics:
    """The worker's metric objects, registered in a registry private to one app."""

    def __init__(self, model_name: str, engine: Callable[[], EngineClient | None]) -> None:
        disable_created_metrics()  # process-wide, as vLLM: no `*_created` series
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=self.registry).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=self.registry).labels(model_name)
        self.request_success = Counter(PREFIX + "request_success", "Count of finished requests by reason.",
                                       labels + ["finished_reason"], registry=self.registry)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS).labels(model_name)
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS).labels(model_name)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.",
                             REQUEST_LATENCY_BUCKETS).labels(model_name)
        self.queue = histogram("request_queue_time_seconds", "Time spent waiting in the queue.",
                               REQUEST_LATENCY_BUCKETS).labels(model_name)
        self.prefill = histogram("request_prefill_time_seconds", "Time spent in the prefill phase.",
                                 REQUEST_LATENCY_BUCKETS).labels(model_name)
        self.decode = histogram("request_decode_time_seconds", "Time spent in the decode phase.",
                                REQUEST_LATENCY_BUCKETS).labels(model_name)
        self.registry.register(EngineStatsCollector(engine, model_name))
        self.registry.register(AsyncioTaskCollector())

    def finished(self, reason: str) -> None:
        self.request_success.labels(self.model_name, reason).inc()


class ChoiceTimer:
    """Times one choice from HTTP arrival: TTFT, inter-token gaps, end to end.

    Queue, prefill and decode times come from the engine's own `RequestMetrics` when present
    (they are engine-internal phases); the rest is what the client experiences.
    """

    def __init__(self, metrics: WorkerMetrics, arrival: float, prompt_len: int) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.prompt_len = prompt_len
        self.last_token: float | None = None
        self.done = False

    def on_output(self, out: RequestOutput, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        n = len(out.new_token_ids)
        if n:
            if self.last_token is None:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                gap = (now - self.last_token) / n
                for _ in range(n):
                    self.metrics.itl.observe(gap)
            self.last_token = now
        if out.finished:
            self._finish(out, now)

    def _finish(self, out: RequestOutput, now: float) -> None:
        self.done = True
        m = self.metrics
        m.finished(out.finish_reason.value if out.finish_reason else "stop")
        m.prompt_tokens.inc(self.prompt_len)
        m.generation_tokens.inc(len(out.token_ids))
        m.e2e.observe(now - self.arrival)
        t = out.metrics
        if t is not None and t.first_scheduled_time is not None:
            m.queue.observe(max(0.0, t.first_scheduled_time - t.arrival_time))
            if t.first_token_time is not None:
                m.prefill.observe(max(0.0, t.first_token_time - t.first_scheduled_time))
                last = t.last_token_time or t.first_token_time
                m.decode.observe(max(0.0, last - t.first_token_time))

    def abandoned(self) -> None:
        """The client went away (or the request failed) before the choice finished."""
        if not self.done:
            self.done = True
            self.metrics.finished("abort")
