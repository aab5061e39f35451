"""Where a bracketed value (a JSON object or array, a Python list literal) ends, in a stream.

Decoding a partial JSON text on every delta (what upstream parsers do) costs the whole text
each step; this scanner instead keeps its state (depth, open string, pending escape) between
deltas and looks at each character once, jumping between the characters that matter with a
regex. The value is decoded once, when the scanner says it closed.
"""

from __future__ import annotations

import re

_OPENERS = "([{"
_CLOSERS = ")]}"


class BracketScanner:
    """Tracks bracket depth outside string literals across deltas.

    `quotes` are the string delimiters (JSON: `"`; Python: `"` and `'`); a backslash escapes
    the next character inside a string. All three bracket kinds count alike: the scanner only
    finds the end; whether the brackets match is for the decoder to say.
    """

    def __init__(self, quotes: str = '"') -> None:
        self._quotes = quotes
        self._outside = re.compile("[" + re.escape(_OPENERS + _CLOSERS + quotes) + "]")
        self._inside = {q: re.compile(r"[\\" + re.escape(q) + "]") for q in quotes}
        self._depth = 0
        self._quote: str | None = None  # the delimiter of the string we are in
        self._escape = False  # the previous delta ended on a backslash inside a string

    def feed(self, text: str) -> int:
        """Scan the next piece; returns the index in `text` just past the bracket that closes
        the outermost one, or -1 while it is still open."""
        i, n = 0, len(text)
        if self._escape and n:
            self._escape, i = False, 1
        while i < n:
            if self._quote is not None:
                match = self._inside[self._quote].search(text, i)
                if match is None:
                    return -1
                i = match.end()
                if match.group() == "\\":
                    if i >= n:
                        self._escape = True
                        return -1
                    i += 1
                else:
                    self._quote = None
                continue
            match = self._outside.search(text, i)
            if match is None:
                return -1
            char, i = match.group(), match.end()
            if char in self._quotes:
                self._quote = char
            elif char in _OPENERS:
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth <= 0:
                    return i
        return -1
