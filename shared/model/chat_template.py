"""Chat templates rendered with Hugging Face transformers' semantics.

The environment mirrors `transformers.utils.chat_template_utils._cached_compile_jinja_template`:
an ImmutableSandboxedEnvironment (templates come from checkpoints and are untrusted) with
trim_blocks, lstrip_blocks and loop controls, a `tojson` filter that does not HTML-escape, and the
`raise_exception` / `strftime_now` globals; a `{% generation %}` block renders its body as-is.
Every failure, whether the template's own `raise_exception` or a bad message tripping it, becomes a
`ChatTemplateError` (a ValueError) so the services can answer 400 instead of 500.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or refused to render these messages."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _content_text(content: Any, index: int) -> Any:
    """OpenAI content parts -> one string (text parts joined by newlines, as vLLM does)."""
    if not isinstance(content, Sequence) or isinstance(content, str):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(f"messages[{index}]: unsupported content part {kind!r}")
    return "\n".join(texts)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated plain-dict messages: a role each, None-valued keys dropped (as HF does), and
    list-of-parts content flattened to a string."""
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise ChatTemplateError("messages must be a list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] must be an object with a string 'role'")
        plain = {k: v for k, v in message.items() if v is not None}
        if "content" in plain:
            plain["content"] = _content_text(plain["content"], i)
        out.append(plain)
    return out


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference.

    Compilation is deferred to the first render so a checkpoint with a broken template still
    loads (and only chat requests fail, with ChatTemplateError).
    """

    def __init__(self, source: str | None, special_tokens: Mapping[str, str | None]) -> None:
        self.source = source
        self._special = {k: v for k, v in special_tokens.items() if v is not None}
        self._compiled: jinja2.Template | None = None

    def _template(self) -> jinja2.Template:
        if self.source is None:
            raise ChatTemplateError("this model has no chat template; use the completions API")
        if self._compiled is None:
            try:
                self._compiled = _environment().from_string(self.source)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"chat template does not compile: {e}") from e
        return self._compiled

    def render(self, messages: Any, *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
               **kwargs: Any) -> str:
        """The prompt string for `messages`; template variables are `messages`, `tools`,
        `add_generation_prompt`, the special tokens (bos_token, eos_token, ...) and `kwargs`.
        continue_final_message: the prompt stops right after the last message's text, so the
        model goes on with that message (transformers' rule: `_tag_final_message`); not
        together with add_generation_prompt."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot "
                                    "both be true")
        template = self._template()
        variables = {**self._special, **kwargs}
        plain = normalize_messages(messages)
        if continue_final_message:
            plain = _tag_final_message(plain)
        try:
            text = template.render(messages=plain, tools=tools,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:
            raise
        except Exception as e:  # untrusted template code: any failure is the request's fault
            raise ChatTemplateError(f"chat template failed to render: {e}") from e
        return _cut_at_tag(text, plain[-1]["content"]) if continue_final_message else text


# Appended to the last message's text to find where the template rendered its end
# (transformers' rule for continue_final_message, so both cut the same prompt).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with _CONTINUE_TAG after the last one's text (a copy)."""
    if not messages:
        raise ChatTemplateError("continue_final_message: the conversation is empty")
    content = messages[-1].get("content")
    if not isinstance(content, str):
        raise ChatTemplateError("continue_final_message: the last message has no text to "
                                "continue")
    return [*messages[:-1], {**messages[-1], "content": content + _CONTINUE_TAG}]


def _cut_at_tag(text: str, tagged: str) -> str:
    """`text` up to the last message's end: before the tag, and before the whitespace the
    template trimmed (it trimmed the tag's own space too, then)."""
    content = tagged[:-len(_CONTINUE_TAG)]
    tag = _CONTINUE_TAG.strip()
    if content.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message: the chat template does not render "
                                "the last message's text as it is")
    at = text.rindex(tag)
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
