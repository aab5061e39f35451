"""One request's output parsing: a reasoning parser in front of a tool parser.

The worker builds one per chat request (`ChatStreamParser(reasoning, tools)`), feeds it each
decoded delta and sends what comes back; `finish` flushes what was held at the end. The
reasoning parser splits reasoning from content; the content goes on to the tool parser,
which takes out the calls (tool calls inside reasoning are not calls, as in vLLM). A tool
parser that handles reasoning itself (the channel format frames both) replaces the
reasoning parser, which would otherwise cut its framing apart.
"""

from __future__ import annotations

from shared.parsing.base import Emission, StreamParser
from shared.parsing.messages import DeltaMessage, ExtractedMessage


class ChatStreamParser:
    """A request's stream parser: reasoning, then tool calls; either may be absent.

    Reasoning tokens are counted by the caller, which alone knows the tokens: feed each
    token's text, then count the token as reasoning if `reasoning_ended` is False. Set
    `skip_special_tokens=False` for the request when `requires_special_tokens` is True.
    """

    def __init__(self, reasoning: StreamParser | None = None,
                 tools: StreamParser | None = None) -> None:
        if tools is not None and tools.handles_reasoning:
            reasoning = None
        elif reasoning is not None and reasoning.handles_reasoning and tools is not None:
            raise ValueError(f"{type(reasoning).__name__} frames the whole turn (reasoning and "
                             f"calls); use it as the tool parser as well, not with "
                             f"{type(tools).__name__}")
        self.reasoning = reasoning
        self.tools = tools
        self._finished = False

    @property
    def requires_special_tokens(self) -> bool:
        return any(p.requires_special_tokens for p in (self.reasoning, self.tools) if p)

    @property
    def reasoning_ended(self) -> bool:
        """False while the text fed so far ends inside reasoning."""
        first = self.reasoning or self.tools
        return first is None or first.reasoning_ended

    def feed(self, delta: str) -> DeltaMessage:
        if self._finished:
            raise RuntimeError("feed() after finish(): a parser parses one generation")
        if self.reasoning is None:
            return self.tools.feed(delta) if self.tools else DeltaMessage(content=delta)
        return self._chain(self.reasoning.feed(delta), final=False)

    def finish(self) -> DeltaMessage:
        """End of stream: what the parsers held, released or dropped. Idempotent."""
        if self._finished:
            return DeltaMessage()
        self._finished = True
        if self.reasoning is None:
            return self.tools.finish() if self.tools else DeltaMessage()
        return self._chain(self.reasoning.finish(), final=True)

    def parse(self, text: str) -> ExtractedMessage:
        """A complete generation, parsed by fresh parsers (this object's state is untouched)."""
        fresh = ChatStreamParser(self.reasoning.fresh() if self.reasoning else None,
                                 self.tools.fresh() if self.tools else None)
        return ExtractedMessage.join((fresh.feed(text), fresh.finish()))

    def _chain(self, first: DeltaMessage, *, final: bool) -> DeltaMessage:
        """The reasoning parser's output with its content passed through the tool parser."""
        if self.tools is None:
            return first
        out = Emission()
        out.reasoning.append(first.reasoning)
        out.calls.extend(first.tool_calls)
        second = self.tools.feed(first.content)
        if final:
            second = second + self.tools.finish()
        out.content.append(second.content)
        out.reasoning.append(second.reasoning)
        out.calls.extend(second.tool_calls)
        return out.message()
