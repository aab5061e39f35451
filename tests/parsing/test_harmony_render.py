"""gpt-oss prompts in harmony: our Chat Completions -> harmony conversion, rendered, equals
what openai-harmony renders from the conversation written directly with its own API (the
format's documented shape: system with reasoning effort, developer with instructions and
tools, earlier reasoning dropped); and the o200k vocabulary derived from a tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai_harmony import (
    Author,
    ChannelConfig,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from shared.model.chat_template import ChatTemplateError
from shared.model.harmony_template import render_harmony
from shared.parsing.harmony_encoding import encoding
from shared.parsing.harmony_vocab import VOCAB_FILE, derive_vocab, resolve_vocab_dir
from tests.support.harmony import gpt_oss_tokenizer_json, vocab_ranks

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": PARAMS}}]


def _reference(messages: list[Message]) -> str:
    enc = encoding()
    return enc.decode_utf8(enc.render_conversation_for_completion(
        Conversation.from_messages(messages), Role.ASSISTANT))


def test_system_tools_and_previous_turn_render_as_harmony(harmony_vocab_dir: Path) -> None:
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    got = render_harmony(encoding(), messages, TOOLS, "high")
    want = _reference([
        Message.from_role_and_content(
            Role.SYSTEM, SystemContent.new().with_reasoning_effort(ReasoningEffort.HIGH)),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new()
                                      .with_instructions("Answer briefly.")
                                      .with_function_tools([ToolDescription.new(
                                          "get_weather", "Weather now", parameters=PARAMS)])),
        Message.from_role_and_content(Role.USER, "Hi"),
        # the answered turn's reasoning is dropped: only its final answer stays
        Message.from_role_and_content(Role.ASSISTANT, "Hello!").with_channel("final"),
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
    ])
    assert got == want
    assert "Greet back." not in got and got.endswith("<|start|>assistant")


def test_tool_call_turn_and_result_render_as_harmony(harmony_vocab_dir: Path) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    got = render_harmony(encoding(), messages, TOOLS, None)
    want = _reference([
        Message.from_role_and_content(
            Role.SYSTEM, SystemContent.new().with_reasoning_effort(ReasoningEffort.MEDIUM)),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_function_tools(
            [ToolDescription.new("get_weather", "Weather now", parameters=PARAMS)])),
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        # reasoning before a call is kept: the turn is not answered yet
        Message.from_role_and_content(Role.ASSISTANT, "Use the tool.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}')
        .with_channel("commentary").with_recipient("functions.get_weather")
        .with_content_type("json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"),
                                        '{"temp": 21}')
        .with_channel("commentary").with_recipient("assistant"),
    ])
    assert got == want


def test_no_tools_leaves_commentary_out_and_no_developer_message(harmony_vocab_dir: Path) -> None:
    got = render_harmony(encoding(), [{"role": "user", "content": "Hi"}], None, "low")
    system = (SystemContent.new().with_reasoning_effort(ReasoningEffort.LOW)
              .with_channel_config(ChannelConfig.require_channels(["analysis", "final"])))
    assert got == _reference([Message.from_role_and_content(Role.SYSTEM, system),
                              Message.from_role_and_content(Role.USER, "Hi")])
    assert "<|start|>developer" not in got


def test_bad_reasoning_effort_is_a_template_error(harmony_vocab_dir: Path) -> None:
    with pytest.raises(ChatTemplateError, match="reasoning_effort"):
        render_harmony(encoding(), [{"role": "user", "content": "Hi"}], None, "extreme")


def test_vocab_derived_from_a_gpt_oss_tokenizer_is_byte_identical(
        harmony_vocab_dir: Path, tmp_path: Path) -> None:
    ranks = vocab_ranks(harmony_vocab_dir)
    tokenizer = tmp_path / "ckpt" / "tokenizer.json"
    tokenizer.parent.mkdir()
    tokenizer.write_text(json.dumps(gpt_oss_tokenizer_json(ranks)), encoding="utf-8")
    out = resolve_vocab_dir(None, tokenizer.parent, tmp_path / "cache")
    assert (out / VOCAB_FILE).read_bytes() == (harmony_vocab_dir / VOCAB_FILE).read_bytes()
    swapped = dict(ranks)  # two tokens' ranks exchanged: a different vocabulary
    a, b = (t for t, r in ranks.items() if r in (1000, 1001))
    swapped[a], swapped[b] = ranks[b], ranks[a]
    tokenizer.write_text(json.dumps(gpt_oss_tokenizer_json(swapped)), encoding="utf-8")
    with pytest.raises(ValueError, match="not OpenAI's o200k vocabulary"):
        derive_vocab(tokenizer, tmp_path / "other")


def test_explicit_vocab_must_be_the_real_file(harmony_vocab_dir: Path, tmp_path: Path) -> None:
    assert resolve_vocab_dir(harmony_vocab_dir / VOCAB_FILE, tmp_path, tmp_path) == harmony_vocab_dir
    (tmp_path / VOCAB_FILE).write_bytes(b"IQ== 0\n")
    with pytest.raises(ValueError, match="not OpenAI's o200k"):
        resolve_vocab_dir(tmp_path, tmp_path, tmp_path)
    with pytest.raises(ValueError, match="no o200k_base.tiktoken"):
        resolve_vocab_dir(tmp_path / "empty", tmp_path, tmp_path)
