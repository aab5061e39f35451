"""Mistral tool calls: `[TOOL_CALLS]` then the calls, in either of Mistral's two layouts.

From mistral-common's tokenizer documentation: tokenizers up to v7 write
`[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (a JSON array, sometimes a single
object); v11 and later write each call as `[TOOL_CALLS]f[ARGS]{...}` (v13 may put
`[CALL_ID]id` between name and `[ARGS]`; that id is ignored, ours are fresh). Text before the
tag is content, and so is text after the calls.
"""

from __future__ import annotations

import json
import logging
import re
from enum import Enum

from shared.parsing.base import Emission, ToolParser
from shared.parsing.brackets import BracketScanner
from shared.parsing.hermes import call_from_object
from shared.parsing.markers import cut_at, dropped_at_end
from shared.parsing.tools import ToolsArg
from shared.parsing.trimmed_text import TrimmedText

logger = logging.getLogger(__name__)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[\w.\-]{1,128}")  # a v11 function name before [ARGS]
_MAX_HEAD = 256  # name (and call id) text longer than this is not a call head


class _Phase(Enum):
    CONTENT = "content"
    TAG = "tag"  # after [TOOL_CALLS]: which layout follows is not known yet
    JSON = "json"  # inside the v3-v7 JSON array (or object)
    HEAD = "head"  # v11: the function name (and [CALL_ID] id) before [ARGS]
    ARGS = "args"  # v11: inside the arguments object


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS]` calls in the JSON-array or the `name[ARGS]{...}` layout; registered as
    mistral.

    `[TOOL_CALLS]` is a special token (control token) in every Mistral tokenizer that has it,
    so `requires_special_tokens`. Per step O(len(delta)): JSON values are tracked by a
    BracketScanner and decoded once, when they close. A closed structure that is not a call
    stays content, verbatim, tag included; one still open at the end is dropped.
    """

    requires_special_tokens = True

    def __init__(self, tools: ToolsArg = (), *, prompt: str | None = None) -> None:
        super().__init__(tools, prompt=prompt)
        self._phase = _Phase.CONTENT
        self._held = ""  # a possible partial marker, or the head text so far
        self._value: list[str] = []  # the open JSON value
        self._scanner = BracketScanner()
        self._name = ""
        self._content = TrimmedText()

    def _feed(self, delta: str, out: Emission) -> None:
        buf = delta
        while buf:
            if self._phase is _Phase.CONTENT:
                buf = self._text(buf, out)
            elif self._phase is _Phase.TAG:
                buf = self._after_tag(buf)
            elif self._phase is _Phase.HEAD:
                buf = self._head(buf, out)
            else:
                buf = self._in_value(buf, out)

    def _text(self, buf: str, out: Emission) -> str:
        before, tag, after = cut_at(self._held + buf, (TOOL_CALLS,))
        out.content.append(self._content.push(before))
        self._held = "" if tag else after
        if tag:
            self._phase = _Phase.TAG
        return after if tag else ""

    def _after_tag(self, buf: str) -> str:
        rest = buf.lstrip()
        if rest[:1] in ("[", "{"):
            self._open_value(_Phase.JSON)
        elif rest:
            self._phase = _Phase.HEAD
        return rest

    def _open_value(self, phase: _Phase) -> None:
        self._phase, self._value, self._scanner = phase, [], BracketScanner()

    def _head(self, buf: str, out: Emission) -> str:
        """v11 head: `name[ARGS]` or `name[CALL_ID]id[ARGS]`, then the arguments object."""
        before, marker, after = cut_at(self._held + buf, (ARGS, TOOL_CALLS))
        if marker is None:
            self._held = before + after
            if len(self._held) > _MAX_HEAD:
                return self._not_a_call(out, self._held, "")
            return ""
        self._held = ""
        name = before.partition(CALL_ID)[0].strip()
        if marker == TOOL_CALLS or not _NAME.fullmatch(name):
            return self._not_a_call(out, before, marker + after)
        self._name = name
        rest = after.lstrip()
        if not rest:  # wait for the arguments' `{`, re-reading the head then
            self._held = before + ARGS
            return ""
        if rest[0] != "{":
            return self._not_a_call(out, before + ARGS, rest)
        self._open_value(_Phase.ARGS)
        return rest

    def _in_value(self, buf: str, out: Emission) -> str:
        end = self._scanner.feed(buf)
        if end < 0:
            self._value.append(buf)
            return ""
        self._value.append(buf[:end])
        text = "".join(self._value)
        if self._phase is _Phase.JSON:
            self._json_calls(text, out)
        else:
            args = _decode(text)
            if not isinstance(args, dict):
                self._not_a_call(out, f"{self._name}{ARGS}{text}", "")
            else:
                self._emit_call(out, self._name, args)
        self._phase = _Phase.CONTENT
        return buf[end:]

    def _json_calls(self, text: str, out: Emission) -> None:
        value = _decode(text)
        items = value if isinstance(value, list) else [value]
        calls = [call_from_object(item) for item in items]
        if not items or any(call is None for call in calls):
            self._not_a_call(out, text, "")
            return
        for call in calls:
            assert call is not None
            self._emit_call(out, *call)

    def _not_a_call(self, out: Emission, text: str, rest: str) -> str:
        """What followed `[TOOL_CALLS]` is no call: it is content, tag and all."""
        logger.warning("mistral: text after %s is not a tool call; kept as content", TOOL_CALLS)
        out.content.append(self._content.push(TOOL_CALLS + text))
        self._phase, self._held = _Phase.CONTENT, ""
        return rest

    def _finish(self, out: Emission) -> None:
        held, self._held = self._held, ""
        if self._phase is _Phase.CONTENT:
            if not dropped_at_end(held):
                out.content.append(self._content.push(held))
        elif self._phase is not _Phase.TAG:
            self._drop_unfinished(held + "".join(self._value))


def _decode(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
