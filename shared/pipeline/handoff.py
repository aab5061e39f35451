"""TokenHandoff: the pending receive of one step's sampled tokens on stage 0, as an awaitable.

The last stage posts its token send and moves on; stage 0 posts the matching receive when it
sends the step and wraps it here. The handoff is consumed exactly once, where that lane's
next input ids are prepared: `wait()` on the engine thread, or `await handoff` from asyncio
(the blocking wait then runs on an executor thread, so the event loop never blocks).
The ledger holds every handoff not yet consumed; after an abort, a preemption or a shutdown
it must be empty (tests check `len(ledger) == 0`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator
from datetime import timedelta
from enum import Enum
from typing import Any, Protocol

import torch

from shared.engine.outputs import TokenLogprob
from shared.pipeline.wire import TokenSpec


class PipelineError(RuntimeError):
    """A stage died, hung past its timeout or broke the protocol; the pipeline is unusable."""


class Work(Protocol):
    """The slice of torch.distributed's Work used here (a fake in unit tests)."""

    def wait(self, timeout: timedelta = ...) -> bool: ...

    def is_completed(self) -> bool: ...


class HandoffState(Enum):
    PENDING = "pending"
    CONSUMED = "consumed"  # waited, tokens delivered (or discarded by a drain)
    FAILED = "failed"  # the wait raised: timeout or a dead peer
    ABANDONED = "abandoned"  # the pipeline died first; the receive is never waited


class HandoffLedger:
    """Every handoff created and not yet consumed, failed or abandoned (thread-safe)."""

    def __init__(self) -> None:
        self._pending: set[TokenHandoff] = set()
        self._lock = threading.Lock()
        self.num_created = 0

    def add(self, handoff: TokenHandoff) -> None:
        with self._lock:
            self._pending.add(handoff)
            self.num_created += 1

    def discard(self, handoff: TokenHandoff) -> None:
        with self._lock:
            self._pending.discard(handoff)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def abandon_all(self) -> None:
        """For a dead pipeline: nothing will ever complete these receives."""
        with self._lock:
            pending, self._pending = self._pending, set()
        for handoff in pending:
            handoff.state = HandoffState.ABANDONED


class TokenHandoff:
    """Sampled tokens of one step (lane, step id) on their way from the last stage.

    `wait()` returns (token ids, logprobs) for the step's sampling rows in batch order;
    it raises PipelineError when the tokens do not arrive within timeout_s (a hung stage)
    or the peer is gone, and RuntimeError when called a second time.
    """

    def __init__(self, work: Work, buffer: torch.Tensor, spec: TokenSpec, *, lane: int,
                 step: int, timeout_s: float, ledger: HandoffLedger) -> None:
        self.lane, self.step = lane, step
        self.state = HandoffState.PENDING
        self._work, self._buffer, self._spec = work, buffer, spec
        self._timeout = timedelta(seconds=timeout_s)
        self._ledger = ledger
        self._lock = threading.Lock()
        ledger.add(self)

    def done(self) -> bool:
        """Whether the tokens have arrived (never blocks)."""
        return self._work.is_completed()

    def wait(self) -> tuple[list[int], list[TokenLogprob | None]]:
        with self._lock:
            if self.state is not HandoffState.PENDING:
                raise RuntimeError(f"token handoff of step {self.step} is {self.state.value}; "
                                   "a handoff is consumed exactly once")
            try:
                self._work.wait(self._timeout)
            except Exception as exc:
                self.state = HandoffState.FAILED
                raise PipelineError(f"sampled tokens of step {self.step} did not arrive: "
                                    f"{exc}") from exc
            finally:
                self._ledger.discard(self)
            self.state = HandoffState.CONSUMED
        return self._spec.unpack(self._buffer)

    def __await__(self) -> Generator[Any, None, tuple[list[int], list[TokenLogprob | None]]]:
        loop = asyncio.get_running_loop()
        return (yield from loop.run_in_executor(None, self.wait).__await__())
