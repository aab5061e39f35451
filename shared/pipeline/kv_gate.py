"""StageKVGate: report a streamed prompt's blocks only once every stage has written them.

A push-mode prefill streams a prompt's full blocks while the prompt still runs (the engine's
`KVStreamTracker`, read after each step). With one process a block is final once the step
that computed it returned. In a pipeline it is not: stage 0 lands a step that samples nothing
(a non-final prefill chunk) without hearing from the later stages, which may still be writing
their layers of those blocks into the shared cache. Reading them then would ship stale layers.

What stage 0 does know: every stage runs steps in launch order (one FIFO channel per hop), so
when the sampled tokens of step S arrive, every stage has finished every step <= S. That step
id is the *watermark*. A request's progress (its num_computed_tokens, advanced when one of its
steps lands) is handed to the tracker only once the step that advanced it is at or below the
watermark; until then it waits here. Finished and aborted requests pass through harmlessly:
the tracker forgets them.

Silent steps are never acknowledged (a step that samples nothing posts no communication), so
the watermark moves only with sampling steps: a lone chunked prompt streams nothing before it
finishes (its blocks then leave from the held blocks, as without streaming), and the overlap
comes from other requests decoding alongside, which is the loaded case it is for.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.engine.kv_stream import KVStreamTracker
from shared.engine.request import Request


class StageKVGate:
    """Holds back KV progress until the steps behind it completed on every stage."""

    def __init__(self, tracker: KVStreamTracker) -> None:
        self.tracker = tracker
        self.watermark = -1  # every step id <= watermark has run on every stage
        self._pending: dict[str, tuple[int, Request]] = {}  # id -> (step that advanced it, req)

    def __len__(self) -> int:
        return len(self._pending)

    def landed(self, step_id: int, requests: Iterable[Request], *, complete: bool) -> None:
        """Step `step_id` landed for `requests`; `complete` when its sampled tokens arrived
        (so it, and every earlier step, ran on every stage). Releases what is now final."""
        for req in requests:
            self._pending[req.request_id] = (step_id, req)
        if complete:
            self.watermark = max(self.watermark, step_id)
        ready = [rid for rid, (step, _) in self._pending.items() if step <= self.watermark]
        if ready:
            self.tracker.collect(self._pending.pop(rid)[1] for rid in ready)

    def clear(self) -> None:
        """Drop everything held (the pipeline failed or closed: nothing will be streamed)."""
        self._pending.clear()
