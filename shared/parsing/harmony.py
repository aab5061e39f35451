"""OpenAI's harmony format (gpt-oss), read with openai-harmony's own StreamableParser.

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The rendered prompt ends in `<|start|>assistant`, so the generation starts inside a header.
Decoded text deltas (special tokens kept) are cut at the control tokens by a MarkerSplitter,
turned back into o200k_harmony ids (a marker is its one special id; the text between is
encoded as plain text) and fed to the library's parser token by token. Its message state
routes each content delta: `analysis` -> reasoning; a message with a recipient
(`to=functions.NAME`) -> one tool call, emitted whole when the message ends; `final`,
`commentary` without a recipient (a preamble, shown as vLLM shows it) and any other channel
-> content. Text the library refuses (no framing, a broken header, a stray token) is not an
error: from there on the raw text is content, the harmony framing included.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from openai_harmony import HarmonyError, Message, Role, StreamableParser, StreamState

from shared.parsing.base import Emission, ToolParser
from shared.parsing.harmony_encoding import encoding
from shared.parsing.markers import MarkerSplitter
from shared.parsing.tools import ToolsArg

logger = logging.getLogger(__name__)

CONTROL_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>",
                  "<|call|>", "<|return|>", "<|endoftext|>")
FUNCTIONS = "functions."  # the namespace harmony renders the request's tools in
MAX_HEADER_CHARS = 512  # a "header" longer than this is unframed text, released as content
MESSAGE_SEPARATOR = "\n"  # between two messages that land in the same field (as vLLM joins)


class HarmonyParser(ToolParser):
    """Reasoning, content and tool calls of gpt-oss's harmony output; registered as the tool
    parser `openai`/`harmony` and the reasoning parser `openai_gptoss`/`harmony`.

    Emits what the library has parsed, token by token: reasoning and content as they come,
    a call once its message ended (on `<|call|>`, `<|end|>` or the end of the stream, since
    the engine may stop at `<|call|>` without showing it) and its arguments parse as a JSON
    object (otherwise its text is content, verbatim). The library's parser is made on first
    use, so building the worker's configuration needs no vocabulary.
    """

    requires_special_tokens = True
    handles_reasoning = True

    def __init__(self, tools: ToolsArg = (), *, prompt: str | None = None) -> None:
        super().__init__(tools, prompt=prompt)
        self._splitter = MarkerSplitter(CONTROL_TOKENS)
        self._stream: StreamableParser | None = None
        self._degraded = False
        self._raw: list[str] = []  # text fed but not yet released (a header, a tool message)
        self._raw_len = 0
        self._done = 0  # messages of the library's parser already routed
        self._last_message: dict[str, int] = {}  # field -> index of the message last written

    @property
    def reasoning_ended(self) -> bool:
        stream = self._stream
        return stream is None or self._degraded or stream.current_channel != "analysis"

    def _feed(self, delta: str, out: Emission) -> None:
        for text, marker in self._splitter.feed(delta):
            if text:
                self._piece(text, False, out)
            if marker is not None:
                self._piece(marker, True, out)

    def _finish(self, out: Emission) -> None:
        rest = self._splitter.finish()
        if rest:
            self._piece(rest, False, out)
        if self._degraded:
            return
        stream = self._parser()
        try:
            stream.process_eos()  # closes an open message (the engine stopped at <|call|>...)
        except HarmonyError as exc:
            self._degrade(out, exc)
            return
        self._route(stream, out)

    # ---- feeding the library's parser ---------------------------------------------------
    def _parser(self) -> StreamableParser:
        if self._stream is None:
            self._stream = StreamableParser(encoding(), Role.ASSISTANT)
        return self._stream

    def _piece(self, text: str, special: bool, out: Emission) -> None:
        if self._degraded:
            out.content.append(text)
            return
        stream = self._parser()
        enc = encoding()
        ids = (enc.encode(text, allowed_special={text}) if special
               else enc.encode(text, disallowed_special=()))
        self._raw.append(text)
        self._raw_len += len(text)
        try:
            for token in ids:
                stream.process(token)
                self._route(stream, out)
        except HarmonyError as exc:
            self._degrade(out, exc)
            return
        state = stream.state
        if state is StreamState.HEADER and self._raw_len > MAX_HEADER_CHARS:
            self._degrade(out, "no <|message|> after a long header")
        elif state is StreamState.EXPECT_START or (
                state is StreamState.CONTENT and stream.current_recipient is None):
            self._clear_raw()  # all of it was routed

    def _clear_raw(self) -> None:
        self._raw.clear()
        self._raw_len = 0

    def _degrade(self, out: Emission, why: object) -> None:
        """What the library refused, and all after it, is content as written."""
        logger.warning("harmony: output is not in the harmony format (%s): kept as content", why)
        self._degraded = True
        out.content.append("".join(self._raw))
        self._clear_raw()

    # ---- routing ------------------------------------------------------------------------
    def _route(self, stream: StreamableParser, out: Emission) -> None:
        messages = stream.messages
        while self._done < len(messages):  # messages that ended since the last token
            self._ended(messages[self._done], self._done, out)
            self._done += 1
        delta = stream.last_content_delta
        if delta and stream.state is StreamState.CONTENT and stream.current_recipient is None:
            self._write(self._field(stream.current_channel), delta, self._done, out)

    def _ended(self, message: Message, index: int, out: Emission) -> None:
        if message.recipient is None:
            return  # its content was written delta by delta
        text = "".join(getattr(part, "text", "") for part in message.content)
        name = message.recipient.removeprefix(FUNCTIONS)
        arguments = _json_object(text)
        if arguments is None:
            logger.warning("harmony: the call to %r has arguments that are not a JSON object: "
                           "kept as content", name)
            self._write("content", text, index, out)
        else:
            self._emit_call(out, name, arguments)
        self._clear_raw()

    @staticmethod
    def _field(channel: str | None) -> str:
        return "reasoning" if channel == "analysis" else "content"

    def _write(self, field: str, text: str, index: int, out: Emission) -> None:
        sink = out.reasoning if field == "reasoning" else out.content
        last = self._last_message.get(field)
        if last is not None and last != index:
            sink.append(MESSAGE_SEPARATOR)
        self._last_message[field] = index
        sink.append(text)


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
