"""Tool-call and reasoning parsers of generated chat text (issue 15).

Each parser is a per-request incremental scanner (`StreamParser`): `feed(delta)` returns what
can no longer change, `finish()` flushes the end, `parse(text)` parses a complete text with
the same code. Pick them by name (`get_tool_parser`, `get_reasoning_parser`) and chain them
per request with `ChatStreamParser`. Pure Python; the harmony format (gpt-oss) uses
openai-harmony, whose vocabulary the worker loads at startup (harmony_encoding.py).
"""

from shared.parsing.base import StreamParser, ToolParser
from shared.parsing.channel import ChannelParser
from shared.parsing.chat_stream import ChatStreamParser
from shared.parsing.harmony import HarmonyParser
from shared.parsing.hermes import HermesToolParser
from shared.parsing.llama3_json import Llama3JsonToolParser
from shared.parsing.messages import (
    DeltaMessage,
    ExtractedMessage,
    ToolCall,
    ToolCallDelta,
    new_tool_call_id,
)
from shared.parsing.mistral import MistralToolParser
from shared.parsing.pythonic import PythonicToolParser
from shared.parsing.registry import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ReasoningParserFactory,
    get_reasoning_parser,
    get_tool_parser,
)
from shared.parsing.think import ThinkParser, prompt_opens_reasoning
from shared.parsing.tools import ToolSet, ToolSpec

__all__ = [
    "REASONING_PARSERS", "TOOL_PARSERS", "ChannelParser", "ChatStreamParser", "DeltaMessage",
    "ExtractedMessage", "HarmonyParser", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
    "PythonicToolParser", "ReasoningParserFactory", "StreamParser", "ThinkParser", "ToolCall",
    "ToolCallDelta", "ToolParser", "ToolSet", "ToolSpec", "get_reasoning_parser",
    "get_tool_parser", "new_tool_call_id", "prompt_opens_reasoning",
]
