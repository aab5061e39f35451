"""What a parser hands back: a parsed message, its streamed pieces, and the tool calls in both.

A complete generation parses into an `ExtractedMessage`; a stream parses into `DeltaMessage`s
whose concatenation is the same message (content and reasoning concatenated, tool calls in
index order). Tool calls are never streamed in pieces: a `ToolCallDelta` carries one whole call
(fresh id, name, complete JSON arguments) the moment its closing markup arrives.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass

TOOL_CALL_ID_PREFIX = "chatcmpl-tool-"


def new_tool_call_id() -> str:
    """A fresh id in vLLM's style (`chatcmpl-tool-<32 hex>`); never reused across calls."""
    return f"{TOOL_CALL_ID_PREFIX}{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made: `arguments` is a JSON object, serialised."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A whole tool call in a stream: `index` counts calls 0, 1, 2... in the order they closed."""

    index: int
    id: str
    name: str
    arguments: str

    def to_call(self) -> ToolCall:
        return ToolCall(id=self.id, name=self.name, arguments=self.arguments)


@dataclass(frozen=True)
class DeltaMessage:
    """What one `feed` (or the final `finish`) releases: text that can no longer change, in
    each channel, and the tool calls that completed. Empty strings mean nothing new."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def __add__(self, other: DeltaMessage) -> DeltaMessage:
        return DeltaMessage(self.content + other.content, self.reasoning + other.reasoning,
                            self.tool_calls + other.tool_calls)


@dataclass(frozen=True)
class ExtractedMessage:
    """A complete generation, split: `content` is the answer shown to the user, `reasoning`
    the thinking, `tool_calls` the calls. A channel with no text is None, as in the OpenAI API
    (content is null when the model only called tools)."""

    content: str | None
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]

    @classmethod
    def join(cls, deltas: Iterable[DeltaMessage]) -> ExtractedMessage:
        """The message a stream adds up to (what a non-streamed parse returns)."""
        content: list[str] = []
        reasoning: list[str] = []
        deltas_of_calls: list[ToolCallDelta] = []
        for delta in deltas:  # lists, not `+`: a long stream must not cost quadratic copies
            content.append(delta.content)
            reasoning.append(delta.reasoning)
            deltas_of_calls.extend(delta.tool_calls)
        calls = tuple(d.to_call() for d in sorted(deltas_of_calls, key=lambda d: d.index))
        return cls("".join(content) or None, "".join(reasoning) or None, calls)
