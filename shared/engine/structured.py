"""Structured output in the engine: each request's grammar state, and the batch's token mask.

`StructuredOutputRequest` is the one owner of a request's grammar state (`Request.structured`),
in an explicit `GrammarPhase`. It moves only when a token is appended to the request's output
(`Request.append_output_token`, so the sampled tokens of the update stage and the first token
a prefill worker sampled advance it alike), and when the engine activates it after reasoning.

Per step, `GrammarMask.fill` asks each ACTIVE request's matcher for its allowed next tokens
(a bitmask [R, W] int32, W = ceil(tokenizer vocab / 32)); the sampler applies it to the logits
before anything else picks a token. Columns past the tokenizer's vocabulary (a padded LM head)
are masked off for those rows. Steps whose batch has no ACTIVE grammar build no mask at all.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np
import torch

from shared.engine.structured_spec import StructuredOutputSpec

if TYPE_CHECKING:
    from shared.engine.grammar import GrammarMatcher

assert sys.byteorder == "little", "bitmask unpacking reads int32 words as little-endian bytes"


class GrammarPhase(Enum):
    """WAITING_FOR_REASONING -> ACTIVE -> FINISHED (complete) or FAILED (a token outside the
    grammar was appended: never one this engine sampled under the mask)."""

    WAITING_FOR_REASONING = "waiting_for_reasoning"
    ACTIVE = "active"
    FINISHED = "finished"
    FAILED = "failed"


class StructuredOutputRequest:
    """The grammar state of one request; lives on the engine thread with its Request."""

    def __init__(self, spec: StructuredOutputSpec, matcher: GrammarMatcher) -> None:
        self.spec = spec
        self.matcher = matcher
        self.phase = (GrammarPhase.WAITING_FOR_REASONING if spec.reasoning_first
                      else GrammarPhase.ACTIVE)
        self.num_accepted = 0  # tokens the matcher consumed (what rollback can undo)
        self.error = ""

    @property
    def needs_mask(self) -> bool:
        return self.phase is GrammarPhase.ACTIVE

    def activate(self) -> None:
        """Reasoning ended: the grammar applies from the next token on (idempotent)."""
        if self.phase is GrammarPhase.WAITING_FOR_REASONING:
            self.phase = GrammarPhase.ACTIVE

    def allows(self, token_id: int) -> bool:
        """Whether appending `token_id` now keeps the output in the grammar."""
        return self.phase is not GrammarPhase.ACTIVE or self.matcher.allows(token_id)

    def advance(self, token_id: int, output_token_ids: list[int]) -> None:
        """`token_id` was just appended (it is the last of `output_token_ids`)."""
        if self.phase is GrammarPhase.WAITING_FOR_REASONING:
            end = self.spec.reasoning_end_ids
            if end and tuple(output_token_ids[-len(end):]) == end:
                self.activate()
            return
        if self.phase is not GrammarPhase.ACTIVE:
            return
        if not self.matcher.accept(token_id):
            self.phase = GrammarPhase.FAILED
            self.error = f"token {token_id} is outside the grammar: {self.matcher.error}"
            return
        self.num_accepted += 1
        if self.matcher.is_finished:
            self.phase = GrammarPhase.FINISHED

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` grammar tokens (rejected speculative tokens)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        if num_tokens == 0:
            return
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens
        if self.phase is GrammarPhase.FINISHED:
            self.phase = GrammarPhase.ACTIVE


@dataclass(frozen=True)
class GrammarMask:
    """The allowed next tokens of the batch rows that have an ACTIVE grammar."""

    rows: list[int]  # batch rows, ascending
    bitmask: torch.Tensor  # [R, W] int32
    vocab_size: int  # tokens the bitmask covers (the tokenizer's)

    @staticmethod
    def fill(constrained: list[tuple[int, StructuredOutputRequest]]) -> GrammarMask:
        """One bitmask row per (batch row, state); every state is ACTIVE."""
        assert constrained
        vocab = constrained[0][1].matcher.vocab_size
        bitmask = torch.zeros(len(constrained), (vocab + 31) // 32, dtype=torch.int32)
        for j, (_, state) in enumerate(constrained):
            assert state.matcher.vocab_size == vocab, "one tokenizer per engine"
            state.matcher.fill_bitmask(bitmask[j])
        return GrammarMask([i for i, _ in constrained], bitmask, vocab)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> a copy with the disallowed tokens of the constrained rows at -inf."""
        return apply_bitmask(logits, self.bitmask, self.rows, self.vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                  vocab_size: int | None = None) -> torch.Tensor:
    """Out of place: rows `rows` of logits [B, V] keep only the tokens their bitmask [R, W]
    allows, and none at or past `vocab_size` (default: all the bitmask covers).

    Cost (benchmarks/grammar_libs.py, V = 49,152, 1 thread): unpacking is ~0.04 ms for 16
    rows; the masked fill itself ~0.1-0.2 ms per constrained row. Unconstrained rows are
    not touched (nor copied twice)."""
    # The negated words unpacked LSB first (little-endian int32 as bytes): column t is 1
    # where token t is NOT allowed.
    banned = torch.from_numpy(np.unpackbits((~bitmask.numpy()).view(np.uint8), axis=1,
                                            bitorder="little")).view(torch.bool)  # [R, 32W]
    width = logits.shape[1]
    limit = min(width, vocab_size if vocab_size is not None else width)
    if banned.shape[1] != width or limit < width:  # padded vocab rows / words past it
        n = min(limit, banned.shape[1])
        full = torch.ones(len(rows), width, dtype=torch.bool)
        full[:, :n] = banned[:, :n]
        banned = full
    if len(rows) == logits.shape[0]:
        return logits.masked_fill(banned, float("-inf"))
    index = torch.tensor(rows)
    return logits.index_put((index,), logits[index].masked_fill_(banned, float("-inf")))
