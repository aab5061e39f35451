"""One output channel's streamed text (content or reasoning), trimmed at its edges.

Models pad structure with whitespace: `<think>\n...\n</think>\n\n`, a newline after each
`</tool_call>`. Left in, a reply that only called tools would carry content "\n" instead of
null. So each channel drops whitespace at its start and end, and whitespace next to a body
boundary is replaced by one separator; whitespace inside the text is kept verbatim. Trailing
whitespace is therefore held until more text shows it is not the end.
"""

from __future__ import annotations


class TrimmedText:
    """A channel's text with leading and trailing whitespace trimmed as it streams.

    `push` returns what may be released now: leading whitespace (at the start, or after an
    `edge`) is dropped, trailing whitespace is held until non-whitespace text follows. What it
    releases depends only on the concatenation of everything pushed, never on how the text
    was split, and is never retracted.
    """

    def __init__(self) -> None:
        self._ws = ""  # held trailing whitespace: released only in front of more text
        self._started = False  # any non-whitespace text released yet
        self._at_edge = True  # leading whitespace is dropped here

    def push(self, text: str) -> str:
        if self._at_edge:
            text = text.lstrip()
            if not text:
                return ""
            self._at_edge = False
        core = text.rstrip()
        if not core:
            self._ws += text
            return ""
        released = self._ws + core
        self._ws = text[len(core):]
        self._started = True
        return released

    def edge(self, separator: str) -> None:
        """A body of this channel ended here: the whitespace on both sides of the boundary
        becomes `separator`, released only if more text follows on this channel."""
        self._ws = separator if self._started else ""
        self._at_edge = True
