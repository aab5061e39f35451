"""ATEM function-call markup, the tool-call body of the channel format.

    <atem:function_calls>
    <atem:invoke name="ns.fn"><atem:parameter name="arg">value</atem:parameter>…</atem:invoke>
    </atem:function_calls>

Values are bare text, not JSON: a parameter declared `string` in the tool's schema keeps its
text verbatim even when it looks like JSON (`"42"`, `{"a":1}`); any other value is
JSON-decoded when it parses and kept as text when it does not. A parameter whose opening tag
was swallowed (`name="a">value</atem:parameter>`) still counts: parameters are found by
their closing tags, and the opening tag before the name is optional.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from shared.parsing.markers import MarkerSplitter
from shared.parsing.tools import ToolSet

logger = logging.getLogger(__name__)

FUNCTION_CALLS_OPEN = "<atem:function_calls>"
FUNCTION_CALLS_CLOSE = "</atem:function_calls>"
INVOKE_OPEN = "<atem:invoke"
INVOKE_CLOSE = "</atem:invoke>"
PARAMETER_OPEN = "<atem:parameter"
PARAMETER_CLOSE = "</atem:parameter>"
ATEM_MARKERS = (FUNCTION_CALLS_OPEN, FUNCTION_CALLS_CLOSE, INVOKE_OPEN, INVOKE_CLOSE,
                PARAMETER_OPEN, PARAMETER_CLOSE)

_INVOKE_HEAD = re.compile(r'\s*name\s*=\s*"([^"]*)"\s*>')
_PARAMETER = re.compile(r'\s*(?:<atem:parameter\s+)?name\s*=\s*"([^"]*)"\s*>(.*)\Z', re.DOTALL)


@dataclass(frozen=True)
class Invoke:
    """One complete `<atem:invoke>`: the resolved function name and decoded arguments."""

    name: str
    arguments: dict[str, Any]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN/Infinity would serialise as invalid JSON


def decode_value(tools: ToolSet, tool: str, parameter: str, text: str) -> Any:
    """A parameter's value: verbatim for a declared `string`, else JSON when it parses."""
    if "string" in tools.declared_types(tool, parameter):
        return text
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError:  # JSONDecodeError is a ValueError
        return text


def decode_invoke(text: str, tools: ToolSet) -> Invoke | None:
    """The invoke whose text (between `<atem:invoke` and `</atem:invoke>`) is `text`: a
    ` name="fn">` head, then parameters each ended by `</atem:parameter>`."""
    head = _INVOKE_HEAD.match(text)
    if head is None or not head.group(1).strip():
        logger.warning("channel: an <atem:invoke> without a name was dropped")
        return None
    name = tools.resolve(head.group(1).strip())
    arguments: dict[str, Any] = {}
    *pieces, trailer = text[head.end():].split(PARAMETER_CLOSE)
    for piece in pieces:
        parameter = _PARAMETER.match(piece)
        if parameter is None:
            logger.warning("channel: %s: a parameter without a name was skipped", name)
            continue
        key, value = parameter.group(1), parameter.group(2)
        arguments[key] = decode_value(tools, name, key, value)
    if trailer.strip():
        logger.warning("channel: %s: text after the last parameter was ignored", name)
    return Invoke(name, arguments)


class InvokeScanner:
    """Finds the complete invokes in one message body as it streams.

    `feed` returns, in order, the text outside any function-call markup (content, for a body
    that may carry some; a tool body drops it) and each `Invoke` as its closing tag arrives.
    An invoke cut off (by the body's end, a new invoke, or `</atem:function_calls>`) yields
    nothing but a warning: never half a call. Per step O(len(delta)): the invoke's text is
    kept in pieces and decoded once.
    """

    def __init__(self, tools: ToolSet) -> None:
        self._tools = tools
        self._splitter = MarkerSplitter(ATEM_MARKERS)
        self._invoke: list[str] | None = None  # the open invoke's text; None outside one
        self.markup_seen = False  # any function-call markup in this body

    def feed(self, text: str) -> list[str | Invoke]:
        found: list[str | Invoke] = []
        for piece, marker in self._splitter.feed(text):
            if self._invoke is None:
                found.append(piece)
            else:
                self._invoke.append(piece)
            if marker is not None:
                self.markup_seen = True
                self._on_marker(marker, found)
        return found

    def _on_marker(self, marker: str, found: list[str | Invoke]) -> None:
        if marker in (PARAMETER_OPEN, PARAMETER_CLOSE):
            if self._invoke is not None:  # part of the invoke's own text
                self._invoke.append(marker)
            return  # outside an invoke: stray markup, dropped
        if marker == INVOKE_CLOSE and self._invoke is not None:
            invoke = decode_invoke("".join(self._invoke), self._tools)
            self._invoke = None
            if invoke is not None:
                found.append(invoke)
            return
        self._cut_open_invoke()
        if marker == INVOKE_OPEN:
            self._invoke = []

    def _cut_open_invoke(self) -> None:
        if self._invoke is not None:
            logger.warning("channel: an <atem:invoke> that never closed was dropped")
            self._invoke = None

    def close(self) -> str:
        """The body ended: an open invoke is dropped; returns held text that is content."""
        held = self._splitter.finish()
        if self._invoke is not None:
            self._cut_open_invoke()
            return ""
        return held

    @property
    def in_invoke(self) -> bool:
        return self._invoke is not None
