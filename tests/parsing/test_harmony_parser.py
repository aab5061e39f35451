"""The harmony parser (gpt-oss) against openai-harmony's own parse of the same tokens:
analysis -> reasoning_content, commentary to=functions.NAME -> tool calls, final (and
preambles) -> content; streamed in any split, the deltas add up to the whole parse; output
the library refuses degrades to content, never an exception."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from openai_harmony import Role

from shared.parsing import ChatStreamParser, ExtractedMessage, get_reasoning_parser, get_tool_parser
from shared.parsing.harmony_encoding import encoding
from tests.parsing.streams import chunked, stream, summary

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris", "note": "café ☀"}<|call|>')
OUTPUTS = {
    "reasoning_then_answer": '<|channel|>analysis<|message|>User greets. Reply.<|end|>'
                             '<|start|>assistant<|channel|>final<|message|>Hello — how can I help?'
                             '<|return|>',
    "reasoning_then_call": '<|channel|>analysis<|message|>Need the weather 🌦.<|end|>' + CALL,
    "preamble_and_two_calls": '<|channel|>analysis<|message|>Two cities.<|end|>'
                              '<|start|>assistant<|channel|>commentary<|message|>Checking both.'
                              '<|end|>' + CALL + CALL.replace("Paris", "Oslo"),
    "recipient_before_channel": '<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant'
                                ' to=functions.get_weather<|channel|>commentary json<|message|>'
                                '{"city": "Lima"}<|call|>',
    "stopped_before_call_token": '<|channel|>commentary to=functions.get_weather <|constrain|>json'
                                 '<|message|>{"city": "Rome"}',
}


def _parser() -> ChatStreamParser:
    return ChatStreamParser(get_reasoning_parser("openai_gptoss")(),
                            get_tool_parser("openai")(TOOLS))


def _reference(text: str) -> tuple[Any, ...]:
    """What openai-harmony itself makes of the text's tokens, in our message's shape."""
    enc = encoding()
    tokens = enc.encode(text, allowed_special="all")
    messages = enc.parse_messages_from_completion_tokens(tokens, Role.ASSISTANT)
    reasoning, content, calls = [], [], []
    for m in messages:
        text_of = "".join(part.text for part in m.content)
        if m.recipient is not None:
            calls.append((m.recipient.removeprefix("functions."), json.loads(text_of)))
        elif m.channel == "analysis":
            reasoning.append(text_of)
        else:
            content.append(text_of)
    return "\n".join(content) or None, "\n".join(reasoning) or None, tuple(calls)


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_parse_matches_openai_harmony(harmony_vocab_dir: Path, name: str) -> None:
    text = OUTPUTS[name]
    assert summary(_parser().parse(text)) == _reference(text)


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_streamed_deltas_add_up_to_the_parse(harmony_vocab_dir: Path, name: str) -> None:
    text = OUTPUTS[name]
    whole = summary(_parser().parse(text))
    enc = encoding()
    per_token = [enc.decode([t]) for t in enc.encode(text.replace("☀", "x").replace("🌦", "y")
                                                       .replace("—", "-").replace("é", "e"),
                                                       allowed_special="all")]
    ascii_whole = summary(_parser().parse("".join(per_token)))
    assert summary(stream(_parser(), per_token)) == ascii_whole  # as the detokenizer sends it
    rng = random.Random(name)
    for size in (1, 2, 7):
        assert summary(stream(_parser(), chunked(text, size))) == whole
    cuts = sorted(rng.sample(range(1, len(text)), 12))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert summary(stream(_parser(), pieces)) == whole


def test_reasoning_streams_before_the_answer(harmony_vocab_dir: Path) -> None:
    parser = _parser()
    first = parser.feed("<|channel|>analysis<|message|>Thinking")
    assert first.reasoning == "Thinking" and not parser.reasoning_ended
    parser.feed("<|end|><|start|>assistant<|channel|>final<|message|>")
    assert parser.reasoning_ended
    assert parser.feed("Done").content == "Done"


@pytest.mark.parametrize("text", [
    "Just plain text, no harmony framing at all.",
    "<|channel|>final<|message|>Cut off mid-ans",  # truncated by max_tokens
    "<|channel|>mystery<|message|>Unknown channel<|end|>",
    "<|start|>assistant<|start|>assistant<|channel|>final<|message|>x",  # stray start
    "<|channel|>commentary to=functions.get_weather<|message|>{\"city\": \"Par",  # cut call
    "<|channel|>analysis<|mess",  # cut inside a control token
])
def test_malformed_output_degrades_to_content(harmony_vocab_dir: Path, text: str) -> None:
    whole = _parser().parse(text)
    assert whole.tool_calls == ()
    assert summary(stream(_parser(), chunked(text, 3))) == summary(whole)
    if "<|channel|>analysis" not in text:
        assert whole.content and whole.reasoning is None


def test_the_vllm_names_and_harmony_are_one_parser(harmony_vocab_dir: Path) -> None:
    text = OUTPUTS["reasoning_then_call"]
    alone = get_tool_parser("harmony")(TOOLS).parse(text)
    assert summary(alone) == summary(_parser().parse(text))
    reasoning_only = ChatStreamParser(get_reasoning_parser("harmony")(), None).parse(text)
    assert isinstance(reasoning_only, ExtractedMessage)
    assert reasoning_only.reasoning == alone.reasoning
