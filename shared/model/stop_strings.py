"""Stop-string matching over streamed text, without ever retracting streamed output.

Text arrives in deltas (from the incremental detokenizer). A stop string may straddle deltas, so
the checker holds back the longest tail of the text that is a proper prefix of some stop string;
that tail is released once it can no longer become a stop (or at the end of the sequence).

Invariant: the held-back text is the longest suffix of everything fed so far that is a proper
prefix of a stop string. Hence a stop string can never start inside released text (that would make
a longer held suffix), and a match must end inside the newest delta: each `feed` only scans
`held + delta`, O(len(delta) + total stop length).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StopDelta:
    """What one `feed` lets through: `text` is safe to stream; `stop_str` is set when a stop
    string matched (text is then cut before it, or after it with include_stop_str_in_output)."""

    text: str
    stop_str: str | None = None


class StopStringChecker:
    """Finds the first stop string in streamed text and holds back possible stop prefixes.

    "First" means the stop whose match *ends* earliest (ties: the longer one), which is what a
    token-by-token stream would hit first, so the result does not depend on how text is chunked.
    Empty and duplicate stop strings are ignored. After a stop, further input is discarded.
    """

    def __init__(self, stop: Iterable[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        for s in stop:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, got {type(s).__name__}")
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_str: str | None = None  # the stop string that ended the text, once matched
        self._held = ""

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None

    @property
    def held_text(self) -> str:
        """Text received but not yet released (a possible start of a stop string)."""
        return self._held

    def feed(self, new_text: str) -> StopDelta:
        """Add newly decoded text; returns the text that may be streamed now."""
        if self.stop_str is not None:
            return StopDelta("", self.stop_str)
        if not self.stop:
            return StopDelta(new_text)
        buf = self._held + new_text
        match = self._first_match(buf, len(self._held))
        if match is not None:
            pos, stop = match
            self.stop_str, self._held = stop, ""
            end = pos + len(stop) if self.include_stop_str_in_output else pos
            return StopDelta(buf[:end], stop)
        hold = self._holdback(buf)
        self._held = buf[len(buf) - hold:]
        return StopDelta(buf[: len(buf) - hold])

    def flush(self) -> str:
        """End of sequence: nothing more can complete a stop, so release the held text."""
        held, self._held = self._held, ""
        return "" if self.stop_str is not None else held

    def _first_match(self, buf: str, old_len: int) -> tuple[int, str] | None:
        """Earliest-ending stop occurrence in `buf` that ends after `old_len` (in the new text)."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self.stop:
            pos = buf.find(s, max(0, old_len - len(s) + 1))
            if pos >= 0:
                key = (pos + len(s), -len(s), s)
                best = key if best is None or key < best else best
        return None if best is None else (best[0] + best[1], best[2])

    def _holdback(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
