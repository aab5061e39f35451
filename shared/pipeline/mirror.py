"""The sampler's view of requests on the last stage, and stage 0's feed that keeps it current.

Stage 0 owns the requests; the last stage samples. The sampler needs, per row, the request's
params, prompt and output tokens (penalties, min_tokens bans) and its length (the seeded
draw's position). Rather than ship those every step, stage 0 sends a `RequestRecord` the
first time a request is in a step and a release when it finishes; the last stage appends
every token it samples itself. Its copy therefore always equals stage 0's tokens at the time
the step was scheduled (stage 0 only ever appends those same tokens; preemption keeps them;
stop-string truncation only happens to finished requests), so seeded draws match PP=1.
"""

from __future__ import annotations

import torch

from shared.engine.request import Request
from shared.engine.sampler import Sampler, SamplingTensors
from shared.pipeline.wire import MirrorUpdate, RequestRecord, StepHeader, TokenSpec


class MirrorFeed:
    """Stage 0's side: a slot per request, and the pending updates for the last stage."""

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}  # requests the last stage knows
        self._next_slot = 0
        self._released: list[int] = []

    def __len__(self) -> int:
        return len(self._slots)

    def slots(self, requests: list[Request]) -> tuple[list[int], list[RequestRecord]]:
        """Slot of each request, and records for those the last stage has not seen."""
        slots, records = [], []
        for req in requests:
            slot = self._slots.get(req.request_id)
            if slot is None:
                slot = self._slots[req.request_id] = self._next_slot
                self._next_slot += 1
                records.append(RequestRecord(slot, req.request_id, list(req.prompt_token_ids),
                                             list(req.output_token_ids), req.params,
                                             req.eos_token_ids))
            slots.append(slot)
        return slots, records

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._released.append(slot)

    def update(self, records: list[RequestRecord]) -> MirrorUpdate:
        """The update to ship with the next step (and forget the releases it carries)."""
        update = MirrorUpdate(records, self._released)
        self._released = []
        return update


def token_spec(requests: list[Request], samples: list[bool]) -> TokenSpec:
    """Shape of the token message for a step (the same on stage 0 and the last stage)."""
    return TokenSpec(sum(samples), tuple(r.params.logprobs for r, s in
                                         zip(requests, samples, strict=True) if s))


class SamplingMirror:
    """The last stage's requests by slot, and the engine's own Sampler over them."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.sampler = Sampler(seed)
        self.vocab_size = vocab_size
        self.requests: dict[int, Request] = {}

    def apply(self, update: MirrorUpdate) -> None:
        for slot in update.released:
            self.requests.pop(slot, None)
        for rec in update.records:
            req = Request(rec.request_id, rec.prompt_token_ids, rec.params, rec.eos_token_ids)
            for token in rec.output_token_ids:
                req.append_output_token(token)
            self.requests[rec.slot] = req

    def sample(self, header: StepHeader, logits: torch.Tensor) -> tuple[torch.Tensor, TokenSpec]:
        """logits [S, V] fp32 for the sampling rows -> (token message, its spec).

        Appends each sampled token to its request, as stage 0 will once it receives it."""
        batch = [self.requests[slot] for slot in header.slots]
        spec = token_spec(batch, header.samples)
        rows = [req for req, s in zip(batch, header.samples, strict=True) if s]
        out = self.sampler(logits, SamplingTensors.from_requests(rows, logits.shape[1]))
        for req, token in zip(rows, out.token_ids, strict=True):
            req.append_output_token(token)
        return spec.pack(out.token_ids, out.logprobs), spec
