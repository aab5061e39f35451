"""Declarative request fields: one table per JSON object, read by the validator and the
OpenAPI generator alike.

A `Field` names a JSON member, its kind, its default and its bounds. The worker's `Fields`
reader (services/worker/fields.py) validates a member by its `Field` (`Fields.read`), and
`Field.json_schema()` writes the same facts as a JSON Schema (2020-12, as OpenAPI 3.1 uses),
so the published document cannot drift from what the handlers accept. Members whose shape
needs code to check (chat messages, prompts, tools, structured outputs) are `Kind.JSON`: their
parser lives beside the handler and the field carries the schema fragment of what it accepts.

JSON `null` means "not given" for every optional member (as in the OpenAI API), so every
optional schema admits null.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

class Kind(enum.Enum):
    """How a member is read (each maps to one `Fields` getter)."""

    BOOLEAN = "boolean"
    INTEGER = "integer"
    NUMBER = "number"  # finite; an integer is accepted too
    STRING = "string"
    CHOICE = "choice"  # a string among `choices`
    STRINGS = "strings"  # a string or an array of strings (`stop`)
    INTEGERS = "integers"  # an array of integers in [lo, hi]
    OBJECT = "object"  # a nested object described by `members`
    JSON = "json"  # any value its own parser checks; `schema` describes it


@dataclass(frozen=True)
class Field:
    """One member of a JSON object: what the validator enforces and the document says."""

    name: str
    kind: Kind
    default: Any = None
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    doc: str = ""
    required: bool = False
    members: FieldTable | None = None  # Kind.OBJECT only
    schema: Mapping[str, Any] | None = None  # Kind.JSON only (a JSON Schema fragment)

    def json_schema(self) -> dict[str, Any]:
        """This member's JSON Schema (null admitted unless required)."""
        out = self._value_schema()
        if not self.required:
            out = {"anyOf": [out, {"type": "null"}]} if "type" not in out else {
                **out, "type": [*_as_list(out["type"]), "null"]}
        if self.default is not None and self.kind is not Kind.JSON:
            out["default"] = list(self.default) if isinstance(self.default, tuple) else self.default
        if self.doc:
            out["description"] = self.doc
        return out

    def _value_schema(self) -> dict[str, Any]:
        bounds = {k: v for k, v in (("minimum", self.lo), ("maximum", self.hi)) if v is not None}
        if self.kind in (Kind.BOOLEAN, Kind.STRING):
            return {"type": self.kind.value}
        if self.kind in (Kind.INTEGER, Kind.NUMBER):
            return {"type": self.kind.value, **bounds}
        if self.kind is Kind.CHOICE:
            return {"type": "string", "enum": list(self.choices)}
        if self.kind is Kind.STRINGS:
            return {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
        if self.kind is Kind.INTEGERS:
            return {"type": "array", "items": {"type": "integer", **bounds}}
        if self.kind is Kind.OBJECT:
            assert self.members is not None, f"{self.name}: an OBJECT field needs members"
            return self.members.object_schema()
        assert self.schema is not None, f"{self.name}: a JSON field needs a schema"
        return dict(self.schema)


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


@dataclass(frozen=True)
class FieldTable:
    """The members of one JSON object, by name, in declaration order."""

    fields: tuple[Field, ...]
    by_name: Mapping[str, Field] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        assert len(set(names)) == len(names), f"duplicate fields: {names}"
        object.__setattr__(self, "by_name", {f.name: f for f in self.fields})

    def __getitem__(self, name: str) -> Field:
        return self.by_name[name]

    def __iter__(self) -> Iterator[Field]:
        return iter(self.fields)

    def __add__(self, other: FieldTable) -> FieldTable:
        return FieldTable(self.fields + other.fields)

    def object_schema(self) -> dict[str, Any]:
        """An object schema; unknown members are allowed (the handlers ignore them)."""
        out: dict[str, Any] = {"type": "object",
                               "properties": {f.name: f.json_schema() for f in self.fields}}
        required = [f.name for f in self.fields if f.required]
        if required:
            out["required"] = required
        return out


def table(*fields: Field) -> FieldTable:
    return FieldTable(fields)
