"""Continuous-batching scheduler: which requests compute how many tokens this step.

Per step, under `max_num_seqs` running requests and `max_num_batched_tokens` tokens:
1. running decodes (one token each) first, then running partial prefills, in arrival order;
2. then waiting requests from the front of the queue (prefix-cache hit first), unless a
   preemption happened this step.
With chunked prefill a prompt that does not fit the remaining budget is cut to fit; without
it, it waits for a step with room. When blocks run out the most recently arrived running
request is preempted by recompute: its blocks are freed, num_computed_tokens goes back to 0
and it returns to the front of the waiting queue (it may be the request being scheduled).
Speculative decoding (a Drafter given): in a step with at most disable_by_batch_size running
requests, a running decode may get a draft (shared.engine.spec); it is then scheduled for
1 + len(draft) tokens, which count against the budget and get KV slots (no slots, or no
budget: no draft, never a preemption for a draft). After the step the verified tokens are
appended and num_computed_tokens / block_table are rolled back past the last accepted one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from shared.engine.block_manager import KVCacheManager
from shared.engine.outputs import TokenLogprob
from shared.engine.request import Request, RequestStatus
from shared.engine.spec.drafter import Drafter
from shared.engine.spec.verify import accepted_tokens


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work, aligned lists in packing order (tokens are packed sequence-major).

    num_computed_tokens is each request's value before the step; `samples[i]` says whether
    the step reaches the end of request i's known tokens and so samples a new token.
    draft_token_ids (empty: no request speculates) holds each request's speculative draft:
    its num_scheduled_tokens then counts 1 + len(draft), the draft tokens being computed
    after the known ones, and the step samples the target at each of those 1 + len(draft)
    positions.
    """

    requests: list[Request]
    num_scheduled_tokens: list[int]
    num_computed_tokens: list[int]
    samples: list[bool]
    draft_token_ids: tuple[list[int], ...] = ()

    def draft(self, i: int) -> list[int]:
        return self.draft_token_ids[i] if self.draft_token_ids else []

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    """Owns the waiting queue and running list; all calls come from the engine thread."""

    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, drafter: Drafter | None = None) -> None:
        self.kv = kv
        self.drafter = drafter  # None: no speculative decoding
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
        if self.drafter is not None:
            self.drafter.release(request_id)
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
        drafting = self.drafter is not None and self.drafter.enabled(len(self.running))
        drafts: dict[Request, list[int]] = {}
        room = self._draft_room() if drafting else 0  # draft tokens this step may still take
        speculating = drafting and room > 0
        if self.drafter is not None and (speculating or self.drafter.proposer is not None):
            decodes = [r for r in ordered if r.num_tokens - r.num_computed_tokens == 1]
            if speculating:
                self.drafter.prepare(decodes)
            else:  # only a proposer (draft model) keeps track of who was passed over
                self.drafter.pass_over(decodes)
        for req in ordered:
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._fit(req.num_tokens - req.num_computed_tokens, budget)
            if n == 0:
                continue
            draft = self._draft(req, min(budget - n, room)) if drafting and n == 1 else []
            if draft and self.kv.allocate_slots(req, n + len(draft)):
                drafts[req] = draft  # KV short: no draft (the plain path below may preempt)
                scheduled[req] = n + len(draft)
                budget -= n + len(draft)
                room -= len(draft)
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
        # A preempted request may still be in drafts: only scheduled ones are kept.
        draft_ids = tuple(drafts.get(r, []) for r in reqs) if drafts else ()
        lens = [len(d) for d in draft_ids] if draft_ids else [0] * len(reqs)
        return ScheduledBatch(
            requests=reqs, num_scheduled_tokens=counts, num_computed_tokens=computed,
            samples=[c + n - d == r.num_tokens
                     for r, c, n, d in zip(reqs, computed, counts, lens, strict=True)],
            draft_token_ids=draft_ids,
        )

    def _draft_room(self) -> int:
        """Draft tokens a step may hold: its decode rows plus drafts stay within the drafter's
        max_step_rows (the rows the bf16 kernels compute one by one, see Drafter)."""
        assert self.drafter is not None
        decodes = sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        return self.drafter.max_step_rows - decodes

    def _draft(self, req: Request, budget: int) -> list[int]:
        """A running decode's draft, cut to the token budget left after its own token."""
        assert self.drafter is not None
        if budget < 1:
            return []
        return self.drafter.propose(req, budget)

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
                           logprobs: list[TokenLogprob | None],
                           draft_samples: Sequence[list[int]] = ()) -> list[Request]:
        """Advance num_computed_tokens, register newly full blocks, append sampled tokens
        (and their logprobs to request.pending_logprobs). draft_samples[i] (a speculating
        request): the target's samples at its 1 + len(draft) positions.

        Returns the requests that received a token, in batch order.
        """
        updated = []
        for i, (req, n, token, lp) in enumerate(zip(
                batch.requests, batch.num_scheduled_tokens, sampled, logprobs, strict=True)):
            if req.status != RequestStatus.RUNNING:
                continue
            draft = batch.draft(i)
            if draft and token is not None:
                self._accept(req, n, draft, draft_samples[i])
                updated.append(req)
                continue
            req.num_computed_tokens += n
            self.kv.cache_computed_blocks(req)
            if token is not None:
                req.append_output_token(token)
                if lp is not None:
                    req.pending_logprobs.append(lp)
                updated.append(req)
        return updated

    def _accept(self, req: Request, n: int, draft: list[int], samples: list[int]) -> None:
        """Append a verified draft's tokens and roll back the KV of the rejected ones.

        Tokens are appended before the blocks are registered: a block's prefix-cache key is
        read from all_token_ids, and num_computed_tokens (hence the blocks registered) stops at
        the last accepted draft token, so a rejected token's KV is never cached nor kept.
        """
        tokens = accepted_tokens(draft, samples)
        for t in tokens:
            req.append_output_token(t)
        req.num_computed_tokens += n - len(draft) + len(tokens) - 1
        self.kv.trim(req)
        self.kv.cache_computed_blocks(req)
        assert self.drafter is not None
        self.drafter.record(req, len(draft), len(tokens) - 1)
