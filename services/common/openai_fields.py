"""The request members of the OpenAI-compatible endpoints, as field tables (schema.py).

The worker's parsers (services/worker/openai_protocol.py, routes.py) read every scalar member
through these tables, and both OpenAPI documents (worker and router, which forwards the same
bodies) are generated from them. Members whose shape needs code (messages, prompt, tools,
structured outputs) carry the schema of what their parser accepts; their parsers live in the
worker next to the handlers and use the constants below.
"""

from __future__ import annotations

from typing import Any

from services.common.schema import INT64_MAX, INT64_MIN, Field, FieldTable, Kind, table
from shared.engine.sampling_params import LOGIT_BIAS_LIMIT
from shared.protocol.pd import RESUME_FIELD

MAX_CHOICES = 128  # n x number of prompts, per request
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto", "required")
REASONING_EFFORTS = ("low", "medium", "high")  # gpt-oss (harmony), as vLLM takes them
RESPONSE_FORMATS = ("text", "json_object", "json_schema")

_STR: dict[str, Any] = {"type": "string"}
_TOKENS: dict[str, Any] = {"type": "array", "minItems": 1,
                           "items": {"type": "integer", "minimum": 0, "maximum": INT64_MAX}}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": _STR}}
_FUNCTION_REF = {"type": "object", "required": ["type", "function"],
                 "properties": {"type": {"const": "function"},
                                "function": {"type": "object", "required": ["name"],
                                             "properties": {"name": _STR}}}}
_MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": list(ROLES)},
        "content": {"anyOf": [_STR, {"type": "array", "items": _TEXT_PART}, {"type": "null"}],
                    "description": "Required except on assistant messages."},
        "name": _STR, "tool_call_id": _STR,
        "tool_calls": {"type": "array", "items": _FUNCTION_REF},
    }}
MESSAGES_SCHEMA: dict[str, Any] = {"type": "array", "minItems": 1, "items": _MESSAGE}
_TOOL = {"type": "object", "required": ["function"],
         "properties": {"type": {"const": "function"},
                        "function": {"type": "object", "required": ["name"], "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "description": _STR, "parameters": {"type": "object"}}}}}

STREAM_OPTIONS = table(
    Field("include_usage", Kind.BOOLEAN, False, doc="A last chunk with the usage."),
    Field("continuous_usage_stats", Kind.BOOLEAN, False, doc="Accepted; not implemented."),
)

SAMPLING = table(
    Field("n", Kind.INTEGER, 1, lo=1, hi=MAX_CHOICES, doc="Choices per prompt."),
    Field("temperature", Kind.NUMBER, 1.0, lo=0.0, doc="0 is greedy."),
    Field("top_p", Kind.NUMBER, 1.0, doc="In (0, 1]."),
    Field("top_k", Kind.INTEGER, 0, lo=-1, hi=INT64_MAX, doc="0 or -1: off."),
    Field("min_p", Kind.NUMBER, 0.0, doc="In [0, 1]."),
    Field("seed", Kind.INTEGER, None, lo=INT64_MIN, hi=INT64_MAX),
    Field("presence_penalty", Kind.NUMBER, 0.0, doc="In [-2, 2]."),
    Field("frequency_penalty", Kind.NUMBER, 0.0, doc="In [-2, 2]."),
    Field("repetition_penalty", Kind.NUMBER, 1.0, doc="Greater than 0."),
    Field("min_tokens", Kind.INTEGER, 0, lo=0, hi=INT64_MAX),
    Field("stop", Kind.STRINGS, (), doc="Up to the first match, excluded by default."),
    Field("stop_token_ids", Kind.INTEGERS, (), lo=0, hi=INT64_MAX),
    Field("ignore_eos", Kind.BOOLEAN, False),
    Field("skip_special_tokens", Kind.BOOLEAN, True),
    Field("include_stop_str_in_output", Kind.BOOLEAN, False),
    Field(RESUME_FIELD, Kind.INTEGERS, (), lo=0, hi=INT64_MAX,
          doc="pdmesh: the output already streamed to the client, when the router moves a "
              "stream to another decode; one prompt only."),
)

STRUCTURED = table(
    Field("response_format", Kind.JSON, schema={
        "type": "object", "required": ["type"],
        "properties": {"type": {"type": "string", "enum": list(RESPONSE_FORMATS)},
                       "json_schema": {"type": "object", "required": ["name", "schema"],
                                       "properties": {"name": {"type": "string", "minLength": 1},
                                                      "description": _STR,
                                                      "strict": {"type": "boolean"},
                                                      "schema": {}}}}},
          doc="OpenAI's structured output; at most one constraint per request."),
    Field("structured_outputs", Kind.JSON, schema={
        "type": "object", "minProperties": 1,
        "properties": {"json": {}, "regex": _STR, "grammar": _STR,
                       "choice": {"type": "array", "items": _STR, "minItems": 1},
                       "json_object": {"type": "boolean"}}},
          doc="vLLM's extra body: exactly one of json, regex, choice, grammar, json_object."),
    Field("guided_json", Kind.JSON, schema={"type": ["object", "string", "boolean"]}),
    Field("guided_regex", Kind.JSON, schema=_STR),
    Field("guided_choice", Kind.JSON, schema={"type": "array", "items": _STR, "minItems": 1}),
    Field("guided_grammar", Kind.JSON, schema=_STR),
    Field("guided_decoding_backend", Kind.STRING, doc="Accepted; ignored."),
    Field("guided_whitespace_pattern", Kind.STRING, doc="Accepted; ignored."),
)

COMMON = table(
    Field("model", Kind.STRING, doc="A served model name; the first if omitted."),
    Field("stream", Kind.BOOLEAN, False, doc="Server-sent events, ended by [DONE]."),
    Field("stream_options", Kind.OBJECT, members=STREAM_OPTIONS,
          doc="Only with stream: true."),
    Field("logit_bias", Kind.JSON, schema={
        "type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_LIMIT,
                                 "maximum": LOGIT_BIAS_LIMIT}},
          doc="Token id (as a string) -> a bias in [-100, 100] added to its logit before "
              "penalties and sampling (-100 in effect bans the token, 100 forces it)."),
    Field("return_token_ids", Kind.BOOLEAN, False),
    Field("user", Kind.STRING, doc="OpenAI's end-user id; accepted, not used."),
    Field("kv_transfer_params", Kind.JSON, schema={"type": "object"},
          doc="The P/D contract between the router and the workers (internal)."),
) + STRUCTURED

COMPLETION = table(
    Field("prompt", Kind.JSON, required=True, schema={"anyOf": [
        _STR, {"type": "array", "minItems": 1, "items": _STR}, _TOKENS,
        {"type": "array", "minItems": 1, "items": _TOKENS}]}),
    Field("suffix", Kind.JSON, schema={"not": {}}, doc="Not supported."),
    Field("echo", Kind.BOOLEAN, False, doc="Not together with logprobs."),
    Field("logprobs", Kind.INTEGER, None, lo=0, hi=MAX_COMPLETION_LOGPROBS),
    Field("max_tokens", Kind.INTEGER, 16, lo=1, hi=INT64_MAX),
) + COMMON + SAMPLING

CHAT = table(
    Field("messages", Kind.JSON, required=True, schema=MESSAGES_SCHEMA),
    Field("tools", Kind.JSON, schema={"type": "array", "minItems": 1, "items": _TOOL}),
    Field("tool_choice", Kind.JSON, schema={"anyOf": [
        {"type": "string", "enum": list(TOOL_CHOICES)}, _FUNCTION_REF]},
          doc="Only with tools; auto by default."),
    Field("parallel_tool_calls", Kind.BOOLEAN, True,
          doc="false: at most one tool call (tool_choice required: the grammar allows one; "
              "auto: calls after the first are dropped, as vLLM does)."),
    Field("max_tokens", Kind.INTEGER, None, lo=1, hi=INT64_MAX, doc="Deprecated name."),
    Field("max_completion_tokens", Kind.INTEGER, None, lo=1, hi=INT64_MAX,
          doc="Up to the context length if omitted."),
    Field("logprobs", Kind.BOOLEAN, False),
    Field("top_logprobs", Kind.INTEGER, None, lo=0, hi=MAX_CHAT_TOP_LOGPROBS,
          doc="Needs logprobs: true."),
    Field("add_generation_prompt", Kind.BOOLEAN, True),
    Field("reasoning_effort", Kind.CHOICE, None, choices=REASONING_EFFORTS,
          doc="gpt-oss (harmony): how long the model reasons; medium if omitted."),
) + COMMON + SAMPLING

TOKENIZE = table(
    Field("model", Kind.STRING),
    Field("prompt", Kind.STRING, doc="Either prompt or messages."),
    Field("messages", Kind.JSON, schema=MESSAGES_SCHEMA),
    Field("add_generation_prompt", Kind.BOOLEAN, True),
    Field("add_special_tokens", Kind.BOOLEAN, doc="True for a prompt, false for messages."),
    Field("return_token_strs", Kind.BOOLEAN, False),
)

DETOKENIZE = table(
    Field("model", Kind.STRING),
    Field("tokens", Kind.INTEGERS, required=True, lo=0, hi=INT64_MAX),
)

KV_TRANSFER_ABORT = table(
    Field("kv_transfer_params", Kind.JSON, schema={"type": "object"},
          doc="What this prefill returned for the leg."),
)

__all__ = ["CHAT", "COMMON", "COMPLETION", "DETOKENIZE", "KV_TRANSFER_ABORT", "SAMPLING",
           "STREAM_OPTIONS", "STRUCTURED", "TOKENIZE", "FieldTable"]
