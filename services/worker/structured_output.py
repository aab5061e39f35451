"""The structured-output fields of a request, parsed into one StructuredOutputSpec (or None).

Accepted as OpenAI and vLLM accept them, on /v1/chat/completions and /v1/completions:
  response_format     {"type": "text"} (no constraint), {"type": "json_object"}, or
                      {"type": "json_schema", "json_schema": {"name", "schema", "strict",
                      "description"}}; the schema is enforced in full whatever `strict` says
  structured_outputs  vLLM's extra body: exactly one of "json" (a schema, or its JSON text),
                      "regex", "choice" (array of strings), "grammar" (Lark or GBNF),
                      "json_object" (true); its tuning options (disable_any_whitespace,
                      disable_fallback, disable_additional_properties, whitespace_pattern) are
                      accepted and ignored; "structural_tag" is refused
  guided_json, guided_regex, guided_choice, guided_grammar
                      vLLM's older extra-body fields (guided_decoding_backend and
                      guided_whitespace_pattern are accepted and ignored)
and, on chat only, tool_choice "required" or a named function (tool_constraints.py).
One request takes one constraint: a second is a 400 naming it. A grammar that does not
compile is found later, off the event loop (AsyncEngine.compile_grammar), also as a 400.
"""

from __future__ import annotations

from services.common.errors import BadRequestError
from services.common.openai_fields import RESPONSE_FORMATS, STRUCTURED
from services.worker.fields import Fields, invalid
from shared.engine.structured_spec import (
    InvalidStructuredOutput,
    StructuredKind,
    StructuredOutputSpec,
)

STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
IGNORED_STRUCTURED_OPTIONS = ("disable_fallback", "disable_any_whitespace",
                              "disable_additional_properties")
GUIDED_KINDS = {"guided_json": StructuredKind.JSON, "guided_regex": StructuredKind.REGEX,
                "guided_choice": StructuredKind.CHOICE, "guided_grammar": StructuredKind.GRAMMAR}


def bad_request(exc: InvalidStructuredOutput) -> BadRequestError:
    return BadRequestError(str(exc), param=exc.param)


def spec_for(kind: StructuredKind, value: object, param: str) -> StructuredOutputSpec:
    """A spec from one raw JSON value; a 400 naming `param` if it does not fit `kind`."""
    try:
        if kind is StructuredKind.JSON:
            return StructuredOutputSpec.json_schema(value, param)
        if kind is StructuredKind.CHOICE:
            return StructuredOutputSpec.choice(value, param)
        if kind is StructuredKind.JSON_OBJECT:
            return StructuredOutputSpec(kind, param=param)
        return StructuredOutputSpec.text(kind, value, param)
    except InvalidStructuredOutput as exc:
        raise bad_request(exc) from None


def parse_response_format(f: Fields) -> StructuredOutputSpec | None:
    rf = f.obj("response_format")
    if rf is None:
        return None
    kind = rf.choice("type", None, RESPONSE_FORMATS)
    if kind is None:
        raise invalid("response_format.type", "missing required field")
    if kind == "text":
        return None
    if kind == "json_object":
        return spec_for(StructuredKind.JSON_OBJECT, None, "response_format")
    js = rf.obj("json_schema")
    if js is None:
        raise invalid("response_format.json_schema", "required when type is 'json_schema'")
    if not js.string("name", ""):
        raise invalid("response_format.json_schema.name", "missing required field")
    js.string("description", None)
    js.boolean("strict", False)  # accepted; the schema is enforced in full either way
    schema = js.data.get("schema")
    if schema is None:
        raise invalid("response_format.json_schema.schema", "missing required field")
    return spec_for(StructuredKind.JSON, schema, "response_format.json_schema.schema")


def parse_structured_outputs(f: Fields) -> StructuredOutputSpec | None:
    so = f.obj("structured_outputs")
    if so is None:
        return None
    for option in IGNORED_STRUCTURED_OPTIONS:
        so.boolean(option, False)
    so.string("whitespace_pattern", None)
    given = [key for key in STRUCTURED_KEYS if so.has(key)
             and not (key == "json_object" and so.data.get(key) is False)]
    if len(given) != 1:
        found = ", ".join(given) or "none"
        raise invalid("structured_outputs", "exactly one of json, regex, choice, grammar or "
                      f"json_object is needed (got {found})")
    key = given[0]
    if key == "structural_tag":
        raise invalid("structured_outputs.structural_tag", "structural tags are not supported")
    if key == "json_object":
        so.boolean("json_object", False)
    return spec_for(StructuredKind(key), so.data[key], f"structured_outputs.{key}")


def parse_guided(f: Fields) -> list[StructuredOutputSpec]:
    f.read(STRUCTURED["guided_decoding_backend"])  # accepted, ignored
    f.read(STRUCTURED["guided_whitespace_pattern"])
    return [spec_for(kind, f.data[name], name) for name, kind in GUIDED_KINDS.items()
            if f.has(name)]


def one_constraint(*specs: StructuredOutputSpec | None) -> StructuredOutputSpec | None:
    """The request's constraint; 400 (naming the second one) when there are several."""
    given = [s for s in specs if s is not None]
    if len(given) > 1:
        first, second = given[0].param, given[1].param
        raise BadRequestError(
            f"Only one structured-output constraint per request: got '{first}' and "
            f"'{second}'", param=second.split(".")[0])
    return given[0] if given else None


def parse_structured(f: Fields) -> StructuredOutputSpec | None:
    """The constraint of a request body (tool_choice aside: chat adds it)."""
    return one_constraint(parse_response_format(f), parse_structured_outputs(f), *parse_guided(f))
