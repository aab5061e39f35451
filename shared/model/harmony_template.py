"""gpt-oss chat prompts in OpenAI's harmony format, rendered by openai-harmony itself.

The Chat Completions request becomes a harmony conversation as vLLM builds it for gpt-oss:

- a system message with the model identity, knowledge cutoff and the request's
  `reasoning_effort` (medium when absent); without tools, `commentary` is left out of the
  valid channels (it only carries calls to the request's functions);
- a developer message with the request's system/developer messages as `# Instructions` and
  its tools as the `functions` namespace (left out when there is neither);
- user turns as they are; an assistant turn as its reasoning (`analysis`), a preamble
  (`commentary`, when it also calls tools), one `commentary to=functions.NAME` message per
  call, or its answer (`final`); a tool result as a message from `functions.NAME` (the name
  found through `tool_call_id`, else the message's `name`).
- reasoning of turns already answered (before the last `final`) is dropped, as the model
  was trained; the library drops it too when the last assistant message is final.

The prompt is the rendered ids decoded to text (special tokens as text): the worker then
tokenizes it with the checkpoint's own tokenizer, which for gpt-oss is the same
o200k_harmony vocabulary, so the ids are the library's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from openai_harmony import (
    Author,
    ChannelConfig,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyError,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from shared.model.chat_template import ChatTemplateError

REASONING_EFFORTS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM,
                     "high": ReasoningEffort.HIGH}
INSTRUCTION_ROLES = ("system", "developer")
FUNCTIONS = "functions."


def system_message(reasoning_effort: str | None, with_tools: bool) -> Message:
    effort = REASONING_EFFORTS.get(reasoning_effort or "medium")
    if effort is None:
        raise ChatTemplateError(f"reasoning_effort must be one of "
                                f"{', '.join(REASONING_EFFORTS)}, got {reasoning_effort!r}")
    content = SystemContent.new().with_reasoning_effort(effort)
    if not with_tools:
        channels = ChannelConfig.require_channels(["analysis", "final"])
        content = content.with_channel_config(channels)
    return Message.from_role_and_content(Role.SYSTEM, content)


def developer_message(instructions: str, tools: Sequence[dict[str, Any]]) -> Message | None:
    if not instructions and not tools:
        return None
    content = DeveloperContent.new()
    if instructions:
        content = content.with_instructions(instructions)
    if tools:
        content = content.with_function_tools([
            ToolDescription.new(t["function"]["name"], t["function"].get("description") or "",
                                parameters=t["function"].get("parameters"))
            for t in tools])
    return Message.from_role_and_content(Role.DEVELOPER, content)


def _assistant(message: dict[str, Any]) -> list[Message]:
    out: list[Message] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning)
                   .with_channel("analysis"))
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if content:
        channel = "commentary" if calls else "final"
        out.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel(channel))
    for call in calls:
        function = call["function"]
        arguments = function.get("arguments") or "{}"
        if not isinstance(arguments, str):
            raise ChatTemplateError("tool_calls[].function.arguments must be a JSON string")
        out.append(Message.from_role_and_content(Role.ASSISTANT, arguments)
                   .with_channel("commentary")
                   .with_recipient(FUNCTIONS + function["name"])
                   .with_content_type("json"))
    return out


def _tool_result(message: dict[str, Any], names: dict[str, str]) -> Message:
    name = names.get(message.get("tool_call_id") or "") or message.get("name") or ""
    author = Author.new(Role.TOOL, FUNCTIONS + name)
    return (Message.from_author_and_content(author, message.get("content") or "")
            .with_channel("commentary").with_recipient("assistant"))


def _drop_answered_reasoning(messages: list[Message]) -> list[Message]:
    finals = [i for i, m in enumerate(messages)
              if m.author.role == Role.ASSISTANT and m.channel == "final"]
    if not finals:
        return messages
    return [m for i, m in enumerate(messages) if i >= finals[-1] or m.channel != "analysis"]


def harmony_conversation(messages: Sequence[dict[str, Any]],
                         tools: Sequence[dict[str, Any]] | None,
                         reasoning_effort: str | None) -> Conversation:
    """The request's messages (validated: services.worker.chat_messages) as harmony."""
    tools = tools or ()
    instructions = "\n\n".join(m.get("content") or "" for m in messages
                               if m["role"] in INSTRUCTION_ROLES)
    head = [system_message(reasoning_effort, bool(tools))]
    developer = developer_message(instructions, tools)
    if developer is not None:
        head.append(developer)
    names = {call.get("id"): call["function"]["name"]
             for m in messages for call in m.get("tool_calls") or () if call.get("id")}
    turns: list[Message] = []
    for message in messages:
        role = message["role"]
        if role == "user":
            turns.append(Message.from_role_and_content(Role.USER, message.get("content") or ""))
        elif role == "assistant":
            turns.extend(_assistant(message))
        elif role == "tool":
            turns.append(_tool_result(message, names))
    return Conversation.from_messages(head + _drop_answered_reasoning(turns))


def render_harmony(encoding: HarmonyEncoding, messages: Sequence[dict[str, Any]],
                   tools: Sequence[dict[str, Any]] | None, reasoning_effort: str | None,
                   add_generation_prompt: bool = True) -> str:
    """The prompt text; with `add_generation_prompt` it ends in `<|start|>assistant`.
    ChatTemplateError (a ValueError, so a 400) for what the library refuses."""
    conversation = harmony_conversation(messages, tools, reasoning_effort)
    try:
        if add_generation_prompt:
            ids = encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
        else:
            ids = encoding.render_conversation(conversation)
        return encoding.decode_utf8(ids)
    except (HarmonyError, ValueError) as exc:
        raise ChatTemplateError(f"harmony rendering failed: {exc}") from None
