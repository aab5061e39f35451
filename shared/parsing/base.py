"""The interface every reasoning and tool parser implements, and the tool parsers' common base.

A parser is a per-request, incremental scanner: `feed` takes each decoded delta and returns
what can no longer change; `finish` flushes what is held at the end of the stream. A
complete text is parsed by the same scanner (`parse` = a fresh parser, fed once, finished), so
the streamed and the non-streamed answers come from one piece of code; the tests check that
the result does not depend on how the text was split into deltas.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from shared.parsing.messages import DeltaMessage, ExtractedMessage, ToolCallDelta
from shared.parsing.tools import ToolsArg, ToolSet, ToolSpec

logger = logging.getLogger(__name__)


class Emission:
    """What one `feed` or `finish` releases, gathered before it is frozen into a DeltaMessage."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCallDelta] = []

    def message(self) -> DeltaMessage:
        return DeltaMessage("".join(self.content), "".join(self.reasoning), tuple(self.calls))


class StreamParser(ABC):
    """A per-request parser of one generation, fed its decoded text delta by delta.

    Subclasses implement `_feed`, `_finish` and `fresh`. Released text only grows: everything
    a `feed` returned is a prefix of what the complete parse yields, so nothing is retracted.
    `requires_special_tokens` says the format's markers are special tokens that the
    detokenizer must keep (the caller then forces `skip_special_tokens=False`).
    `handles_reasoning` says the parser splits out reasoning itself (a separate reasoning
    parser in front of it would cut its framing apart).
    """

    requires_special_tokens: ClassVar[bool] = False
    handles_reasoning: ClassVar[bool] = False

    def __init__(self) -> None:
        self._finished = False

    @property
    def reasoning_ended(self) -> bool:
        """False while the text fed so far ends inside reasoning: a token whose delta was fed
        while this is False (checked after its feed) is a reasoning token."""
        return True

    @abstractmethod
    def fresh(self) -> StreamParser:
        """A new parser with this one's configuration and no stream state."""

    def feed(self, delta: str) -> DeltaMessage:
        if self._finished:
            raise RuntimeError("feed() after finish(): a parser parses one generation")
        out = Emission()
        if delta:
            self._feed(delta, out)
        return out.message()

    def finish(self) -> DeltaMessage:
        """End of stream: release or drop what is held. Idempotent."""
        out = Emission()
        if not self._finished:
            self._finished = True
            self._finish(out)
        return out.message()

    def parse(self, text: str) -> ExtractedMessage:
        """A complete generation, parsed by a fresh parser (this one's state is untouched)."""
        parser = self.fresh()
        return ExtractedMessage.join((parser.feed(text), parser.finish()))

    @abstractmethod
    def _feed(self, delta: str, out: Emission) -> None: ...

    @abstractmethod
    def _finish(self, out: Emission) -> None: ...


class ToolParser(StreamParser):
    """A stream parser built with the request's offered tools, that emits whole tool calls.

    Built per request as `cls(request_tools, prompt=rendered_prompt)` (the prompt only
    matters to a format whose template may open a message itself). Calls are numbered
    0, 1, 2... in the order they complete. A structure that closed but does not parse as a
    call stays content, verbatim (what the model wrote is shown rather than lost; the
    channel format's tool messages excepted, which are never content); one still open at
    the end of the stream is dropped with a warning, never emitted as half a call.
    """

    def __init__(self, tools: ToolsArg = (), *, prompt: str | None = None) -> None:
        super().__init__()
        self._specs = tuple(t if isinstance(t, ToolSpec) else ToolSpec.from_openai(t)
                            for t in tools)
        self.tools = ToolSet(self._specs)
        self.prompt = prompt  # the rendered prompt, for formats whose template opens a message
        self._next_index = 0

    def fresh(self) -> ToolParser:
        return type(self)(self._specs, prompt=self.prompt)

    def _emit_call(self, out: Emission, name: str, arguments: Mapping[str, Any]) -> None:
        out.calls.append(self.tools.make_call(self._next_index, name, arguments))
        self._next_index += 1

    def _drop_unfinished(self, text: str) -> None:
        logger.warning("%s: an unfinished tool call at the end of the stream was dropped "
                       "(%d chars)", type(self).__name__, len(text))
