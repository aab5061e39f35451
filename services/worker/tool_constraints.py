"""tool_choice "required" or a named function, enforced by a JSON-schema grammar (as vLLM).

    named     {"type": "function", "function": {"name": X}}: the output is one JSON object
              valid against X's `parameters` (the call's arguments).
    required  a JSON array, at least one item, of {"name": N, "parameters": <N's schema>};
              one anyOf branch per tool, so the parameters always match the chosen name;
              exactly one item with parallel_tool_calls false.
"auto" and "none" constrain nothing ("none" also keeps the tools out of the prompt:
ChatTools.for_template). Tool schemas may refer to their own "$defs" ("#/$defs/x"); nested in
the array schema such references would point at its root, so the $defs are hoisted there (a
name two tools define differently is a 400).

`tool_calls_from_constrained_output` turns such an output back into calls (name, arguments as
JSON text) for the response's `message.tool_calls`.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from services.common.errors import BadRequestError
from services.worker.chat_messages import ChatTools
from shared.engine.structured_spec import InvalidStructuredOutput, StructuredOutputSpec

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ConstrainedToolCall(NamedTuple):
    name: str
    arguments: str  # a JSON object, as text


def enforces_tool_call(tool_choice: str | dict[str, Any] | None) -> bool:
    """Whether this tool_choice constrains the output (and must be read back as calls)."""
    return tool_choice == "required" or isinstance(tool_choice, dict)


def _named(tool_choice: dict[str, Any]) -> str:
    name = tool_choice["function"]["name"]
    assert isinstance(name, str)  # chat_messages validated it
    return name


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return dict(params) if params else dict(EMPTY_PARAMETERS)


def required_schema(tools: tuple[dict[str, Any], ...], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of tool_choice "required" over `tools` (a ValueError on $defs clash);
    not `parallel` (parallel_tool_calls false): exactly one call."""
    defs: dict[str, Any] = {}
    branches = []
    for tool in tools:
        params = _parameters(tool)
        for key, value in (params.pop("$defs", None) or {}).items():
            if defs.setdefault(key, value) != value:
                raise ValueError(f"tools define '$defs/{key}' in two different ways")
        branches.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [tool["function"]["name"]]},
            "parameters": params}, "required": ["name", "parameters"],
            "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def tool_choice_spec(tools: ChatTools) -> StructuredOutputSpec | None:
    """The constraint a chat request's tool_choice puts on its output (None: none)."""
    choice = tools.tool_choice
    if tools.tools is None or not enforces_tool_call(choice):
        return None
    try:
        if isinstance(choice, dict):
            name = _named(choice)
            tool = next(t for t in tools.tools if t["function"]["name"] == name)
            return StructuredOutputSpec.json_schema(_parameters(tool), "tool_choice")
        return StructuredOutputSpec.json_schema(required_schema(tools.tools, tools.parallel),
                                                "tool_choice")
    except (ValueError, InvalidStructuredOutput) as exc:
        raise BadRequestError(f"Invalid value for 'tools': {exc}", param="tools") from None


def tool_calls_from_constrained_output(tool_choice: str | dict[str, Any],
                                       text: str) -> list[ConstrainedToolCall]:
    """The calls an output generated under `tool_choice` ("required" or a named function)
    stands for. Raises ValueError if the text is not such an output (e.g. cut short by
    max_tokens): the caller then returns it as plain content."""
    if not enforces_tool_call(tool_choice):
        raise ValueError(f"tool_choice {tool_choice!r} does not constrain the output")
    value = json.loads(text)
    if isinstance(tool_choice, dict):
        if not isinstance(value, dict):
            raise ValueError("expected a JSON object of arguments")
        return [ConstrainedToolCall(_named(tool_choice), text.strip())]
    if not isinstance(value, list) or not value:
        raise ValueError("expected a non-empty JSON array of calls")
    calls = []
    for item in value:
        if (not isinstance(item, dict) or not isinstance(item.get("name"), str)
                or not isinstance(item.get("parameters"), dict)):
            raise ValueError("each call must be {'name': <string>, 'parameters': <object>}")
        calls.append(ConstrainedToolCall(item["name"], json.dumps(item["parameters"],
                                                                  ensure_ascii=False)))
    return calls
