"""Validation of chat `messages`, `tools` and `tool_choice` into what the chat template takes.

Rules follow the OpenAI API and vLLM's validators: roles system/developer/user/assistant/tool,
content a string or an array of text parts (other part types are refused: the models here are
text-only); `tools: []` is a 400, `tool_choice` without `tools` is a 400, an unknown
`tool_choice` string is a 400, and `tool_choice` defaults to "auto" when tools are given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.openai_fields import CHAT, ROLES, TOOL_CHOICES
from services.worker.fields import Fields, invalid, type_name


@dataclass(frozen=True)
class ChatTools:
    """Validated tool definitions; `for_template` is what the chat template should see."""

    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel: bool = True  # parallel_tool_calls: false allows at most one call

    @property
    def for_template(self) -> list[dict[str, Any]] | None:
        if self.tools is None or self.tool_choice == "none":
            return None
        return list(self.tools)


def _content_text(content: Any, where: str, allow_null: bool) -> str | None:
    """A string, or the text parts of an array joined by newlines (as vLLM does)."""
    if content is None:
        if allow_null:
            return None
        raise invalid("messages", f"{where}.content is required")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("messages", f"{where}.content must be a string or an array of parts, "
                      f"got {type_name(content)}")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid("messages", f"{where}.content: only text parts "
                          "({'type': 'text', 'text': ...}) are supported")
        texts.append(part["text"])
    return "\n".join(texts)


def _parse_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
        raise invalid("messages", f"{where}.tool_calls must be an array of objects")
    for call in value:
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid("messages", f"{where}.tool_calls: each call needs function.name")
    return value


def parse_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid("messages", f"{where} must be an object, got {type_name(message)}")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid("messages", f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    has_tool_calls = role == "assistant" and message.get("tool_calls") is not None
    text = _content_text(message.get("content"), where, allow_null=role == "assistant")
    out["content"] = text if text is not None else ""
    if has_tool_calls:
        out["tool_calls"] = _parse_tool_calls(message["tool_calls"], where)
    keys: tuple[str, ...] = ("name", "tool_call_id")
    if role == "assistant":  # an earlier turn's reasoning (harmony renders it; templates may)
        keys += ("reasoning_content", "reasoning")
    for key in keys:
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise invalid("messages", f"{where}.{key} must be a string")
            out[key] = value
    return out


def parse_messages(value: Any) -> tuple[dict[str, Any], ...]:
    if value is None:
        raise invalid("messages", "missing required field")
    if not isinstance(value, list) or not value:
        raise invalid("messages", "expected a non-empty array of messages")
    return tuple(parse_message(i, m) for i, m in enumerate(value))


def _parse_tool(index: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise invalid("tools", f"tools[{index}] must be {{'type': 'function', 'function': {{...}}}}")
    function = Fields(tool).obj("function")
    if function is None:
        raise invalid("tools", f"tools[{index}].function is required")
    name = function.string("name", None)
    if not name:
        raise invalid("tools", f"tools[{index}].function.name is required")
    function.string("description", None)
    function.obj("parameters")
    return {"type": "function", "function": function.data}


def _parse_tool_choice(value: Any, names: set[str]) -> str | dict[str, Any]:
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise invalid("tool_choice", f"expected one of {', '.join(TOOL_CHOICES)} or a named function")
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise invalid("tool_choice", "a named tool_choice needs function.name")
        if name not in names:
            raise invalid("tool_choice", f"tool {name!r} is not among the given tools")
        return value
    raise invalid("tool_choice", "expected a string or {'type': 'function', 'function': {'name': ...}}")


def parse_tools(f: Fields) -> ChatTools:
    parallel = f.read(CHAT["parallel_tool_calls"])  # meaningless without tools, not refused
    tools_value, choice_value = f.data.get("tools"), f.data.get("tool_choice")
    if tools_value is None:
        if choice_value is not None:
            raise invalid("tool_choice", "'tool_choice' is only allowed when 'tools' are given")
        return ChatTools()
    if not isinstance(tools_value, list) or not tools_value:
        raise invalid("tools", "expected a non-empty array of tools")
    tools = tuple(_parse_tool(i, t) for i, t in enumerate(tools_value))
    names = {t["function"]["name"] for t in tools}
    choice = "auto" if choice_value is None else _parse_tool_choice(choice_value, names)
    return ChatTools(tools=tools, tool_choice=choice, parallel=parallel)
