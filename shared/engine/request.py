"""One generation request as the engine tracks it, in the shared token-accounting vocabulary.

Vocabulary (the same words in the scheduler, block manager and runner):
    num_prompt_tokens    tokens of the prompt.
    num_tokens           prompt + generated tokens known so far (`len(all_token_ids)`).
    num_computed_tokens  leading tokens whose KV is in the cache (`block_table` covers them).
    num_scheduled_tokens tokens a step computes on top of num_computed_tokens.
    block_table          cache block ids, block i holding positions [i*bs, (i+1)*bs).
A step that brings num_computed_tokens up to num_tokens yields logits for the last token and
so samples one new token at position num_tokens. Chunked prefill, a prefix-cache hit, a
recompute after preemption and "decode starts from transferred KV" all differ only in the
initial values of num_computed_tokens and block_table.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from shared.engine.outputs import FinishReason, RequestMetrics, TokenLogprob
from shared.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shared.engine.structured import StructuredOutputRequest

_arrival_counter = itertools.count()


class RequestStatus(Enum):
    """Life cycle: WAITING -> RUNNING (<-> PREEMPTED) -> FINISHED_*.

    WAITING_FOR_REMOTE_KV parks a request in the waiting queue (the scheduler skips it)
    until its KV has been received from another worker.
    """

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(frozen=True)
class PrefilledKV:
    """KV computed elsewhere (a prefill worker) and already written into local blocks.

    `block_ids` were obtained from `allocate_blocks` and now belong to the request; they hold
    the KV of the first `num_computed_tokens` prompt tokens. `first_token_id`, when given, is
    the token the prefill side sampled at position num_prompt_tokens: it is appended to the
    output and emitted first, and decoding continues from it.
    """

    block_ids: tuple[int, ...]
    num_computed_tokens: int
    first_token_id: int | None = None
    first_logprob: TokenLogprob | None = None


@dataclass(eq=False)
class Request:
    """Mutable per-request state owned by the engine thread; see the module docstring."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    hold_kv: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first schedule
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    # The grammar state of a request with params.structured (set by the engine on add); every
    # appended output token advances it.
    structured: StructuredOutputRequest | None = None
    # Speculative decoding: draft tokens this request proposed and had accepted (the drafter's
    # per-request off switch reads them).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.block_table: list[int] = []
        # Chained hashes of the full blocks of all_token_ids, grown on demand by the block
        # manager; tokens never change, so they stay valid across preemptions.
        self.block_hashes: list[int] = []
        self.arrival_seq = next(_arrival_counter)  # total order of arrival for preemption
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        # Logprobs of tokens appended outside a sampling step (the prefilled first token).
        self.pending_logprobs: list[TokenLogprob] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.structured is not None:
            self.structured.advance(token_id, self.output_token_ids)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop generated tokens past the first num_output_tokens (tokens after a stop)."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens:]
