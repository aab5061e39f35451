"""Per-step reports of newly computed prompt blocks, for requests whose KV is streamed out.

A push-mode prefill writes a prompt's KV into the decode while the prompt is still being
computed (chunked prefill spreads a long prompt over several steps). The engine cannot know
where the bytes go; it only says, after each step, which full prompt blocks now hold final
KV. `KVStreamTracker` is that component: requests added with `stream_kv=True` are tracked,
and `collect` (called once per step, after the scheduler advanced num_computed_tokens)
returns one `KVProgress` per tracked request whose count of full prompt blocks grew.

Invariants a consumer relies on:
- `block_ids[i]` holds the KV of prompt positions [i*bs, (i+1)*bs); a full block is never
  written again while the request keeps it (the engine only writes at num_computed_tokens+).
- `epoch` is the request's preemption count. A preemption frees the blocks (they may be
  reused and overwritten at once), so a consumer that sees a new epoch must treat every block
  it read under the old epoch as suspect and read the new `block_ids` again from the start.
- The partial last block is never reported (its KV is final only once the prompt finished;
  the consumer takes it from the held blocks then).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.engine.request import Request


@dataclass(frozen=True)
class KVProgress:
    """Full prompt blocks of `request_id` computed so far (all of them, from block 0)."""

    request_id: str
    block_ids: tuple[int, ...]
    epoch: int


class KVStreamTracker:
    """Which streamed requests reported how many full blocks, under which epoch."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._reported: dict[str, tuple[int, int]] = {}  # request id -> (epoch, full blocks)
        self._progress: list[KVProgress] = []

    def track(self, request: Request) -> None:
        self._reported[request.request_id] = (request.num_preemptions, 0)

    def forget(self, request_id: str) -> None:
        self._reported.pop(request_id, None)

    @property
    def num_tracked(self) -> int:
        return len(self._reported)

    def collect(self, requests: Iterable[Request]) -> None:
        """After a step (and after its finished requests were finished): queue a report for
        every tracked request with new full blocks; forget the finished ones (a finished
        prompt is handed off from its held blocks, not from here)."""
        for req in requests:
            seen = self._reported.get(req.request_id)
            if seen is None:
                continue
            epoch, reported = seen
            if req.is_finished:
                if req.num_preemptions != epoch:  # what the consumer read is suspect
                    self._progress.append(KVProgress(req.request_id, (), req.num_preemptions))
                self.forget(req.request_id)
                continue
            if req.num_preemptions != epoch:
                epoch, reported = req.num_preemptions, 0
            full = min(req.num_computed_tokens, req.num_prompt_tokens) // self.block_size
            full = min(full, len(req.block_table))
            if full > reported:
                self._progress.append(KVProgress(req.request_id, tuple(req.block_table[:full]),
                                                 epoch))
                reported = full
            self._reported[req.request_id] = (epoch, reported)

    def take(self) -> list[KVProgress]:
        """The reports queued since the last call, in order."""
        out, self._progress = self._progress, []
        return out
