"""Parsers by name, and the per-request chain of a reasoning parser and a tool parser."""

from __future__ import annotations

import pytest

from shared.parsing import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ChannelParser,
    ChatStreamParser,
    ExtractedMessage,
    HermesToolParser,
    ThinkParser,
    get_reasoning_parser,
    get_tool_parser,
)
from tests.parsing.fixtures import TOOLS
from tests.parsing.streams import summary


def test_the_registries_name_every_parser() -> None:
    assert {"hermes", "llama3_json", "mistral", "pythonic", "channel"} <= set(TOOL_PARSERS)
    assert {"think", "deepseek_r1", "qwen3", "channel"} <= set(REASONING_PARSERS)
    assert get_tool_parser("hermes") is HermesToolParser
    assert isinstance(get_reasoning_parser("qwen3")(), ThinkParser)
    assert isinstance(get_reasoning_parser("channel")(prompt="x"), ChannelParser)


@pytest.mark.parametrize("lookup", [get_tool_parser, get_reasoning_parser])
def test_an_unknown_name_lists_the_valid_ones(lookup: object) -> None:
    with pytest.raises(ValueError) as err:
        lookup("nope")  # type: ignore[operator]
    assert "'nope'" in str(err.value) and "channel" in str(err.value)


@pytest.mark.parametrize(("name", "required"), [
    ("hermes", True), ("mistral", True), ("channel", True),
    ("llama3_json", False), ("pythonic", False),
])
def test_which_formats_need_special_tokens_kept(name: str, required: bool) -> None:
    parser = get_tool_parser(name)(TOOLS)
    assert parser.requires_special_tokens is required
    chain = ChatStreamParser(get_reasoning_parser("think")(), parser)
    assert chain.requires_special_tokens is required
    assert not ChatStreamParser(get_reasoning_parser("think")()).requires_special_tokens


def test_a_chain_without_parsers_passes_text_through() -> None:
    chain = ChatStreamParser()
    assert chain.feed(" <tool_call> ").content == " <tool_call> "
    assert chain.reasoning_ended and not chain.requires_special_tokens
    assert chain.parse("x") == ExtractedMessage("x", None, ())


def test_tool_calls_inside_reasoning_are_not_calls() -> None:
    chain = ChatStreamParser(get_reasoning_parser("qwen3")(), HermesToolParser(TOOLS))
    text = ('<think>maybe <tool_call>{"name": "search", "arguments": {}}</tool_call></think>'
            '<tool_call>{"name": "get_weather", "arguments": {"days": 1}}</tool_call>')
    assert summary(chain.parse(text)) == (
        None, 'maybe <tool_call>{"name": "search", "arguments": {}}</tool_call>',
        (("get_weather", {"days": 1}),))


def test_the_channel_tool_parser_replaces_the_reasoning_parser() -> None:
    chain = ChatStreamParser(get_reasoning_parser("qwen3")(), ChannelParser(TOOLS))
    assert chain.reasoning is None
    text = " to=self<|message|>r<|eom|><|start|>assistant to=user<|message|>c<|eot|>"
    assert summary(chain.parse(text)) == ("c", "r", ())


def test_the_channel_reasoning_parser_refuses_another_tool_parser() -> None:
    with pytest.raises(ValueError):
        ChatStreamParser(get_reasoning_parser("channel")(), HermesToolParser(TOOLS))


def test_streamed_calls_are_indexed_in_order_across_the_chain() -> None:
    chain = ChatStreamParser(get_reasoning_parser("qwen3")(), HermesToolParser(TOOLS))
    text = "<think>r</think>" + "".join(
        f'<tool_call>{{"name": "search", "arguments": {{"limit": {i}}}}}</tool_call>'
        for i in range(3))
    deltas = [chain.feed(c) for c in text] + [chain.finish()]
    calls = [c for d in deltas for c in d.tool_calls]
    assert [c.index for c in calls] == [0, 1, 2]
    assert [c.arguments for c in calls] == [f'{{"limit": {i}}}' for i in range(3)]


def test_reasoning_tokens_counted_through_the_chain() -> None:
    """Per token: feed its text, then count it if reasoning has not ended."""
    tokens = ["<think>", "I", " should", " call", ".", "</think>", "<tool_call>",
              '{"name": "search", "arguments": {}}', "</tool_call>"]
    chain = ChatStreamParser(get_reasoning_parser("qwen3")(), HermesToolParser(TOOLS))
    counts = []
    for token in tokens:
        chain.feed(token)
        counts.append(not chain.reasoning_ended)
    assert sum(counts) == 5 and counts[:5] == [True] * 5


def test_reasoning_tokens_of_the_channel_format() -> None:
    tokens = [" to=self", "<|message|>", "A", " B", "<|eom|>", "<|start|>", "assistant",
              " to=user", "<|message|>", "C", "<|eot|>"]
    chain = ChatStreamParser(None, ChannelParser(TOOLS))
    counted = 0
    for token in tokens:
        chain.feed(token)
        counted += not chain.reasoning_ended
    assert counted == 3  # <|message|> opening the self body, "A", " B"
