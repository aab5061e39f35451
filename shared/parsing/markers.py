"""Finding structural markers (`<tool_call>`, `<|eom|>`, `[TOOL_CALLS]`...) in streamed text.

A marker may straddle deltas, so the splitter holds back the longest tail of the text that is
a proper prefix of some marker and releases it once it can no longer become one. Invariant
(as in shared/model/stop_strings.py): the held text is that longest tail, so a marker can
never start inside released text, and each `feed` scans only `held + delta`: O(len(delta)).
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def partial_suffix_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    longest = max((len(m) for m in markers), default=1) - 1
    firsts = {m[0] for m in markers if m}
    for k in range(min(len(text), longest), 0, -1):
        if text[-k] not in firsts:  # cheap filter: most positions cannot start a marker
            continue
        tail = text[-k:]
        if any(len(m) > k and m.startswith(tail) for m in markers):
            return k
    return 0


def dropped_at_end(held: str) -> bool:
    """Whether a partial marker left at the end of the stream is dropped rather than released.

    Two or more characters of a marker (`<tool_c`, `<|eo`, `[TOOL`) are a structure cut off by
    the length limit: protocol, not prose, so they never reach the client (vLLM #55395 leaked
    these). A single `<` or `[` is far likelier to be the text's own last character."""
    return len(held) >= 2


class MarkerSplitter:
    """Splits a stream into text and the markers between it, never splitting a marker.

    `feed` returns `(text, marker)` pairs in order: `text` is released text up to `marker`, the
    marker that followed it; the last pair of a feed may have `marker=None` (text with no
    marker after it yet). Markers that are prefixes of others are matched longest first.
    """

    def __init__(self, markers: Sequence[str]) -> None:
        if not markers or any(not m for m in markers):
            raise ValueError("markers must be non-empty strings")
        self.markers = tuple(markers)
        alternatives = sorted(self.markers, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(m) for m in alternatives))
        self._held = ""

    @property
    def held(self) -> str:
        """Text received but not released: a possible start of a marker."""
        return self._held

    def feed(self, delta: str) -> list[tuple[str, str | None]]:
        buf = self._held + delta
        pieces: list[tuple[str, str | None]] = []
        pos = 0
        for match in self._pattern.finditer(buf):
            pieces.append((buf[pos:match.start()], match.group()))
            pos = match.end()
        rest = buf[pos:]
        keep = partial_suffix_len(rest, self.markers)
        self._held = rest[len(rest) - keep:]
        if len(rest) > keep:
            pieces.append((rest[:len(rest) - keep], None))
        return pieces

    def finish(self) -> str:
        """End of stream: the held tail, released as text unless it is dropped (see
        `dropped_at_end`)."""
        held, self._held = self._held, ""
        return "" if dropped_at_end(held) else held


def cut_at(buf: str, markers: Sequence[str]) -> tuple[str, str | None, str]:
    """`buf` split at its earliest marker: (text before, the marker, text after). With no
    marker in it: (the text that cannot start one, None, the held tail that might)."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = buf.find(marker)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, marker)
    if best is not None:
        at, marker = best
        return buf[:at], marker, buf[at + len(marker):]
    keep = partial_suffix_len(buf, markers)
    return buf[:len(buf) - keep], None, buf[len(buf) - keep:]
