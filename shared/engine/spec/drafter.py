"""Drafter: which running decodes speculate this step, with which draft, and the counters.

The scheduler asks it once per step (`enabled`) and once per decode (`propose`). A request
speculates only where the verifier can reproduce, at every drafted position, exactly what
sampling one token at a time would do. Requests that use any of the following never
speculate (they decode one token per step as before):
- repetition / presence / frequency penalties (they depend on the tokens before each
  position, which differ inside a draft);
- min_tokens not yet reached (the EOS / stop-id ban changes inside the draft);
- structured output (the grammar state advances token by token);
- logprobs (kept exact and simple: one sampled position per step).
A request whose acceptance stays below min_acceptance_rate over its first acceptance_window
draft tokens stops speculating for good (it would only pay for verifying rejected tokens).
With a draft model, a request that has decoded a step without drafts (in a batch above
disable_by_batch_size, or with no room left) never starts: the draft learns a request's
context by prefilling it (its shadow's catch-up), and a late start would have the draft
prefill the prompt and every output so far for the few tokens left. At 16
concurrent grounded asks that catch-up cost 15% of aggregate throughput (AMD Zen 4, MXFP4
self-draft: 0.85x speculation off), for 64 draft tokens.
A draft is capped so that the accepted tokens plus the bonus token stay within max_tokens and
the context length: no KV is computed for positions a request can never keep. The scheduler
also cuts a step's drafts so that its decode rows plus draft tokens stay within
MAX_STEP_ROWS (below).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from shared.engine.request import Request
from shared.engine.spec.ngram import propose_ngram
from shared.speculative_config import SpeculativeConfig

# Decode rows plus draft tokens per step at most: kernels.dense.backend.MAX_ROWS, the most rows
# the bf16 GEMV takes (more go to torch's GEMM, whose rows are not computed as one row alone
# is). Within it a verify row gets the bits of one-row decode, so greedy output with
# speculation equals speculation off (tests/engine/test_spec_bf16_exact.py).
MAX_STEP_ROWS = 32


@dataclass
class SpecDecodeStats:
    """Cumulative counters, as vLLM's spec_decode_* metrics: drafts (requests that got a
    non-empty draft in a step), draft tokens proposed, and draft tokens accepted, in all and
    per draft position (accepted_per_position[i]: drafts whose token i was accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Proposer(Protocol):
    """A model-based proposer (shared.engine.spec.draft_model); n-gram needs none."""

    def propose_batch(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]: ...

    def release(self, request_id: str) -> None: ...

    def tracks(self, request_id: str) -> bool:
        """Whether the proposer holds draft state (a caught-up context) for the request."""
        ...


class Drafter:
    """The proposal policy over one engine's requests (engine thread only): n-gram lookup, or
    `proposer` (a draft model) when given."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 proposer: Proposer | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer
        self._prepared: dict[str, list[int]] = {}  # this step's proposer drafts, by request
        self._passed: set[str] = set()  # decoded a step without drafting (a proposer's only)
        self.stats = self.new_stats()
        self.max_step_rows = MAX_STEP_ROWS

    def new_stats(self) -> SpecDecodeStats:
        """Zeroed counters, one per draft position (vLLM exports every position, zeros too)."""
        return SpecDecodeStats(accepted_per_position=[0] * self.config.num_speculative_tokens)

    @property
    def max_draft_len(self) -> int:
        return self.config.num_speculative_tokens

    def enabled(self, num_running: int) -> bool:
        """Whether this step speculates at all (a small batch: see disable_by_batch_size)."""
        return num_running <= self.config.disable_by_batch_size

    def prepare(self, decodes: list[Request]) -> None:
        """Once per speculating step, before `propose`: a proposer drafts for every decode of
        the step at once (a draft model runs one batched pass per position)."""
        if self.proposer is not None:
            wanted = [(r, self._limit(r, None)) for r in decodes]
            self._prepared = self.proposer.propose_batch([(r, k) for r, k in wanted if k > 0])

    def pass_over(self, decodes: list[Request]) -> None:
        """A step that does not speculate (with a proposer): these decodes, unless it already
        tracks them, may never start (module docstring)."""
        assert self.proposer is not None
        self._passed.update(r.request_id for r in decodes
                            if not self.proposer.tracks(r.request_id))

    def propose(self, request: Request, budget: int | None = None) -> list[int]:
        """Draft tokens for a running decode (num_tokens - num_computed_tokens == 1), at most
        `budget` (the step's room) when given."""
        limit = self._limit(request, budget)
        if limit < 1:
            return []
        if self.proposer is not None:  # drafted by prepare(); the KV of a cut tail is
            return self._prepared.pop(request.request_id, [])[:limit]  # rolled back later
        c = self.config
        return propose_ngram(request.all_token_ids, c.prompt_lookup_min, c.prompt_lookup_max,
                             limit)

    def _limit(self, request: Request, budget: int | None) -> int:
        """Draft tokens the request may get now (0: none)."""
        if not can_speculate(request) or self._below_break_even(request):
            return 0
        if request.request_id in self._passed:
            return 0  # a late start: the draft would prefill the whole context (docstring)
        limit = min(self.config.num_speculative_tokens, self._room(request))
        return limit if budget is None else min(limit, budget)

    def release(self, request_id: str) -> None:
        """A request left the engine: its proposer state goes (a draft model's KV)."""
        self._passed.discard(request_id)
        if self.proposer is not None:
            self.proposer.release(request_id)

    def _room(self, request: Request) -> int:
        """Drafts that can still be kept: one slot goes to the token sampled after them."""
        room = self.max_model_len - request.num_tokens - 1
        max_tokens = request.params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return room

    def _below_break_even(self, request: Request) -> bool:
        """The request's own off switch: enough drafts seen, too few accepted."""
        c = self.config
        return (request.num_draft_tokens >= c.acceptance_window
                and request.num_accepted_tokens < c.min_acceptance_rate * request.num_draft_tokens)

    def record(self, request: Request, num_draft: int, num_accepted: int) -> None:
        request.num_draft_tokens += num_draft
        request.num_accepted_tokens += num_accepted
        if num_draft:
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += num_draft
            self.stats.num_accepted_tokens += num_accepted
            for i in range(num_accepted):  # num_accepted <= num_draft <= K
                self.stats.accepted_per_position[i] += 1


def can_speculate(request: Request) -> bool:
    """False for a request whose sampling is not position-independent (module docstring)."""
    p = request.params
    return (p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and request.num_output_tokens >= p.min_tokens and request.structured is None
            and p.logprobs is None)
