"""Parsers by name, as the CLI and the worker pick them (`--tool-call-parser hermes`).

Tool parsers are classes built per request with the request's `tools`; reasoning parsers are
factories built per request with the rendered prompt when the caller has it (a template that
opens `<think>` itself makes the generation start inside reasoning). Names follow vLLM's.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

from shared.parsing.base import StreamParser, ToolParser
from shared.parsing.channel import ChannelParser
from shared.parsing.harmony import HarmonyParser
from shared.parsing.hermes import HermesToolParser
from shared.parsing.llama3_json import Llama3JsonToolParser
from shared.parsing.mistral import MistralToolParser
from shared.parsing.pythonic import PythonicToolParser
from shared.parsing.think import ThinkParser, prompt_opens_reasoning


class ReasoningParserFactory(Protocol):
    """Builds a request's reasoning parser; `prompt` is the rendered prompt, if known."""

    def __call__(self, *, prompt: str | None = None) -> StreamParser: ...


def _think(starts_in_reasoning: bool) -> ReasoningParserFactory:
    """`<think>` parsing; without a prompt to look at, the generation is taken to start inside
    reasoning only where that model family's template opens it (DeepSeek-R1's does)."""

    def make(*, prompt: str | None = None) -> StreamParser:
        opened = starts_in_reasoning if prompt is None else prompt_opens_reasoning(prompt)
        return ThinkParser(starts_in_reasoning=opened)

    return make


def _channel(*, prompt: str | None = None) -> StreamParser:
    """As a reasoning parser the channel parser is the same class, offered no tools: it still
    reports the calls it finds (to unoffered names, with a warning); the caller decides."""
    return ChannelParser((), prompt=prompt)


def _harmony(*, prompt: str | None = None) -> StreamParser:
    """gpt-oss's harmony format frames the whole turn, like the channel format: as a reasoning
    parser it is the same class, offered no tools."""
    return HarmonyParser((), prompt=prompt)


TOOL_PARSERS: Mapping[str, type[ToolParser]] = MappingProxyType({
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "llama4_pythonic": PythonicToolParser,  # vLLM's name for Llama 4's use of the format
    "channel": ChannelParser,
    "openai": HarmonyParser,  # vLLM's name for gpt-oss's harmony tool calls
    "harmony": HarmonyParser,
})

REASONING_PARSERS: Mapping[str, ReasoningParserFactory] = MappingProxyType({
    "think": _think(False),
    "qwen3": _think(False),
    "deepseek_r1": _think(True),
    "channel": _channel,
    "openai_gptoss": _harmony,  # vLLM's name for gpt-oss's harmony reasoning
    "harmony": _harmony,
})


def get_tool_parser(name: str) -> type[ToolParser]:
    """The tool parser class called `name`; build it per request as
    `cls(request_tools, prompt=rendered_prompt)`."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; valid: "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None


def get_reasoning_parser(name: str) -> ReasoningParserFactory:
    """The reasoning parser factory called `name`; build it per request as
    `factory(prompt=rendered_prompt)`."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; valid: "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None
