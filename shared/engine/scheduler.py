"""Continuous-batching scheduler: which requests compute how many tokens this step.

Per step, under `max_num_seqs` running requests and `max_num_batched_tokens` tokens:
1. running decodes (one token each) first, then running partial prefills, in arrival order;
2. then waiting requests from the front of the queue (prefix-cache hit first), unless a
   preemption happened this step.
With chunked prefill a prompt that does not fit the remaining budget is cut to fit; without
it, it waits for a step with room. When blocks run out the most recently arrived running
request is preempted by recompute: its blocks are freed, num_computed_tokens goes back to 0
and it returns to the front of the waiting queue (it may be the request being scheduled).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from shared.engine.block_manager import KVCacheManager
from shared.engine.outputs import TokenLogprob
from shared.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work, aligned lists in packing order (tokens are packed sequence-major).

    num_computed_tokens is each request's value before the step; `samples[i]` says whether
    the step reaches the end of request i's known tokens and so samples a new token.
    """

    requests: list[Request]
    num_scheduled_tokens: list[int]
    num_computed_tokens: list[int]
    samples: list[bool]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    """Owns the waiting queue and running list; all calls come from the engine thread."""

    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- request set ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Remove a request in any state and free (or hold) its blocks at once."""
        assert status.is_finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:  # identity (Request has eq=False)
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        scheduled: dict[Request, int] = {}
        budget = self.max_num_batched_tokens
        # Decodes before partial prefills, each group in arrival order.
        ordered = sorted(self.running,
                         key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, r.arrival_seq))
        preempted = False
        for req in ordered:
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._fit(req.num_tokens - req.num_computed_tokens, budget)
            if n == 0:
                continue
            while not self.kv.allocate_slots(req, n):
                victim = max(self.running, key=lambda r: r.arrival_seq)
                budget += self._preempt(victim, scheduled)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled[req] = n
                budget -= n
        if not preempted:
            budget = self._admit_waiting(scheduled, budget)
        reqs = list(scheduled)
        computed = [r.num_computed_tokens for r in reqs]
        counts = list(scheduled.values())
        return ScheduledBatch(
            requests=reqs, num_scheduled_tokens=counts, num_computed_tokens=computed,
            samples=[c + n == r.num_tokens for r, c, n in zip(reqs, computed, counts, strict=True)],
        )

    def _fit(self, num_new: int, budget: int) -> int:
        """Tokens to schedule for a request wanting num_new, 0 if it cannot run now."""
        if self.enable_chunked_prefill:
            return max(min(num_new, budget), 0)
        return num_new if num_new <= budget else 0

    def _preempt(self, victim: Request, scheduled: dict[Request, int]) -> int:
        """Preempt by recompute; returns the tokens given back to this step's budget."""
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        return scheduled.pop(victim, 0)

    def _admit_waiting(self, scheduled: dict[Request, int], budget: int) -> int:
        parked: list[Request] = []  # WAITING_FOR_REMOTE_KV requests keep their place
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                parked.append(self.waiting.popleft())
                continue
            computed = self.kv.get_computed_blocks(req)
            n = self._fit(req.num_tokens - req.num_computed_tokens - computed.num_tokens, budget)
            if n == 0 or not self.kv.allocate_slots(req, n, computed):
                break
            self.waiting.popleft()
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = computed.num_tokens
            req.num_computed_tokens += computed.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req] = n
            budget -= n
        self.waiting.extendleft(reversed(parked))
        return budget

    # ---- results -------------------------------------------------------------------------
    def update_from_output(self, batch: ScheduledBatch, sampled: list[int | None],
                           logprobs: list[TokenLogprob | None]) -> list[Request]:
        """Advance num_computed_tokens, register newly full blocks, append sampled tokens
        (and their logprobs to request.pending_logprobs).

        Returns the requests that received a token, in batch order.
        """
        updated = []
        for req, n, token, lp in zip(batch.requests, batch.num_scheduled_tokens, sampled,
                                     logprobs, strict=True):
            if req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += n
            self.kv.cache_computed_blocks(req)
            if token is not None:
                req.append_output_token(token)
                if lp is not None:
                    req.pending_logprobs.append(lp)
                updated.append(req)
        return updated
