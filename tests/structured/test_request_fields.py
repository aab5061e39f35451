"""Request parsing of structured output (no model): every accepted spelling gives the spec,
every bad one a 400 naming its field; tool_choice "required" / named functions become JSON
schemas checked with `jsonschema` against calls that must pass and calls that must not."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from services.common.errors import BadRequestError
from services.worker.chat_messages import ChatTools, parse_tools
from services.worker.fields import Fields
from services.worker.openai_protocol import parse_chat_request, parse_completion_request
from services.worker.tool_constraints import (
    ConstrainedToolCall,
    required_schema,
    tool_calls_from_constrained_output,
    tool_choice_spec,
)
from shared.engine.structured_spec import (
    InvalidStructuredOutput,
    StructuredKind,
    StructuredOutputSpec,
)

MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
          "required": ["b", "a"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
    "additionalProperties": False, "$defs": {"zone": {"type": "string", "pattern": "^[A-Z]+$"}}}}}


def chat_spec(**extra: Any) -> StructuredOutputSpec | None:
    return parse_chat_request({"messages": MSG, **extra}).common.sampling.structured


def completion_spec(**extra: Any) -> StructuredOutputSpec | None:
    return parse_completion_request({"prompt": "x", **extra}).common.sampling.structured


@pytest.mark.parametrize(("extra", "kind", "value"), [
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, StructuredKind.JSON_OBJECT, ""),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": SCHEMA, "strict": True}}}, StructuredKind.JSON, SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredKind.JSON, SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
     StructuredKind.JSON, SCHEMA),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredKind.REGEX, "[a-z]+"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredKind.CHOICE, ["yes", "no"]),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, StructuredKind.GRAMMAR, 'start: "a"'),
    ({"structured_outputs": {"json_object": True}}, StructuredKind.JSON_OBJECT, ""),
    ({"guided_json": SCHEMA}, StructuredKind.JSON, SCHEMA),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredKind.JSON, SCHEMA),
    ({"guided_regex": "\\d+", "guided_decoding_backend": "xgrammar"}, StructuredKind.REGEX, "\\d+"),
    ({"guided_choice": ["a", "b"]}, StructuredKind.CHOICE, ["a", "b"]),
    ({"guided_grammar": 'root ::= "x"'}, StructuredKind.GRAMMAR, 'root ::= "x"'),
])
def test_accepted_spellings(extra: dict[str, Any], kind: StructuredKind | None, value: Any) -> None:
    for spec in (chat_spec(**extra), completion_spec(**extra)):
        if kind is None:
            assert spec is None
            continue
        assert spec is not None and spec.kind is kind
        decoded = json.loads(spec.value) if kind in (StructuredKind.JSON,
                                                     StructuredKind.CHOICE) else spec.value
        assert decoded == value
        if kind is StructuredKind.JSON:  # key order is kept: it orders the generated keys
            assert list(json.loads(spec.value)["properties"]) == ["b", "a"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": SCHEMA, "strict": "yes"}}}, "response_format.json_schema.strict"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_choice": ["", "x"]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_json": 3}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
])
def test_bad_fields_are_400_naming_the_field(extra: dict[str, Any], param: str) -> None:
    for parse in (chat_spec, completion_spec):
        with pytest.raises(BadRequestError) as err:
            parse(**extra)
        assert err.value.param == param, err.value.message


def test_tool_choice_conflicts_with_another_constraint() -> None:
    with pytest.raises(BadRequestError) as err:
        chat_spec(tools=[WEATHER], tool_choice="required", guided_regex="a")
    assert err.value.param == "tool_choice"
    with pytest.raises(BadRequestError) as err:
        chat_spec(tools=[WEATHER], tool_choice="required",
                  response_format={"type": "json_object"})
    assert "tool_choice" in err.value.message and "response_format" in err.value.message


def tools(choice: Any, *defs: dict[str, Any]) -> ChatTools:
    return parse_tools(Fields({"tools": list(defs), "tool_choice": choice}))


def test_auto_and_none_constrain_nothing_and_none_hides_the_tools() -> None:
    assert tool_choice_spec(tools("auto", WEATHER)) is None
    assert tool_choice_spec(tools("none", WEATHER)) is None
    assert tools("none", WEATHER).for_template is None
    assert chat_spec(tools=[WEATHER], tool_choice="none") is None


def test_named_function_is_its_parameters_schema() -> None:
    spec = tool_choice_spec(tools({"type": "function", "function": {"name": "get_time"}},
                                  WEATHER, TIME))
    assert spec is not None and spec.kind is StructuredKind.JSON and spec.param == "tool_choice"
    assert json.loads(spec.value) == TIME["function"]["parameters"]
    bare = {"type": "function", "function": {"name": "ping"}}
    spec = tool_choice_spec(tools({"type": "function", "function": {"name": "ping"}}, bare))
    assert spec is not None and json.loads(spec.value)["type"] == "object"


def test_required_schema_accepts_exactly_calls_matching_their_tool() -> None:
    spec = tool_choice_spec(tools("required", WEATHER, TIME))
    assert spec is not None
    schema = json.loads(spec.value)
    assert schema["$defs"] == TIME["function"]["parameters"]["$defs"]  # hoisted to the root
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}],
          [{"name": "get_time", "parameters": {"zone": "UTC"}},
           {"name": "get_weather", "parameters": {"city": "Rome", "unit": "f"}}]]
    bad = [[], {"name": "get_time", "parameters": {"zone": "UTC"}},
           [{"name": "get_time", "parameters": {"city": "Paris", "unit": "c"}}],
           [{"name": "get_time", "parameters": {"zone": "utc"}}],
           [{"name": "nope", "parameters": {}}],
           [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}, "x": 1}]]
    for value in ok:
        jsonschema.validate(value, schema)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)


def test_required_with_parallel_tool_calls_false_allows_exactly_one_call() -> None:
    one = parse_tools(Fields({"tools": [WEATHER, TIME], "tool_choice": "required",
                              "parallel_tool_calls": False}))
    spec = tool_choice_spec(one)
    assert spec is not None
    schema = json.loads(spec.value)
    call = {"name": "get_time", "parameters": {"zone": "UTC"}}
    jsonschema.validate([call], schema)
    for value in ([], [call, call]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    default = tool_choice_spec(tools("required", WEATHER, TIME))
    assert default is not None
    jsonschema.validate([call, call], json.loads(default.value))  # true: the count stays open
    with pytest.raises(BadRequestError) as err:
        parse_tools(Fields({"tools": [WEATHER], "parallel_tool_calls": "no"}))
    assert err.value.param == "parallel_tool_calls"


def test_clashing_defs_are_a_400() -> None:
    other = json.loads(json.dumps(TIME))
    other["function"]["name"] = "get_date"
    other["function"]["parameters"]["$defs"]["zone"] = {"type": "integer"}
    with pytest.raises(ValueError, match="zone"):
        required_schema(tools("required", TIME, other).tools or ())
    with pytest.raises(BadRequestError) as err:
        chat_spec(tools=[TIME, other], tool_choice="required")
    assert err.value.param == "tools"


def test_tool_calls_from_constrained_output() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    args = '{"city": "Paris", "unit": "c"}'
    assert tool_calls_from_constrained_output(named, args) == [("get_weather", args)]
    calls = [{"name": "get_time", "parameters": {"zone": "UTC"}},
             {"name": "get_weather", "parameters": {"city": "Zürich", "unit": "c"}}]
    got = tool_calls_from_constrained_output("required", json.dumps(calls))
    assert [c.name for c in got] == ["get_time", "get_weather"]
    assert all(isinstance(c, ConstrainedToolCall) for c in got)
    assert [json.loads(c.arguments) for c in got] == [c["parameters"] for c in calls]
    for choice, text in ((named, args[:-3]), ("required", "[]"), ("required", '{"a": 1}'),
                         ("required", '[{"name": 1, "parameters": {}}]'), ("auto", "[]")):
        with pytest.raises(ValueError):
            tool_calls_from_constrained_output(choice, text)


def test_spec_is_validated_and_hashable() -> None:
    a = StructuredOutputSpec.json_schema(SCHEMA, "guided_json")
    b = StructuredOutputSpec.json_schema(json.dumps(SCHEMA), "response_format")
    assert a == b and hash(a) == hash(b) and a.key == b.key  # param is not identity
    with pytest.raises(InvalidStructuredOutput):
        StructuredOutputSpec(StructuredKind.CHOICE, '["a", 3]')
    with pytest.raises(InvalidStructuredOutput):
        StructuredOutputSpec(StructuredKind.JSON_OBJECT, "{}")
    with pytest.raises(InvalidStructuredOutput):
        StructuredOutputSpec(StructuredKind.REGEX, "a", reasoning_end_ids=(5,))
