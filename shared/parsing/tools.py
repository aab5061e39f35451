"""The tools a request offered, as the tool parsers consult them.

A parser is built per request with the request's `tools`; it uses them to resolve a call's
name and to read each parameter's declared JSON-schema type. A call to a name the request did
not offer is kept (with a logged warning), as vLLM does: dropping it would hide what the model
did, and the client, which owns the tools, is the one that can answer "unknown function".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.parsing.messages import ToolCallDelta, new_tool_call_id

logger = logging.getLogger(__name__)

# JSON-schema type name -> the Python types json.loads produces for it (bool is not a number).
_SCHEMA_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,), "null": (type(None),),
}


@dataclass(frozen=True)
class ToolSpec:
    """One offered function: its name and the JSON schema of its arguments object."""

    name: str
    parameters: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> ToolSpec:
        """From an OpenAI `tools` entry (`{"type": "function", "function": {...}}`) or from the
        bare function object (`{"name": ..., "parameters": ...}`)."""
        if not isinstance(tool, Mapping):
            raise ValueError(f"a tool must be an object, got {type(tool).__name__}")
        function = tool.get("function", tool)
        if not isinstance(function, Mapping):
            raise ValueError("a tool's `function` must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("a tool needs a non-empty string `name`")
        parameters = function.get("parameters") or {}
        if not isinstance(parameters, Mapping):
            raise ValueError(f"tool {name!r}: `parameters` must be a JSON-schema object")
        return cls(name, parameters)


def as_arguments(value: Any) -> dict[str, Any] | None:
    """A call's arguments as a dict: an object as is, a JSON string holding an object decoded
    (some models double-encode), missing as {}; anything else is not a valid arguments value."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None


ToolsArg = Iterable[ToolSpec | Mapping[str, Any]]  # a request's `tools`, as given or parsed


class ToolSet:
    """The request's offered tools, by name: resolves call names, reads parameter types, and
    builds the whole `ToolCallDelta` a parser emits (fresh id, JSON arguments)."""

    def __init__(self, tools: ToolsArg = ()) -> None:
        specs = [t if isinstance(t, ToolSpec) else ToolSpec.from_openai(t) for t in tools]
        self._by_name: dict[str, ToolSpec] = {spec.name: spec for spec in specs}

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._by_name)

    def resolve(self, name: str) -> str:
        """The offered name a call means. Only a doubled `x.x` collapses to an offered `x`
        (a model repeating a namespace); never a suffix match: `weather.get` must not
        dispatch an offered `calendar.get`. Anything else is returned unchanged."""
        if name in self._by_name:
            return name
        k = len(name) // 2
        if len(name) % 2 == 1 and name[k] == "." and name[:k] == name[k + 1:]:
            if name[:k] in self._by_name:
                return name[:k]
        return name

    def declared_types(self, tool: str, parameter: str) -> frozenset[str]:
        """The JSON-schema type names declared for `parameter` of `tool` (empty if unknown)."""
        spec = self._by_name.get(tool)
        properties = spec.parameters.get("properties") if spec else None
        schema = properties.get(parameter) if isinstance(properties, Mapping) else None
        declared = schema.get("type") if isinstance(schema, Mapping) else None
        if isinstance(declared, str):
            return frozenset((declared,))
        if isinstance(declared, list):
            return frozenset(t for t in declared if isinstance(t, str))
        return frozenset()

    def make_call(self, index: int, name: str, arguments: Mapping[str, Any]) -> ToolCallDelta:
        """A whole streamed call: resolved name, fresh id, arguments serialised as JSON."""
        resolved = self.resolve(name)
        self._check(resolved, arguments)
        return ToolCallDelta(index=index, id=new_tool_call_id(), name=resolved,
                             arguments=json.dumps(dict(arguments), ensure_ascii=False))

    def _check(self, name: str, arguments: Mapping[str, Any]) -> None:
        """Warn about what the client will likely reject; never rewrite the call."""
        if name not in self._by_name:
            logger.warning("tool call to %r, which the request did not offer (offered: %s); "
                           "kept as is", name, ", ".join(sorted(self._by_name)) or "none")
            return
        for key, value in arguments.items():
            declared = self.declared_types(name, key)
            allowed = tuple(t for d in declared for t in _SCHEMA_TYPES.get(d, ()))
            if not allowed:
                continue
            wrong_bool = isinstance(value, bool) and bool not in allowed
            if wrong_bool or not isinstance(value, allowed):
                logger.warning("tool %r: argument %r is %s, declared %s", name, key,
                               type(value).__name__, "/".join(sorted(declared)))
