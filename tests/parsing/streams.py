"""Helpers of the parsing tests: build a fixture's parser, feed it in chunks, compare messages."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from shared.parsing import (
    ChatStreamParser,
    ExtractedMessage,
    get_reasoning_parser,
    get_tool_parser,
)
from tests.parsing.fixtures import TOOLS, Fixture


def build(fixture: Fixture) -> ChatStreamParser:
    reasoning = (get_reasoning_parser(fixture.reasoning)(prompt=fixture.prompt)
                 if fixture.reasoning else None)
    tools = get_tool_parser(fixture.tools)(TOOLS) if fixture.tools else None
    return ChatStreamParser(reasoning, tools)


def stream(parser: ChatStreamParser, chunks: Iterable[str]) -> ExtractedMessage:
    """Feed every chunk, then finish; the message the deltas add up to."""
    deltas = [parser.feed(chunk) for chunk in chunks]
    deltas.append(parser.finish())
    return ExtractedMessage.join(deltas)


def chunked(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def summary(message: ExtractedMessage) -> tuple[Any, ...]:
    """A message without its (fresh, random) call ids: content, reasoning, (name, args)."""
    calls = tuple((c.name, json.loads(c.arguments)) for c in message.tool_calls)
    return message.content, message.reasoning, calls


def expected(fixture: Fixture) -> tuple[Any, ...]:
    return fixture.content, fixture.reasoning_text, fixture.calls

