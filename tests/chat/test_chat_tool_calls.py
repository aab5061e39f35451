"""Tool calls and reasoning through the worker's chat API, with the openai SDK unchanged.

The fake engine writes exactly a scripted text (one byte token each), so each test knows what
the parsers must make of it: hermes calls with tool_choice "auto", `<think>` reasoning
(qwen3), calls read back from a grammar's JSON for "required" and a named function, "none",
and the 400 of "auto" on a worker not set up for it. Streamed and non-streamed answers agree.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import openai
import pytest

from shared.parsing.think import THINK_CLOSE
from tests.chat.conftest import FakeServer
from tests.support.fake_engine import FakeTokenizer
from tests.support.worker import MODEL

TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]
MSGS: list[Any] = [{"role": "user", "content": "Weather and time in Paris?"}]
WEATHER = {"city": "Paris", "unit": "celsius"}
REASONING = "Two lookups."
CALLS = (f'<tool_call>{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}</tool_call>'
         '<tool_call>{"name": "get_time", "arguments": {"city": "Paris"}}</tool_call>')
SCRIPT = f"<think>{REASONING}</think>Let me check.{CALLS}"


def reasoning_tokens(reasoning: str) -> int:
    """An independent count: the reasoning's tokens plus the closing marker's (the token that
    ends the reasoning counts, the one that opens it does not: see parsed_choice.py)."""
    tok = FakeTokenizer()
    return len(tok.encode(reasoning, False)) + len(tok.encode(THINK_CLOSE, False))


def extra(obj: Any, key: str) -> Any:
    """A field the SDK's models do not declare (reasoning_content, reasoning)."""
    return (obj.model_extra or {}).get(key)


def calls_of(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_auto_calls_reasoning_and_usage_non_streamed(agent: FakeServer) -> None:
    agent.say(SCRIPT)
    reply = agent.client().chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, n=2)
    for choice in reply.choices:
        message = choice.message
        assert calls_of(message) == [("get_weather", WEATHER), ("get_time", {"city": "Paris"})]
        assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function"
                   for c in message.tool_calls or [])
        assert message.content == "Let me check."
        assert extra(message, "reasoning_content") == extra(message, "reasoning") == REASONING
        assert choice.finish_reason == "tool_calls"
    assert len({c.id for ch in reply.choices for c in ch.message.tool_calls or []}) == 4
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 2 * reasoning_tokens(REASONING)
    # The template saw the tools, and hermes needs its markers: special tokens were kept.
    assert agent.engine.seen_params[-1].skip_special_tokens is False


def test_only_calls_give_null_content(agent: FakeServer) -> None:
    agent.say(CALLS)
    message = agent.client().chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS).choices[0].message
    assert message.content is None and len(message.tool_calls or []) == 2
    assert extra(message, "reasoning_content") is None  # key present: a reasoning parser is set


def test_stream_assembles_to_the_non_streamed_answer(agent: FakeServer) -> None:
    agent.say(SCRIPT)
    client = agent.client()
    whole = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS)
    with client.chat.completions.stream(model=MODEL, messages=MSGS, tools=TOOLS,
                                        stream_options={"include_usage": True}) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    assert calls_of(final.choices[0].message) == calls_of(whole.choices[0].message)
    assert final.choices[0].message.content == whole.choices[0].message.content
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [extra(d, "reasoning_content") for d in deltas if extra(d, "reasoning_content")]
    assert "".join(reasoning) == REASONING
    assert all(extra(d, "reasoning") == extra(d, "reasoning_content") for d in deltas)
    streamed_calls = [call for d in deltas for call in d.tool_calls or []]
    assert [c.index for c in streamed_calls] == [0, 1]  # each call once, whole
    assert all(c.id and c.function and c.function.name for c in streamed_calls)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == reasoning_tokens(REASONING)
    assert whole.usage is not None and usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call_only(agent: FakeServer,
                                                             stream: bool) -> None:
    """vLLM's rule for tool_choice auto: the calls after the first are dropped (the model wrote
    two here), streamed or not; the content and the finish reason stay."""
    agent.say(SCRIPT)
    kwargs: Any = {"model": MODEL, "messages": MSGS, "tools": TOOLS,
                   "parallel_tool_calls": False}
    client = agent.client()
    if stream:
        with client.chat.completions.stream(**kwargs) as s:
            chunks = [event.chunk for event in s if event.type == "chunk"]
            choice = s.get_final_completion().choices[0]
        streamed = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
        assert [c.index for c in streamed] == [0]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
    assert calls_of(choice.message) == [("get_weather", WEATHER)]
    assert choice.message.content == "Let me check."
    assert choice.finish_reason == "tool_calls"
    both = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS,
                                          parallel_tool_calls=True).choices[0]
    assert len(calls_of(both.message)) == 2


def test_a_call_cut_by_max_tokens_is_not_a_call(agent: FakeServer) -> None:
    agent.say(SCRIPT)
    cut = len(SCRIPT.encode()) - 20  # inside the second call's arguments
    choice = agent.client().chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=cut).choices[0]
    assert choice.finish_reason == "length"
    assert calls_of(choice.message) == [("get_weather", WEATHER)]  # the first one closed
    assert "<tool_call" not in (choice.message.content or "")


def test_tool_choice_none_reads_no_calls_and_hides_the_tools(agent: FakeServer) -> None:
    agent.say(f"Plain.{CALLS}")
    client = agent.client()
    reply = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS,
                                           tool_choice="none")
    without = client.chat.completions.create(model=MODEL, messages=MSGS)
    message = reply.choices[0].message
    assert message.tool_calls is None and message.content == f"Plain.{CALLS}"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and without.usage is not None
    assert reply.usage.prompt_tokens == without.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_become_calls(agent: FakeServer, stream: bool) -> None:
    client = agent.client()
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    cases = [("required", '[{"name": "get_time", "parameters": {"city": "Oslo"}}]',
              [("get_time", {"city": "Oslo"})]),
             (named, json.dumps(WEATHER), [("get_weather", WEATHER)])]
    for tool_choice, script, expected in cases:
        agent.say(f"<think>{REASONING}</think>{script}")
        kwargs: Any = {"model": MODEL, "messages": MSGS, "tools": TOOLS,
                       "tool_choice": tool_choice}
        if stream:
            with client.chat.completions.stream(**kwargs) as s:
                reply = s.get_final_completion()
        else:
            reply = client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        # Streamed, the SDK starts content from the role chunk's "" (as with vLLM).
        assert calls_of(choice.message) == expected and not choice.message.content
        assert choice.finish_reason == "tool_calls"
        spec = agent.engine.seen_params[-1].structured
        # A reasoning parser is set: the grammar waits for the end of the reasoning.
        assert spec is not None and spec.reasoning_first
        assert spec.reasoning_end_ids == tuple(THINK_CLOSE.encode())


def test_required_cut_short_is_plain_content(agent: FakeServer) -> None:
    agent.say('[{"name": "get_time", "parameters": {"city": "Oslo"}}]')
    choice = agent.client().chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=10).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content == '[{"name":'  # the reasoning parser trims the edges


def test_a_prompt_that_closed_reasoning_gets_its_grammar_at_once(agent: FakeServer) -> None:
    agent.say('{"a": 1}')
    closed: Any = [*MSGS, {"role": "assistant", "content": "<think></think>"}]
    reply = agent.client().chat.completions.create(
        model=MODEL, messages=closed, response_format={"type": "json_object"},
        extra_body={"add_generation_prompt": False})
    spec = agent.engine.seen_params[-1].structured
    assert spec is not None and not spec.reasoning_first and not spec.reasoning_end_ids
    assert reply.choices[0].message.content == '{"a": 1}'
    assert agent.engine.seen_params[-1].skip_special_tokens is True  # no tool parser here


def test_auto_needs_the_flags(plain: FakeServer) -> None:
    plain.say("Hello")
    client = plain.client()
    for choice in (openai.NOT_GIVEN, "auto"):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS,
                                           tool_choice=choice)
        assert "--enable-auto-tool-choice" in err.value.message
        assert err.value.body is not None and err.value.body["param"] == "tool_choice"
    # Without a parser nothing changes: verbatim text, no reasoning keys, no usage details.
    reply = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS,
                                           tool_choice="none")
    assert reply.choices[0].message.content == "Hello"
    assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})
    assert reply.usage is not None and reply.usage.completion_tokens_details is None


def test_metadata_names_the_parsers(agent: FakeServer) -> None:
    with urllib.request.urlopen(f"{agent.worker.url}/v1/metadata", timeout=10) as resp:
        parsers = json.loads(resp.read())["parsers"]
    assert parsers == {"tool_call_parser": "hermes", "reasoning_parser": "qwen3",
                       "enable_auto_tool_choice": True}
