"""Typed requests of /v1/completions and /v1/chat/completions, parsed from JSON.

Parsing checks types and ranges that need no model (each error a 400 naming the field);
checks that need the tokenizer or the context length (token ids in the vocabulary, prompt
plus max_tokens within max_model_len) happen in `prompts.py`, and compiling a structured-output
grammar (structured_output.py, tool_constraints.py) in the engine. Unknown fields are ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from services.common.errors import BadRequestError
from services.common.openai_fields import (
    CHAT,
    COMMON,
    COMPLETION,
    MAX_CHAT_TOP_LOGPROBS,
    MAX_CHOICES,
    MAX_COMPLETION_LOGPROBS,
    SAMPLING,
    STREAM_OPTIONS,
    FieldTable,
)
from services.common.stream_usage import StreamUsage
from services.worker.chat_messages import ChatTools, parse_messages, parse_tools
from services.worker.fields import Fields, invalid, type_name
from services.worker.structured_output import one_constraint, parse_structured
from services.worker.tool_constraints import tool_choice_spec
from shared.engine.sampling_params import InvalidSamplingParams, SamplingParams
from shared.engine.structured_spec import StructuredOutputSpec
from shared.protocol.pd import RESUME_FIELD

# A completion prompt: text to tokenize, or token ids given by the client.
Prompt = str | tuple[int, ...]
__all__ = ["MAX_CHAT_TOP_LOGPROBS", "MAX_CHOICES", "MAX_COMPLETION_LOGPROBS"]  # re-exported


@dataclass(frozen=True)
class SamplingFields:
    """The sampling knobs both endpoints share (vLLM's names and defaults)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutputSpec | None = None  # response_format, guided_*, tool_choice...
    logit_bias: tuple[tuple[int, float], ...] = ()
    resumed_token_ids: tuple[int, ...] = ()  # RESUME_FIELD: a migrated request's earlier output

    def to_params(self, max_tokens: int, logprobs: int | None, renames: dict[str, str]) -> SamplingParams:
        """SamplingParams for the engine; `renames` maps its field names to the request's."""
        # A shallow copy: asdict would turn the spec dataclass into a dict.
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **values)
        except InvalidSamplingParams as exc:
            param = renames.get(exc.param, exc.param)
            raise BadRequestError(str(exc).replace(exc.param, param, 1), param=param) from None


@dataclass(frozen=True)
class CommonFields:
    """Fields outside sampling shared by both endpoints."""

    model: str | None
    sampling: SamplingFields
    stream: bool
    stream_usage: StreamUsage
    return_token_ids: bool


@dataclass(frozen=True)
class CompletionRequest:
    common: CommonFields
    prompts: tuple[Prompt, ...]
    max_tokens: int
    echo: bool
    logprobs: int | None  # top-N per token, 0..5; None: no logprobs


@dataclass(frozen=True)
class TemplateOptions:
    """How a chat is rendered into its prompt: `add_generation_prompt`, vLLM's
    `continue_final_message` (the prompt ends after the last message's text) and
    `chat_template_kwargs` (extra template variables, as (name, value) pairs)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: tuple[tuple[str, Any], ...] = ()


# Template variables a request sets through their own fields, never through chat_template_kwargs.
_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt",
                                          "continue_final_message"})


def parse_template_options(f: Fields, table: FieldTable) -> TemplateOptions:
    """The chat-rendering fields of `table` (CHAT or TOKENIZE)."""
    add_generation_prompt = f.read(table["add_generation_prompt"])
    continue_final_message = f.read(table["continue_final_message"])
    if continue_final_message and add_generation_prompt:
        raise invalid("continue_final_message",
                      "cannot be true with add_generation_prompt (set that to false)")
    given = f.obj(table["chat_template_kwargs"].name)
    kwargs: dict[str, Any] = dict(given.data) if given is not None else {}
    reserved = sorted(_RESERVED_TEMPLATE_VARIABLES & kwargs.keys())
    if reserved:
        raise invalid("chat_template_kwargs", f"{reserved[0]!r} is set by its own field")
    return TemplateOptions(add_generation_prompt, continue_final_message,
                           tuple(sorted(kwargs.items())))


@dataclass(frozen=True)
class ChatRequest:
    """A chat request; `max_tokens` None means "up to the context length".

    When both are sent, `max_completion_tokens` (the non-deprecated name) wins over
    `max_tokens`; `max_tokens_param` is whichever was used, for error messages.
    """

    common: CommonFields
    messages: tuple[dict[str, Any], ...]
    tools: ChatTools
    max_tokens: int | None
    max_tokens_param: str
    logprobs: bool
    top_logprobs: int | None
    template: TemplateOptions
    reasoning_effort: str | None = None  # harmony's system message (gpt-oss); None: medium


def parse_sampling(f: Fields) -> SamplingFields:
    """Every member of the SAMPLING table, by the table's own types and bounds."""
    values = {field.name: f.read(field) for field in SAMPLING}
    values["resumed_token_ids"] = values.pop(RESUME_FIELD)  # the wire name is pdmesh_-prefixed
    return SamplingFields(**values)


def parse_common(f: Fields, tool_spec: StructuredOutputSpec | None = None) -> CommonFields:
    """The shared fields; `tool_spec` is the constraint of a chat request's tool_choice."""
    model = f.read(COMMON["model"])
    f.read(COMMON["user"])  # accepted (type-checked), not used
    if f.has(COMMON["prompt_logprobs"].name):
        raise invalid("prompt_logprobs", "prompt_logprobs is not supported")
    stream = f.read(COMMON["stream"])
    options = f.read(COMMON["stream_options"])
    if options is not None and not stream:
        raise invalid("stream_options", "only allowed when 'stream' is true")
    stream_usage = StreamUsage()
    if options is not None:  # both members are checked, continuous_usage_stats even when ignored
        stream_usage = StreamUsage.of(options.read(STREAM_OPTIONS["include_usage"]),
                                      options.read(STREAM_OPTIONS["continuous_usage_stats"]))
    structured = one_constraint(parse_structured(f), tool_spec)
    sampling = parse_sampling(f)
    if sampling.resumed_token_ids and sampling.n > 1:
        raise invalid(RESUME_FIELD, "resumes one choice only (n=1)")
    return CommonFields(
        model=model,
        sampling=dataclasses.replace(sampling, structured=structured,
                                     logit_bias=parse_logit_bias(f)),
        stream=stream,
        stream_usage=stream_usage,
        return_token_ids=f.read(COMMON["return_token_ids"]),
    )


def parse_logit_bias(f: Fields) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"<token id>": bias} as (id, bias) pairs, ids ascending; the ids' range against
    the vocabulary and the biases' against [-100, 100] are checked with the other sampling
    parameters (PromptBuilder.sampling_params, SamplingParams)."""
    field = f.obj(COMMON["logit_bias"].name)
    if field is None:
        return ()
    pairs = []
    for key, value in field.data.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise invalid("logit_bias", f"keys must be token ids written as decimal strings, "
                          f"got {key!r}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid("logit_bias", f"values must be numbers, got {type_name(value)}")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def parse_prompts(value: Any) -> tuple[Prompt, ...]:
    """A string, an array of strings, an array of token ids, or an array of token-id arrays."""
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise invalid("prompt", "expected a string, an array of strings or of token ids (non-empty)")
    if all(isinstance(p, str) for p in value):
        return tuple(value)
    if all(_is_token_list(p) for p in value):
        return tuple(tuple(p) for p in value)
    if _is_token_list(value):
        return (tuple(value),)
    raise invalid("prompt", "mixed or unsupported element types (and token-id arrays may not be empty)")


def _is_token_list(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    f = Fields(body)
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequestError("Missing required field 'prompt'", param="prompt")
    prompts = parse_prompts(body["prompt"])
    common = parse_common(f)
    if len(prompts) * common.sampling.n > MAX_CHOICES:
        raise invalid("n", f"n times the number of prompts must be <= {MAX_CHOICES}")
    if common.sampling.resumed_token_ids and len(prompts) > 1:
        raise invalid(RESUME_FIELD, "resumes one prompt only")
    if f.has(COMPLETION["suffix"].name):
        raise invalid("suffix", "suffix is not supported")
    best_of = f.read(COMPLETION["best_of"])
    if best_of is not None and best_of != common.sampling.n:
        raise invalid("best_of", f"best_of must equal n ({common.sampling.n}): ranking more "
                                 "candidates than are returned is not supported")
    echo = f.read(COMPLETION["echo"])
    logprobs = f.read(COMPLETION["logprobs"])
    if echo and logprobs is not None:
        raise invalid("echo", "echo together with logprobs (prompt logprobs) is not supported")
    return CompletionRequest(
        common=common,
        prompts=prompts,
        max_tokens=f.read(COMPLETION["max_tokens"]),
        echo=echo,
        logprobs=logprobs,
    )


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    f = Fields(body)
    messages = parse_messages(body.get("messages"))
    tools = parse_tools(f)
    common = parse_common(f, tool_choice_spec(tools))
    legacy_max = f.read(CHAT["max_tokens"])  # type-checked even if unused
    max_tokens_param = "max_completion_tokens" if f.has("max_completion_tokens") else "max_tokens"
    max_tokens = f.read(CHAT["max_completion_tokens"])
    max_tokens = legacy_max if max_tokens is None else max_tokens
    logprobs = f.read(CHAT["logprobs"])
    top_logprobs = f.read(CHAT["top_logprobs"])
    if top_logprobs is not None and not logprobs:
        raise invalid("top_logprobs", "requires 'logprobs' to be true")
    return ChatRequest(
        common=common,
        messages=messages,
        tools=tools,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        template=parse_template_options(f, CHAT),
        reasoning_effort=f.read(CHAT["reasoning_effort"]),
    )
