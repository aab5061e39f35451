"""Llama 3.1 / 3.2 JSON tool calls: `{"name": ..., "parameters": {...}}`.

Meta's model cards (Llama 3.1 "JSON based tool calling", Llama 3.2 "JSON format") have the
model answer with the call object alone, prefixed by `<|python_tag|>` when the system prompt
sets `Environment: ipython`; vLLM's llama3_json template asks for several calls separated by
`;`. `arguments` is accepted in place of `parameters`. A reply that does not open with a call
is plain content, except that a `<|python_tag|>` later in it starts calls there.
"""

from __future__ import annotations

import logging
from enum import Enum

from shared.parsing.base import Emission, ToolParser
from shared.parsing.brackets import BracketScanner
from shared.parsing.hermes import parse_call_object
from shared.parsing.markers import cut_at, dropped_at_end
from shared.parsing.tools import ToolsArg
from shared.parsing.trimmed_text import TrimmedText

logger = logging.getLogger(__name__)

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


class _Phase(Enum):
    START = "start"  # only whitespace or part of `<|python_tag|>` so far
    CONTENT = "content"  # plain text; a `<|python_tag|>` would start calls
    CALLS = "calls"  # between call objects: separators, the next `{`, or the end
    OBJECT = "object"  # inside a call object


class Llama3JsonToolParser(ToolParser):
    """JSON call objects at the start of the reply (or after `<|python_tag|>`), `;`-separated;
    registered as llama3_json.

    Per step O(len(delta)): an open object is tracked by a BracketScanner and kept as pieces,
    decoded once when it closes. An object that is not a call (a JSON answer) is content,
    verbatim, and so is everything after it; text after the calls is content too. Special
    tokens need not be kept: without `<|python_tag|>` the reply still opens with `{`.
    """

    def __init__(self, tools: ToolsArg = (), *, prompt: str | None = None) -> None:
        super().__init__(tools, prompt=prompt)
        self._phase = _Phase.START
        self._held = ""  # START: the undecided head; CONTENT: a partial tag; CALLS: separators
        self._object: list[str] = []
        self._scanner = BracketScanner()
        self._content = TrimmedText()

    def _feed(self, delta: str, out: Emission) -> None:
        buf = delta
        while buf:
            if self._phase is _Phase.START:
                buf = self._start(buf)
            elif self._phase is _Phase.CONTENT:
                buf = self._text(buf, out)
            elif self._phase is _Phase.CALLS:
                buf = self._between(buf)
            else:
                buf = self._in_object(buf, out)

    def _start(self, buf: str) -> str:
        self._held += buf
        head = self._held.lstrip()
        if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
            return ""
        self._held = ""
        if head.startswith(PYTHON_TAG):
            self._phase = _Phase.CALLS
            return head[len(PYTHON_TAG):]
        self._phase = _Phase.CALLS if head.startswith("{") else _Phase.CONTENT
        return head

    def _text(self, buf: str, out: Emission) -> str:
        before, tag, after = cut_at(self._held + buf, (PYTHON_TAG,))
        out.content.append(self._content.push(before))
        if tag is None:
            self._held = after
            return ""
        self._held = ""
        self._phase = _Phase.CALLS
        return after

    def _between(self, buf: str) -> str:
        """Separators are held: dropped before the next object, content before other text."""
        rest = buf.lstrip(_SEPARATORS)
        if not rest:
            self._held += buf
            return ""
        if rest.startswith("{"):
            self._phase, self._object, self._scanner = _Phase.OBJECT, [], BracketScanner()
            self._held = ""
            return rest
        self._phase = _Phase.CONTENT  # text after the calls
        rest, self._held = self._held + buf, ""
        return rest

    def _in_object(self, buf: str, out: Emission) -> str:
        end = self._scanner.feed(buf)
        if end < 0:
            self._object.append(buf)
            return ""
        self._object.append(buf[:end])
        text = "".join(self._object)
        call = parse_call_object(text)
        if call is not None:
            self._emit_call(out, *call)
            self._phase = _Phase.CALLS
        else:  # a JSON answer, not a call: it and what follows are content
            out.content.append(self._content.push(text))
            self._phase = _Phase.CONTENT
        return buf[end:]

    def _finish(self, out: Emission) -> None:
        held, self._held = self._held, ""
        if self._phase is _Phase.OBJECT:
            self._drop_unfinished("".join(self._object))
        elif self._phase in (_Phase.START, _Phase.CONTENT) and not dropped_at_end(held.strip()):
            out.content.append(self._content.push(held))
