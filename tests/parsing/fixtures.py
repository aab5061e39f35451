"""Model outputs in each format, with the message each must parse to (written by hand).

Sources of the formats (the texts are modelled on each document's own examples):
- hermes: NousResearch "Hermes-Function-Calling" README (Hermes 2 Pro / 3), and Qwen's
  "Function Calling" guide for Qwen2.5 (qwen.readthedocs.io), whose example calls
  get_current_temperature / get_temperature_date; Qwen3 adds `<think>` in front.
- llama3_json: Meta's Llama 3.1 model card / prompt format ("JSON based tool calling",
  `{"name": ..., "parameters": ...}`, `<|python_tag|>` under `Environment: ipython`) and
  Llama 3.2's; vLLM's tool_chat_template_llama3.1_json separates several calls with `;`.
- mistral: mistral-common's tokenizer docs: `[TOOL_CALLS][{"name", "arguments"}]` (v3-v7)
  and `[TOOL_CALLS]name[ARGS]{...}` (v11+), with Mistral's get_current_weather example.
- pythonic: Llama 3.2's prompt format ("[func_name1(params_name1=params_value1, ...)]",
  example `[get_user_info(user_id=7890, special='black')]`) and Llama 4's, wrapped in
  `<|python_start|>…<|python_end|>`.
- think: DeepSeek-R1's README (the template starts the reply with `<think>\\n`) and Qwen3's
  model card (`<think>\\n…\\n</think>\\n\\n` then the answer; an empty block when not thinking).
- channel: the format of vLLM #51655 (recipient-addressed messages, ATEM function calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _tool(name: str, **properties: str) -> dict[str, Any]:
    props = {key: {"type": kind} for key, kind in properties.items()}
    return {"type": "function",
            "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


TOOLS = [
    _tool("get_stock_fundamentals", symbol="string"),
    _tool("get_current_temperature", location="string", unit="string"),
    _tool("get_temperature_date", location="string", date="string", unit="string"),
    _tool("get_current_conditions", location="string", unit="string"),
    _tool("get_current_weather", location="string", format="string"),
    _tool("get_current_time", timezone="string"),
    _tool("get_user_info", user_id="integer", special="string"),
    _tool("get_weather", location="string", days="integer", detailed="boolean"),
    _tool("search", query="string", filters="object", limit="integer"),
    _tool("calendar.get", date="string"),
]


@dataclass(frozen=True)
class Fixture:
    """A model output, the parsers to read it with, and the message it must give."""

    id: str
    tools: str | None  # tool parser name
    reasoning: str | None  # reasoning parser name
    text: str
    content: str | None
    reasoning_text: str | None = None
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()
    prompt: str | None = None  # the rendered prompt, for a reasoning parser that reads it


HERMES = [
    Fixture("hermes-2-pro", "hermes", None,
            '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n'
            '</tool_call>',
            None, calls=(("get_stock_fundamentals", {"symbol": "TSLA"}),)),
    Fixture("qwen2.5-two-calls", "hermes", None,
            '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
            '"San Francisco, CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": '
            '"get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
            '"date": "2024-10-01"}}\n</tool_call>',
            None, calls=(("get_current_temperature", {"location": "San Francisco, CA, USA"}),
                         ("get_temperature_date", {"location": "San Francisco, CA, USA",
                                                   "date": "2024-10-01"}))),
    Fixture("hermes-text-around", "hermes", None,
            "Let me look that up.\n\n<tool_call>\n"
            '{"name": "get_current_time", "arguments": {"timezone": "Asia/Tōkyō 東京"}}\n'
            "</tool_call>\nOne moment…",
            "Let me look that up.\n\n\nOne moment…",
            calls=(("get_current_time", {"timezone": "Asia/Tōkyō 東京"}),)),
    Fixture("hermes-no-call", "hermes", None,
            "Compare with a < b, then x<y; <tool> is not a tag.",
            "Compare with a < b, then x<y; <tool> is not a tag."),
    Fixture("qwen3-think-then-call", "hermes", "qwen3",
            "<think>\nThe user wants the temperature in Paris, so I call the tool.\n</think>\n\n"
            '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
            '"Paris, France", "unit": "celsius"}}\n</tool_call>',
            None, "The user wants the temperature in Paris, so I call the tool.",
            (("get_current_temperature", {"location": "Paris, France", "unit": "celsius"}),)),
]

LLAMA3 = [
    Fixture("llama3.1-json", "llama3_json", None,
            '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA",'
            ' "unit": "Fahrenheit"}}',
            None, calls=(("get_current_conditions",
                          {"location": "San Francisco, CA", "unit": "Fahrenheit"}),)),
    Fixture("llama3.1-python-tag", "llama3_json", None,
            '<|python_tag|>{"name": "get_current_conditions", "parameters": {"location": '
            '"Menlo Park, CA", "unit": "Celsius"}}',
            None, calls=(("get_current_conditions",
                          {"location": "Menlo Park, CA", "unit": "Celsius"}),)),
    Fixture("llama3.2-two-calls", "llama3_json", None,
            '{"name": "get_current_time", "parameters": {"timezone": "UTC"}}; '
            '{"name": "get_weather", "arguments": {"location": "Oslo", "days": 2}}',
            None, calls=(("get_current_time", {"timezone": "UTC"}),
                         ("get_weather", {"location": "Oslo", "days": 2}))),
    Fixture("llama3-plain-answer", "llama3_json", None,
            "It is sunny in San Francisco {mostly}; see <https://weather.gov>.",
            "It is sunny in San Francisco {mostly}; see <https://weather.gov>."),
    Fixture("llama3-json-answer", "llama3_json", None,
            '{"answer": 42, "note": "not a call"}',
            '{"answer": 42, "note": "not a call"}'),
]

MISTRAL = [
    Fixture("mistral-v3-array", "mistral", None,
            '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": '
            '"Paris, France", "format": "celsius"}}]',
            None, calls=(("get_current_weather",
                          {"location": "Paris, France", "format": "celsius"}),)),
    Fixture("mistral-v11", "mistral", None,
            '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", '
            '"format": "celsius"}',
            None, calls=(("get_current_weather",
                          {"location": "Paris, France", "format": "celsius"}),)),
    Fixture("mistral-v11-two-calls", "mistral", None,
            'Checking both.[TOOL_CALLS]get_current_weather[ARGS]{"location": "Rome", '
            '"format": "celsius"}[TOOL_CALLS]get_current_time[ARGS]{"timezone": "Europe/Rome"}',
            "Checking both.",
            calls=(("get_current_weather", {"location": "Rome", "format": "celsius"}),
             ("get_current_time", {"timezone": "Europe/Rome"}))),
    Fixture("mistral-plain-answer", "mistral", None,
            "Results [1] and [2] agree; [TOOL] is not the tag.",
            "Results [1] and [2] agree; [TOOL] is not the tag."),
]

PYTHONIC = [
    Fixture("llama3.2-pythonic", "pythonic", None,
            "[get_user_info(user_id=7890, special='black')]",
            None, calls=(("get_user_info", {"user_id": 7890, "special": "black"}),)),
    Fixture("pythonic-literals", "pythonic", None,
            '[search(query="a [b] (c)", filters={"tags": ["x", \'y\'], "min": -1.5}, '
            "limit=None), get_weather(location='Bergen', days=3, detailed=true)]",
            None, calls=(("search", {"query": "a [b] (c)",
                                     "filters": {"tags": ["x", "y"], "min": -1.5},
                                     "limit": None}),
                         ("get_weather", {"location": "Bergen", "days": 3, "detailed": True}))),
    Fixture("llama4-wrapped", "pythonic", None,
            '<|python_start|>[get_weather(location="Menlo Park, CA")]<|python_end|>',
            None, calls=(("get_weather", {"location": "Menlo Park, CA"}),)),
    Fixture("pythonic-then-text", "pythonic", None,
            '[get_current_time(timezone="UTC")]\nChecking the clock.',
            "Checking the clock.", calls=(("get_current_time", {"timezone": "UTC"}),)),
    Fixture("pythonic-prose", "pythonic", None,
            "[Note] the answer (as asked) is 42.", "[Note] the answer (as asked) is 42."),
]

THINK = [
    Fixture("qwen3-think", None, "qwen3",
            "<think>\nOkay, 2 + 2 is 4; nothing < that.\n</think>\n\nThe answer is 4.",
            "The answer is 4.", "Okay, 2 + 2 is 4; nothing < that."),
    Fixture("deepseek-r1-opened", None, "deepseek_r1",
            "The user asks for 2 + 2.\nThat is 4.\n</think>\n\n**4**",
            "**4**", "The user asks for 2 + 2.\nThat is 4."),
    Fixture("think-prompt-opened", None, "think",
            "Short.</think>Done.", "Done.", "Short.",
            prompt="<|im_start|>assistant\n<think>\n"),
    Fixture("qwen3-not-thinking", None, "qwen3", "Hello! How can I help?",
            "Hello! How can I help?"),
    Fixture("qwen3-empty-think", None, "qwen3", "<think>\n\n</think>\n\nHello!", "Hello!"),
    Fixture("deepseek-r1-truncated", None, "deepseek_r1",
            "<think>\nStill working on whether x", None, "Still working on whether x"),
]

_SELF = "<|start|>assistant to=self<|message|>"
_USER = "<|start|>assistant to=user<|message|>"


def _invoke(name: str, **params: str) -> str:
    body = "".join(f'<atem:parameter name="{k}">{v}</atem:parameter>' for k, v in params.items())
    return f'<atem:invoke name="{name}">{body}</atem:invoke>'


def _calls(*invokes: str) -> str:
    return "<atem:function_calls>" + "".join(invokes) + "</atem:function_calls>"


CHANNEL = [
    Fixture("channel-reason-call", "channel", None,
            " to=self<|message|>The user wants Oslo's weather.<|eom|>"
            "<|start|>assistant to=get_weather<|message|>"
            + _calls(_invoke("get_weather", location="Oslo", days="2")) + "<|eom|>",
            None, "The user wants Oslo's weather.",
            (("get_weather", {"location": "Oslo", "days": 2}),)),
    Fixture("channel-reason-answer", "channel", None,
            f"{_SELF}Simple arithmetic: 6 × 7.<|eom|>{_USER}It is 42 — café ☕.<|eot|>",
            "It is 42 — café ☕.", "Simple arithmetic: 6 × 7."),
    Fixture("channel-headerless-switch", "channel", None,
            " to=self<|message|>Need two lookups. to=search<|message|>"
            + _calls(_invoke("search", query="42", filters='{"lang": "en"}'),
                     _invoke("calendar.get", date="2025-01-01")) + "<|eom|>",
            None, "Need two lookups.",
            (("search", {"query": "42", "filters": {"lang": "en"}}),
             ("calendar.get", {"date": "2025-01-01"}))),
    Fixture("channel-missing-eom", "channel", None,
            f"{_SELF}Check first.<|start|>assistant to=get_current_time<|message|>"
            + _calls(_invoke("get_current_time.get_current_time", timezone="UTC"))
            + f"{_USER}Checking the time now.<|eot|>",
            "Checking the time now.", "Check first.",
            (("get_current_time", {"timezone": "UTC"}),)),
    Fixture("channel-bare-answer", "channel", None,
            "<|start|>assistant<|message|>Hi <there> & welcome.<|eot|>",
            "Hi <there> & welcome."),
]

ALL = HERMES + LLAMA3 + MISTRAL + PYTHONIC + THINK + CHANNEL

# Structural markers whose full or partial text must never reach content or reasoning
# before the stream ends (none of the fixtures' expected texts contain them).
LEAK_MARKERS = ("<tool_call", "</tool_call", "<|", "<atem:", "</atem:", "[TOOL_CALLS]",
                "[ARGS]", "<think", "</think")
