"""The router's Prometheus metrics, in a per-app registry (several routers can share a process).

Names carry the `pdmesh:` prefix; counters are exposed with `_total`. Worker and group gauges
are refreshed after every health round (`observe_registry`); request metrics as requests go.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.task_metrics import AsyncioTaskCollector
from services.router.disagg_threshold import DisaggThreshold
from services.router.pairing import Decision
from services.router.registry import WorkerRegistry
from shared.protocol.pd import Role

# vLLM's TTFT buckets (seconds), cut at 160 s.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


_COST_INPUTS = ("prefill_s_per_token", "prefill_overhead_s", "transfer_s_per_token",
                "decode_batch")


def _reader(threshold: DisaggThreshold, name: str) -> Callable[[], float]:
    """A scrape-time reader of one input of the threshold's estimate (NaN: not measured)."""
    def read() -> float:
        value = getattr(threshold.estimate, name)
        return float("nan") if value is None else float(value)

    return read


class RouterMetrics:
    """All router metrics; one instance per app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("pdmesh:router_requests", "Client requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.decisions = Counter("pdmesh:disagg_decision", "Disaggregation decisions",
                                 ["decision"], registry=r)
        self.single_worker = Counter("pdmesh:router_single_worker_requests",
                                     "Requests served whole on one worker because no P/D leg "
                                     "serves them, by reason (n, prompts) and worker role",
                                     ["reason", "role"], registry=r)
        self.early_first_tokens = Counter(
            "pdmesh:router_early_first_tokens", "Streams whose first token the router sent from "
            "the prefill's answer, before the decode leg answered", registry=r)
        self.retries = Counter("pdmesh:router_retries", "Re-dispatches after a failed leg",
                               ["leg"], registry=r)
        self.upstream_failures = Counter("pdmesh:router_upstream_failures",
                                         "Failed worker calls", ["leg", "status"], registry=r)
        self.migrations = Counter("pdmesh:router_migrations",
                                  "Streams continued on another decode after theirs failed "
                                  "mid-stream, by reason (disconnect, error_event, stall)",
                                  ["reason"], registry=r)
        self.disconnects = Counter("pdmesh:router_client_disconnects",
                                   "Client disconnects that aborted both legs", registry=r)
        self.lease_releases = Counter("pdmesh:router_lease_releases",
                                      "Pull leases ended early through the prefill's "
                                      "kv_transfer/abort, by result", ["result"], registry=r)
        self.ttft = Histogram("pdmesh:router_time_to_first_token_seconds",
                              "Router arrival to first token", buckets=_TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("pdmesh:router_e2e_request_latency_seconds",
                             "Router arrival to last byte", buckets=_E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("pdmesh:router_queue_time_seconds", "Admission wait",
                                    buckets=_TTFT_BUCKETS, registry=r)
        self.prefill_time = Histogram("pdmesh:router_prefill_leg_seconds", "Prefill leg",
                                      buckets=_TTFT_BUCKETS, registry=r)
        self.queue_depth = Gauge("pdmesh:router_queue_depth", "Requests waiting for a slot",
                                 registry=r)
        self.inflight = Gauge("pdmesh:router_inflight_requests", "Requests being dispatched",
                              registry=r)
        self.workers = Gauge("pdmesh:router_workers", "Registered workers",
                             ["role", "health"], registry=r)
        self.breaker = Gauge("pdmesh:router_worker_breaker_state",
                             "Circuit breaker (0 closed, 1 half-open, 2 open)", ["worker"],
                             registry=r)
        self.groups = Gauge("pdmesh:router_groups", "Compatibility groups", ["servable"],
                            registry=r)
        self.disagg_threshold = Gauge("pdmesh:disagg_threshold_tokens",
                                      "Prompts with fewer tokens are served whole by a decode "
                                      "worker (fixed, or learned with --disagg-min-tokens auto)",
                                      registry=r)
        self.disagg_inputs = Gauge("pdmesh:disagg_cost_input",
                                   "Inputs of the learned threshold (disagg_threshold.py): "
                                   "prefill_s_per_token, prefill_overhead_s, "
                                   "transfer_s_per_token, decode_batch (NaN: not measured)",
                                   ["input"], registry=r)
        r.register(AsyncioTaskCollector())

    def watch_threshold(self, threshold: DisaggThreshold) -> None:
        """Read the threshold (and, when learned, its inputs) at every scrape."""
        self.disagg_threshold.set_function(lambda: threshold.tokens)
        if not threshold.auto:
            return
        for name in _COST_INPUTS:
            self.disagg_inputs.labels(name).set_function(_reader(threshold, name))

    def observe_decision(self, decision: Decision, whole: str | None, role: Role | None) -> str:
        """Count a request's routing decision (its first attempt); `whole` is why it is served
        whole on one worker, if it must be. Returns the target's role label."""
        self.decisions.labels(decision.value).inc()
        label = role.value if role is not None else "unknown"
        if whole is not None:
            self.single_worker.labels(whole, label).inc()
        return label

    def observe_registry(self, registry: WorkerRegistry) -> None:
        self.workers.clear()
        self.breaker.clear()
        for w in registry.all():
            role = w.role.value if w.role else "unknown"
            self.workers.labels(role, w.health.value).inc()
            self.breaker.labels(w.id).set(w.breaker.state.gauge)
        groups = registry.groups()
        servable = sum(g.servable for g in groups)
        self.groups.labels("true").set(servable)
        self.groups.labels("false").set(len(groups) - servable)
