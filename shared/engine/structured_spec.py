"""What a request's structured output must match: one typed, frozen spec on SamplingParams.

The API layer builds it (response_format, structured_outputs, guided_*, tool_choice); the
engine compiles it into a grammar (shared.engine.grammar) and masks the sampler with it
(shared.engine.structured). `value` is text in every kind, so a spec is hashable and is its
own grammar-cache key:

    JSON         a JSON schema, serialised (key order kept: it orders the generated keys)
    JSON_OBJECT  any JSON object; value ""
    REGEX        a regular expression (Rust `regex` syntax) the whole output matches
    CHOICE       a JSON array of strings; the output is exactly one of them
    GRAMMAR      a Lark grammar, or GBNF / EBNF (converted to Lark by llguidance)

Reasoning models: with `reasoning_first` the grammar starts inactive (the reasoning is free
text) and applies once activated: automatically when the output ends with
`reasoning_end_ids` (e.g. the ids of "</think>"), or by `LLMEngine.activate_structured`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class InvalidStructuredOutput(ValueError):
    """A structured-output constraint that cannot be used; `param` names the API field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class StructuredKind(StrEnum):
    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One constraint on a request's output (see the module docstring for `value`).

    `param` is the API field the spec came from ("response_format", "guided_json"...), for
    error messages only: it is not part of the identity (equality, hash, cache key).
    """

    kind: StructuredKind
    value: str = ""
    reasoning_first: bool = False
    reasoning_end_ids: tuple[int, ...] = ()
    param: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StructuredKind(self.kind))
        object.__setattr__(self, "reasoning_end_ids", tuple(int(t) for t in self.reasoning_end_ids))
        param = self.param or self.kind.value
        if not isinstance(self.value, str):
            raise InvalidStructuredOutput(f"{param}: the constraint must be text", param)
        if self.reasoning_end_ids and not self.reasoning_first:
            raise InvalidStructuredOutput("reasoning_end_ids need reasoning_first", param)
        if self.kind is StructuredKind.JSON_OBJECT:
            if self.value:
                raise InvalidStructuredOutput("json_object takes no value", param)
        elif not self.value.strip():
            raise InvalidStructuredOutput(f"{param}: the {self.kind.value} constraint is empty",
                                          param)
        if self.kind is StructuredKind.CHOICE:
            _check_choices(_loads(self.value, param), param)
        if self.kind is StructuredKind.JSON:
            schema = _loads(self.value, param)
            if not isinstance(schema, dict | bool):
                raise InvalidStructuredOutput(f"{param}: a JSON schema must be an object", param)

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar depends on (the grammar-cache key)."""
        return (self.kind.value, self.value)

    @classmethod
    def json_schema(cls, schema: Any, param: str) -> StructuredOutputSpec:
        """From a schema object, or a JSON text of one (vLLM's guided_json takes both)."""
        if isinstance(schema, str):
            schema = _loads(schema, param)
        if not isinstance(schema, dict | bool):
            raise InvalidStructuredOutput(f"{param}: a JSON schema must be an object", param)
        return cls(StructuredKind.JSON, json.dumps(schema, separators=(",", ":"),
                                                   ensure_ascii=False), param=param)

    @classmethod
    def choice(cls, choices: Any, param: str) -> StructuredOutputSpec:
        _check_choices(choices, param)
        return cls(StructuredKind.CHOICE, json.dumps(choices, ensure_ascii=False), param=param)

    @classmethod
    def text(cls, kind: StructuredKind, value: Any, param: str) -> StructuredOutputSpec:
        """A regex or a grammar given as a string."""
        if not isinstance(value, str):
            raise InvalidStructuredOutput(f"{param}: expected a string", param)
        return cls(kind, value, param=param)


def _loads(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidStructuredOutput(f"{param}: not valid JSON: {exc}", param) from None


def _check_choices(choices: Any, param: str) -> None:
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise InvalidStructuredOutput(f"{param}: expected a non-empty array of non-empty strings",
                                      param)
