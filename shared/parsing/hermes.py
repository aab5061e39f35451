"""Hermes-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The format of NousResearch's Hermes 2 Pro / Hermes 3 function calling, adopted by Qwen2.5,
QwQ and Qwen3: each call is one JSON object between the tags, any number of calls in a row,
text around them is content. `parameters` is accepted in place of `arguments`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from shared.parsing.base import Emission, ToolParser
from shared.parsing.markers import MarkerSplitter
from shared.parsing.tools import ToolsArg, as_arguments
from shared.parsing.trimmed_text import TrimmedText

logger = logging.getLogger(__name__)

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


def parse_call_object(text: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of a `{"name": ..., "arguments"|"parameters": {...}}` JSON text, or
    None when it is not one."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    return call_from_object(obj)


def call_from_object(obj: Any) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of a decoded call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    raw = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    arguments = as_arguments(raw)
    return None if arguments is None else (obj["name"], arguments)


class HermesToolParser(ToolParser):
    """Tool calls between `<tool_call>` tags; registered as hermes.

    Per step O(len(delta)): the splitter rescans only its held partial tag, and an open call
    body is kept as a list of pieces, joined once when `</tool_call>` arrives. A body that is
    not a call object stays content, tags included. A body still open at the end of the
    stream is a call if it already parses (the stop token ate the closing tag), else dropped.
    `requires_special_tokens`: Hermes 2 Pro's tokenizer marks the tags special (vLLM forces
    skip_special_tokens=False for this parser too).
    """

    requires_special_tokens = True

    def __init__(self, tools: ToolsArg = (), *, prompt: str | None = None) -> None:
        super().__init__(tools, prompt=prompt)
        self._splitter = MarkerSplitter((CALL_OPEN, CALL_CLOSE))
        self._content = TrimmedText()
        self._body: list[str] | None = None  # the open call's text; None outside a call

    def _feed(self, delta: str, out: Emission) -> None:
        for text, marker in self._splitter.feed(delta):
            if self._body is not None:
                self._body.append(text)
            else:
                out.content.append(self._content.push(text))
            if marker == CALL_OPEN:
                if self._body is not None:  # the previous call never closed
                    self._close_call(out, closed=False)
                self._body = []
            elif marker == CALL_CLOSE:
                if self._body is None:
                    logger.warning("hermes: a stray %s outside a call was dropped", CALL_CLOSE)
                else:
                    self._close_call(out, closed=True)

    def _close_call(self, out: Emission, *, closed: bool) -> None:
        assert self._body is not None
        body, self._body = "".join(self._body), None
        call = parse_call_object(body.strip())
        if call is not None:
            self._emit_call(out, *call)
        elif closed:
            logger.warning("hermes: a <tool_call> body is not a call object; kept as content")
            out.content.append(self._content.push(f"{CALL_OPEN}{body}{CALL_CLOSE}"))
        else:
            self._drop_unfinished(body)

    def _finish(self, out: Emission) -> None:
        tail = self._splitter.finish()
        if self._body is not None:
            self._body.append(tail)
            self._close_call(out, closed=False)
        else:
            out.content.append(self._content.push(tail))
