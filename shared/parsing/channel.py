"""The channel format (vLLM #51655): messages addressed by recipient, tool calls in ATEM XML.

    <|start|>assistant to=self<|message|>REASONING<|eom|>
    <|start|>assistant to=get_weather<|message|><atem:function_calls>…</atem:function_calls><|eom|>
    <|start|>assistant to=user<|message|>ANSWER<|eot|>

Built as *segment, then select*, never by cutting regex matches out of the text: the control
tokens segment the text into headers and bodies; a body ends at `<|eom|>`, `<|eot|>`, the
next header (` to=NAME<|message|>` written without closing the last body included), or a
stray `<|start|>`, so a missing `<|eom|>` cannot swallow the next message. Each body is then
routed by its recipient: reasoning, content, or (tool bodies, in order) calls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from shared.parsing.atem import ATEM_MARKERS, Invoke, InvokeScanner
from shared.parsing.base import Emission, ToolParser
from shared.parsing.markers import MarkerSplitter, dropped_at_end, partial_suffix_len
from shared.parsing.recipient import (
    CONTROL_TOKENS,
    MESSAGE,
    Recipient,
    could_be_header,
    header_tail,
    held_len,
    opened_message,
    recipient_of,
)
from shared.parsing.tools import ToolsArg
from shared.parsing.trimmed_text import TrimmedText

logger = logging.getLogger(__name__)

BODY_SEPARATOR = "\n\n"  # between two bodies of one channel (reasoning, tool, reasoning...)


@dataclass
class _Body:
    """One open message body."""

    recipient: Recipient
    name: str
    scanner: InvokeScanner | None  # tool and unframed bodies: their function calls
    held: str = ""  # text not yet released to reasoning/content (see recipient.held_len)
    tail: list[str] = field(default_factory=list)  # recent raw text, for header_tail
    calls: int = 0


class ChannelParser(ToolParser):
    """Reasoning, content and tool calls of the channel format; registered as channel (tool
    and reasoning parser), so `handles_reasoning`.

    Per step O(len(delta)): control tokens and ATEM tags are found by MarkerSplitters that
    rescan only their held partial marker; a body's text is released as it comes, less the
    held tail; an invoke is kept in pieces and decoded once when it closes, then emitted
    whole. When a body closes, all it held is released (a partial tag of two characters or
    more is dropped), so a closed body that ended in `<` is never held back forever. Text
    with no header is an answer that may still carry calls; if the whole text has no framing
    yet carries the markup, a warning says skip_special_tokens probably stripped it — which
    is why this parser `requires_special_tokens`. A `prompt` that ends in an open header
    (`…to=self<|message|>`) makes the generation start inside that body.
    """

    requires_special_tokens = True
    handles_reasoning = True

    def __init__(self, tools: ToolsArg = (), *, prompt: str | None = None) -> None:
        super().__init__(tools, prompt=prompt)
        self._splitter = MarkerSplitter(CONTROL_TOKENS)
        self._header = ""  # header text since the last boundary, while no body is open
        self._body: _Body | None = None
        self._framed = False  # a header has been seen
        self._warned_unframed = False
        self._reasoning = TrimmedText()
        self._content = TrimmedText()
        opened = opened_message(prompt) if prompt else None
        if opened is not None:  # the template wrote the header: we start inside the body
            self._framed = True
            self._open(*opened)

    @property
    def reasoning_ended(self) -> bool:
        return self._body is None or self._body.recipient is not Recipient.REASONING

    def _feed(self, delta: str, out: Emission) -> None:
        for text, marker in self._splitter.feed(delta):
            if text:
                self._text(text, out)
            if marker is not None:
                self._control(marker, out)

    def _finish(self, out: Emission) -> None:
        rest = self._splitter.finish()
        if rest:
            self._text(rest, out)
        if self._body is not None:
            self._close(out)

    # ---- segmenting -------------------------------------------------------------------
    def _text(self, text: str, out: Emission) -> None:
        if self._body is None:
            self._header += text
            if could_be_header(self._header):
                return
            text, self._header = self._header, ""
            self._open(Recipient.UNFRAMED, "")
        self._body_text(text, out)

    def _control(self, marker: str, out: Emission) -> None:
        if marker != MESSAGE:  # <|start|>, <|eom|>, <|eot|>: the open body (if any) ends
            if self._body is not None:
                self._close(out)
            self._header = ""
            return
        if self._body is None:
            recipient, name = recipient_of(self._header)
            self._header = ""
        else:
            switched_to = header_tail("".join(self._body.tail))
            if switched_to is None:
                logger.warning("channel: a stray %s inside a message body was dropped", MESSAGE)
                return
            self._close(out, cut=f"to={switched_to}")
            recipient, name = recipient_of(f"to={switched_to}")
        self._framed = True
        self._open(recipient, name)

    def _open(self, recipient: Recipient, name: str) -> None:
        carries_calls = recipient in (Recipient.TOOL, Recipient.UNFRAMED)
        self._body = _Body(recipient, name, InvokeScanner(self.tools) if carries_calls else None)

    def _close(self, out: Emission, cut: str = "") -> None:
        """End the open body; `cut` is a header that ended it, to take off its held tail."""
        body, self._body = self._body, None
        assert body is not None
        if body.scanner is not None:
            rest = body.scanner.close()
            if body.recipient is Recipient.UNFRAMED:
                self._release(body, rest, out)
        held = body.held
        if cut and cut in held:
            held = held[:held.rindex(cut)]
        partial = partial_suffix_len(held, ATEM_MARKERS)
        if dropped_at_end(held[len(held) - partial:]):
            held = held[:len(held) - partial]
        if body.recipient is not Recipient.TOOL:
            trimmed, sink = self._channel(body, out)
            sink.append(trimmed.push(held))
            trimmed.edge(BODY_SEPARATOR)
        elif body.calls == 0:
            logger.warning("channel: tool message to %r ended without a complete invoke: "
                           "no call, content only", body.name)

    # ---- selecting --------------------------------------------------------------------
    def _body_text(self, text: str, out: Emission) -> None:
        body = self._body
        assert body is not None
        body.tail.append(text)
        if len(body.tail) > 64:  # keep it short: only its last few hundred chars are read
            body.tail = ["".join(body.tail)[-512:]]
        if body.scanner is None:
            self._release(body, text, out)
            return
        for item in body.scanner.feed(text):
            if isinstance(item, Invoke):
                self._emit_call(out, item.name, item.arguments)
                body.calls += 1
            elif body.recipient is Recipient.UNFRAMED:
                self._release(body, item, out)
        if body.scanner.markup_seen and not self._framed and not self._warned_unframed:
            self._warned_unframed = True
            logger.warning("channel: function-call markup without any message framing: the "
                           "control tokens were probably stripped (skip_special_tokens)")

    def _release(self, body: _Body, text: str, out: Emission) -> None:
        window = body.held + text
        keep = held_len(window)
        body.held = window[len(window) - keep:]
        trimmed, sink = self._channel(body, out)
        sink.append(trimmed.push(window[:len(window) - keep]))

    def _channel(self, body: _Body, out: Emission) -> tuple[TrimmedText, list[str]]:
        if body.recipient is Recipient.REASONING:
            return self._reasoning, out.reasoning
        return self._content, out.content
