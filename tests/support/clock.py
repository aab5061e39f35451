"""An injectable clock for code that takes `clock: Callable[[], float]` (default
time.monotonic): tests move time forward instead of sleeping on the wall clock."""

from __future__ import annotations


class FakeClock:
    """Monotonic seconds that only move when the test says so (`advance`, or set `now`)."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a monotonic clock never goes back")
        self.now += seconds
