"""Admission control: a bound on engine sequences in flight, beyond which requests get 429.

The engine itself queues without limit; this bound keeps latency finite under overload and
tells clients (and the router) to back off. It counts sequences, not HTTP requests: an n=4
request takes 4 slots. A request larger than the whole capacity is still admitted when
nothing else is in flight, so no valid request is refused forever.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from services.common.errors import RateLimitError


class AdmissionControl:
    """Counts admitted sequences; used on the event loop thread only."""

    def __init__(self, capacity: int) -> None:
        assert capacity >= 1, "capacity covers at least max_num_seqs >= 1"
        self.capacity = capacity
        self.active = 0

    @contextmanager
    def admit(self, sequences: int) -> Iterator[None]:
        if self.active and self.active + sequences > self.capacity:
            raise RateLimitError(
                f"Server busy: {self.active} sequences in flight (capacity {self.capacity}); retry later",
                headers={"Retry-After": "1"},
            )
        self.active += sequences
        try:
            yield
        finally:
            self.active -= sequences
