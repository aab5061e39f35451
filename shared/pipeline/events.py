"""Test and benchmark hooks: stage 0's ordered event log, and a gate on the last stage's sends.

Neither is needed to serve; both default to off. The event log records, in order, what stage 0
did for each microbatch (lane, step id), so a test can check *when* a step's sampled tokens
were awaited and consumed relative to the other microbatches' work, without any wall-clock
threshold. The token gate is a controllable delay: when set, the last stage takes one permit
from it before each token send, so a test decides when tokens may leave.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class EventKind(Enum):
    """Stage 0's milestones for one microbatch, in their normal order."""

    SCHEDULE = "schedule"  # the lane's scheduler picked the step's requests
    PREPARE = "prepare"  # input ids, positions and the wire header are built
    SEND = "send"  # stage 0's layers ran and the hidden states were posted to stage 1
    POST_RECV = "post_recv"  # the receive for the step's sampled tokens was posted
    WAIT_BEGIN = "wait_begin"  # stage 0 starts waiting for those tokens
    ARRIVED = "arrived"  # the wait returned: the tokens are here
    CONSUME = "consume"  # the tokens were appended and the outputs built


@dataclass(frozen=True)
class PipelineEvent:
    kind: EventKind
    lane: int
    step: int  # the pipeline step id (one per microbatch sent)
    time: float  # time.monotonic(), for humans only: tests compare positions, not times


class EventLog:
    """Append-only, thread-safe list of events; `listener(event)` runs on each record."""

    def __init__(self, listener: Callable[[PipelineEvent], None] | None = None) -> None:
        self.events: list[PipelineEvent] = []
        self._lock = threading.Lock()
        self._listener = listener

    def record(self, kind: EventKind, lane: int, step: int) -> None:
        event = PipelineEvent(kind, lane, step, time.monotonic())
        with self._lock:
            self.events.append(event)
        if self._listener is not None:
            self._listener(event)

    def snapshot(self) -> list[PipelineEvent]:
        with self._lock:
            return list(self.events)

    def index(self, kind: EventKind, step: int) -> int:
        """Position of the first `kind` event of `step`; ValueError if absent."""
        for i, event in enumerate(self.snapshot()):
            if event.kind is kind and event.step == step:
                return i
        raise ValueError(f"no {kind.value} event for step {step}")


@dataclass(frozen=True)
class PipelineHooks:
    """Optional instrumentation. `events` stays in stage 0; `token_gate` and `step_gate`
    (semaphores from the spawn context, e.g. `torch.multiprocessing.get_context("spawn")
    .Semaphore(0)`) are handed to the last stage, which takes a `token_gate` permit before
    each token send and a `step_gate` permit before running each step's layers (so a test
    can hold the last stage's KV writes back)."""

    events: EventLog | None = None
    token_gate: Any = field(default=None)
    step_gate: Any = field(default=None)
