"""Any text, however split: streaming equals the complete parse, and released text only grows.

Texts are drawn from each format's marker fragments, half-markers and filler, so they hit
malformed, truncated and interleaved structure the fixtures do not. The expectation is the
parser's own complete parse (the properties are about streaming, not about the format).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.parsing import (
    ChatStreamParser,
    DeltaMessage,
    ExtractedMessage,
    ThinkParser,
    get_tool_parser,
)
from tests.parsing.fixtures import TOOLS
from tests.parsing.streams import stream, summary

_FILLER = ["x", " ", "\n", "<", "[", "{", "}", '"']
_THINK = ["<think>", "</think>", "</", "think>"]
PIECES = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool",
               '{"name": "search", "arguments": {"query": "a"}}'],
    "llama3_json": ["<|python_tag|>", '{"name": "search", "parameters": {"query": "a"}}', ";",
                    "\\", "<|"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "search", '{"query": "a"}', "]",
                '[{"name": "search", "arguments": {}}]'],
    "pythonic": ["]", "search(query='a')", 'search(query="b")', ", ", "(", ")", "'",
                 "<|python_start|>", "<|python_end|>"],
    "channel": ["<|start|>", "assistant", " to=self", " to=user", " to=search", "<|message|>",
                "<|eom|>", "<|eot|>", "<atem:function_calls>", "</atem:function_calls>",
                '<atem:invoke name="search">', "</atem:invoke>", 'name="q">', "to=", "1",
                '<atem:parameter name="query">', "</atem:parameter>"],
}
PARSERS: dict[str, Callable[[], ChatStreamParser]] = {
    name: (lambda name=name: ChatStreamParser(None, get_tool_parser(name)(TOOLS)))
    for name in PIECES
}
PARSERS["think"] = lambda: ChatStreamParser(ThinkParser())
PARSERS["think-opened"] = lambda: ChatStreamParser(ThinkParser(starts_in_reasoning=True))
PARSERS["qwen3+hermes"] = lambda: ChatStreamParser(
    ThinkParser(), get_tool_parser("hermes")(TOOLS))
PIECES.update({"think": _THINK, "think-opened": _THINK,
               "qwen3+hermes": _THINK + PIECES["hermes"]})


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_streaming_any_text_equals_its_complete_parse(name: str) -> None:
    make, pieces = PARSERS[name], PIECES[name] + _FILLER

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(parts=st.lists(st.sampled_from(pieces), max_size=30), data=st.data())
    def check(parts: list[str], data: st.DataObject) -> None:
        text = "".join(parts)
        full = summary(make().parse(text))
        cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert summary(stream(make(), chunks)) == full
        parser = make()
        deltas: list[DeltaMessage] = []
        for char in text:
            deltas.append(parser.feed(char))
            so_far = ExtractedMessage.join(deltas)
            assert (full[0] or "").startswith(so_far.content or "")
            assert (full[1] or "").startswith(so_far.reasoning or "")
            assert summary(so_far)[2] == full[2][:len(so_far.tool_calls)]
        assert summary(ExtractedMessage.join([*deltas, parser.finish()])) == full

    logging.disable(logging.WARNING)  # malformed input warns by design; not the point here
    try:
        check()
    finally:
        logging.disable(logging.NOTSET)
