"""EngineStats: the engine's load snapshot, as /metrics, /v1/metadata and the router read it.

A module of its own (standard library only) so that the worker's engine protocol and test
doubles can name the type without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics and the router (kv_usage is a 0..1 fraction)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    block_size: int
    num_held_blocks: int
    # Requests failed because the model produced NaN/inf logits (shared/engine/logits_guard.py),
    # and the monotonic time of the latest (None if none since the last clean sampling step).
    num_non_finite_logits: int = 0
    non_finite_logits_at: float | None = None
    # What the engine allocated for the model's tensors and the KV cache (fixed after start;
    # 0 where an engine does not hold them, e.g. a test stand-in).
    weights_bytes: int = 0
    kv_cache_bytes: int = 0
    # Speculative decoding (cumulative, vLLM's spec_decode_* counters; 0 when it is off):
    # steps in which a request got a draft, draft tokens proposed, draft tokens accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()  # [i]: drafts whose token i was accepted
    # Threads of the last step, and steps that ran on threads an idle sibling engine lent
    # (shared/engine/core_share.py; 0 where the engine shares no cores).
    num_threads: int = 0
    num_borrowed_thread_steps: int = 0
