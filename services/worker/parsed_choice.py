"""One chat choice's output as parsed text: reasoning, content and tool calls, in the API's shapes.

Streamed or not, a choice is fed engine output by engine output (`feed`); the stream sends each
returned delta, the full body joins them all (`message`), so both answers come from the same
deltas. The parser guarantees released text only grows; nothing here re-derives it.

Reasoning tokens: before an output is fed, if the parser is still inside the reasoning, that
output's new tokens count as reasoning tokens. Outputs are one token each in the common case,
so the count is exact but for one token: the token that closes the reasoning (`</think>`) is
counted, the one that opens it is not. When one output carries several tokens across the
boundary (the last output with a stop string, a P/D decode's first output), all of them are
counted on the side the parser was on before it.

With tool_choice "required" or a named function, the content (the grammar's JSON) is held back
and read into calls when the choice finishes; a text that does not read as calls (cut by
max_tokens) is released as plain content instead.
"""

from __future__ import annotations

import logging
from typing import Any

from services.worker.chat_output import ChatOutputPlan
from services.worker.tool_constraints import tool_calls_from_constrained_output
from shared.engine.outputs import RequestOutput
from shared.parsing import DeltaMessage, ExtractedMessage, ToolCallDelta, new_tool_call_id

log = logging.getLogger(__name__)

TOOL_CALLS = "tool_calls"  # the finish_reason of a choice that called tools


class ParsedChoice:
    """The parsing state of one choice: its parser, what it released, its reasoning tokens."""

    def __init__(self, plan: ChatOutputPlan) -> None:
        self.plan = plan
        self.parser = plan.new_parser()
        self.deltas: list[DeltaMessage] = []  # everything released, in order
        self.reasoning_tokens = 0
        self.num_calls = 0
        self._held: list[str] = []  # constrained tool_choice: the JSON, read at the end

    def feed(self, out: RequestOutput) -> DeltaMessage:
        """What this engine output releases (with the end of the stream, if it is the last)."""
        if not self.parser.reasoning_ended:
            self.reasoning_tokens += len(out.new_token_ids)
        delta = self._release(self.parser.feed(out.new_text))
        if out.finished:
            delta = delta + self._release(self.parser.finish()) + self._constrained_calls()
        return delta

    def _release(self, delta: DeltaMessage) -> DeltaMessage:
        calls = delta.tool_calls
        if calls and not self.plan.takes_calls:
            # A format that frames calls itself (channel) reports them even where the request
            # offered none, or forced one by grammar: not calls of this request.
            log.warning("dropped %d tool call(s) the request did not ask for", len(calls))
            calls = ()
        elif not self.plan.parallel_calls:
            # parallel_tool_calls false: the first call only (vLLM's rule). A call is whole in
            # one delta, so a stream never shows a part of a dropped one.
            calls = tuple(c for c in calls if c.index == 0)
        content = delta.content
        if self.plan.constrained is not None and content:
            self._held.append(content)
            content = ""
        out = DeltaMessage(content, delta.reasoning, calls)
        self.num_calls += len(calls)
        if out:
            self.deltas.append(out)
        return out

    def _constrained_calls(self) -> DeltaMessage:
        if self.plan.constrained is None:
            return DeltaMessage()
        text = "".join(self._held)
        try:
            calls = tool_calls_from_constrained_output(self.plan.constrained, text)
        except ValueError:  # not the grammar's whole output (cut short): plain content
            out = DeltaMessage(content=text)
        else:
            out = DeltaMessage(tool_calls=tuple(
                ToolCallDelta(i, new_tool_call_id(), call.name, call.arguments)
                for i, call in enumerate(calls)))
        self.num_calls += len(out.tool_calls)
        if out:
            self.deltas.append(out)
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """`tool_calls` when calls were made and the generation stopped by itself."""
        return TOOL_CALLS if self.num_calls and reason == "stop" else reason

    def message(self) -> dict[str, Any]:
        """The non-streamed `message`: content None when there is none (only calls)."""
        parsed = ExtractedMessage.join(self.deltas)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if self.plan.reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [_call(c.id, c.name, c.arguments) for c in parsed.tool_calls]
        return message


def delta_fields(delta: DeltaMessage) -> dict[str, Any]:
    """A stream chunk's `delta` for what one feed released (empty: nothing new)."""
    fields: dict[str, Any] = {}
    if delta.reasoning:
        fields["reasoning_content"] = fields["reasoning"] = delta.reasoning
    if delta.content:
        fields["content"] = delta.content
    if delta.tool_calls:
        fields["tool_calls"] = [{"index": c.index, **_call(c.id, c.name, c.arguments)}
                                for c in delta.tool_calls]
    return fields


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}
