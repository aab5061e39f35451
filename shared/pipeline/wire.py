"""What travels between stages: the per-step header, mirror updates and sampled tokens.

Forward, stage i -> i+1 (one message per microbatch, FIFO, tag FORWARD):
    preamble int64[5] = [kind, lane, header_len, num_tokens T, blob_len]
    header   int64[header_len]  (StepHeader.encode)
    hidden   [T, hidden_size] in the model dtype
    blob     uint8[blob_len], only when blob_len > 0 (pickled MirrorUpdate for the last stage)
Back, last stage -> stage 0 (tag TOKENS_BASE + lane; at most one outstanding per lane):
    int64[S] sampled token ids, or, when some sampling row asked for logprobs,
    float64[S, 2 + 2K] = [token id, its logprob, K top ids, K top logprobs] (K = widest ask).
S is the number of rows that sample (`StepHeader.num_samples`). Both ends derive S and K from
data they already share, so a step with S == 0 posts no token message on either side.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from shared.engine.outputs import TokenLogprob
from shared.engine.sampling_params import SamplingParams

PREAMBLE_LEN = 5
TAG_FORWARD = 1
TAG_TOKENS_BASE = 16  # + lane


class MessageKind(IntEnum):
    BATCH = 1
    SHUTDOWN = 2


@dataclass(frozen=True)
class StepHeader:
    """One microbatch as every stage needs it: enough to build AttentionMetadata and write
    this stage's layers' KV. Aligned per-row lists; slots name requests to the last stage."""

    step_id: int
    lane: int
    slots: list[int]
    num_computed: list[int]
    num_scheduled: list[int]
    samples: list[bool]
    block_tables: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled)

    @property
    def num_samples(self) -> int:
        return sum(self.samples)

    def encode(self) -> torch.Tensor:
        """int64[3 + 5B + sum(table lengths)]: step, lane, B, then per-row columns, tables."""
        flat = [self.step_id, self.lane, len(self.slots), *self.slots, *self.num_computed,
                *self.num_scheduled, *(int(s) for s in self.samples),
                *(len(t) for t in self.block_tables)]
        for table in self.block_tables:
            flat.extend(table)
        return torch.tensor(flat, dtype=torch.int64)

    @staticmethod
    def decode(data: torch.Tensor) -> StepHeader:
        values = data.tolist()
        step_id, lane, b = values[:3]
        cols = [values[3 + i * b: 3 + (i + 1) * b] for i in range(5)]
        tables, pos = [], 3 + 5 * b
        for length in cols[4]:
            tables.append(values[pos:pos + length])
            pos += length
        assert pos == len(values), "malformed step header"
        return StepHeader(step_id, lane, cols[0], cols[1], cols[2], [bool(s) for s in cols[3]],
                          tables)


@dataclass(frozen=True)
class RequestRecord:
    """What the last stage's sampler needs of a request it has not seen yet."""

    slot: int
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty for a request that starts from remote KV
    params: SamplingParams
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class MirrorUpdate:
    """New requests (first step that includes them) and finished slots to forget."""

    records: list[RequestRecord] = field(default_factory=list)
    released: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.records or self.released)

    def encode(self) -> bytes:
        # pickle: both ends are processes of the same worker, started by stage 0.
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL) if self else b""

    @staticmethod
    def decode(blob: bytes) -> MirrorUpdate:
        return pickle.loads(blob) if blob else MirrorUpdate()


@dataclass(frozen=True)
class TokenSpec:
    """Shape of one step's token message, derived from the sampling rows' `logprobs` asks."""

    num_rows: int
    widths: tuple[int | None, ...]  # per sampling row: SamplingParams.logprobs

    @property
    def with_logprobs(self) -> bool:
        return any(w is not None for w in self.widths)

    @property
    def top_k(self) -> int:
        return max((w or 0 for w in self.widths), default=0)

    def empty(self) -> torch.Tensor:
        if self.with_logprobs:
            return torch.empty(self.num_rows, 2 + 2 * self.top_k, dtype=torch.float64)
        return torch.empty(self.num_rows, dtype=torch.int64)

    def pack(self, token_ids: list[int], logprobs: list[TokenLogprob | None] | None,
             ) -> torch.Tensor:
        if not self.with_logprobs:
            return torch.tensor(token_ids, dtype=torch.int64)
        k = self.top_k
        out = torch.full((self.num_rows, 2 + 2 * k), float("nan"), dtype=torch.float64)
        out[:, 0] = torch.tensor(token_ids, dtype=torch.float64)
        for row, lp in enumerate(logprobs or []):
            if lp is None:
                continue
            out[row, 1] = lp.logprob
            ids, vals = list(lp.top), list(lp.top.values())
            out[row, 2:2 + len(ids)] = torch.tensor(ids, dtype=torch.float64)
            out[row, 2 + k:2 + k + len(vals)] = torch.tensor(vals, dtype=torch.float64)
        return out

    def unpack(self, data: torch.Tensor) -> tuple[list[int], list[TokenLogprob | None]]:
        if not self.with_logprobs:
            return data.tolist(), [None] * self.num_rows
        k, rows = self.top_k, data.tolist()
        tokens = [int(r[0]) for r in rows]
        logprobs: list[TokenLogprob | None] = []
        for r, width, token in zip(rows, self.widths, tokens, strict=True):
            if width is None:
                logprobs.append(None)
                continue
            top = {int(i): v for i, v in zip(r[2:2 + width], r[2 + k:2 + k + width], strict=True)}
            logprobs.append(TokenLogprob(token_id=token, logprob=r[1], top=top))
        return tokens, logprobs
