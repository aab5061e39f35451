"""Turning parsed requests into engine inputs: tokens, context-length checks, SamplingParams.

Everything here needs the loaded model (tokenizer, vocabulary size, max_model_len), so it
runs after parsing and before admission; every failure is a 400 naming the field.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from openai_harmony import HarmonyEncoding

from services.common.errors import BadRequestError
from services.worker.engine_client import EngineClient
from services.worker.generation import PreparedPrompt
from services.worker.openai_protocol import ChatRequest, Prompt, SamplingFields, TemplateOptions
from shared.engine.sampling_params import SamplingParams
from shared.model.chat_template import ChatTemplateError
from shared.model.harmony_template import render_harmony

log = logging.getLogger(__name__)

CONTEXT_CODE = "context_length_exceeded"


class PromptBuilder:
    """Tokenizes prompts and sizes generations against one engine's model.

    Chat prompts come from the checkpoint's chat template, or, given a `harmony` encoding
    (gpt-oss), from openai-harmony's renderer; either way the text is then tokenized by the
    model's tokenizer.
    """

    def __init__(self, engine: EngineClient, harmony: HarmonyEncoding | None = None) -> None:
        self.harmony = harmony
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        # Ids are valid when the model has a row for them (as HF transformers takes them),
        # even past the tokenizer's last token (padded vocabularies): those decode to "".
        self.vocab_size = int(engine.model_config.vocab_size)

    def check_token_ids(self, ids: tuple[int, ...] | list[int], param: str) -> None:
        for token in ids:
            if not 0 <= token < self.vocab_size:
                raise BadRequestError(
                    f"Token id {token} is out of range: this model takes ids in "
                    f"[0, {self.vocab_size}) (its vocabulary rows)", param=param)

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError) as exc:  # text the tokenizer cannot take: the input's fault
            raise BadRequestError(f"Cannot tokenize '{param}': {exc}", param=param) from None

    def completion_prompt(self, prompt: Prompt, need_text: bool) -> PreparedPrompt:
        if isinstance(prompt, str):
            ids = self.encode(prompt, True, "prompt")
            if not ids:
                raise BadRequestError("The prompt is empty after tokenization", param="prompt")
            return PreparedPrompt(token_ids=ids, text=prompt)
        self.check_token_ids(prompt, "prompt")
        text = self.tokenizer.decode(list(prompt), skip_special_tokens=False) if need_text else ""
        return PreparedPrompt(token_ids=list(prompt), text=text)

    def render_chat(self, messages: list[dict[str, Any]], template: TemplateOptions,
                    tools: list[dict[str, Any]] | None,
                    reasoning_effort: str | None = None) -> str:
        if self.harmony is not None:  # no chat template: its kwargs have nothing to fill
            if template.continue_final_message:
                raise BadRequestError("continue_final_message is not supported for harmony "
                                      "(gpt-oss) models", param="continue_final_message")
            try:
                return render_harmony(self.harmony, messages, tools, reasoning_effort,
                                      template.add_generation_prompt)
            except ChatTemplateError as exc:
                raise BadRequestError(str(exc), param="messages") from None
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=template.add_generation_prompt, tools=tools,
                continue_final_message=template.continue_final_message, **dict(template.kwargs))
        except Exception as exc:  # template errors are caused by the input: a 400, never a 500
            log.debug("chat template failed", exc_info=True)
            raise BadRequestError(f"Chat template error: {exc}", param="messages") from None

    def chat_prompt(self, req: ChatRequest) -> PreparedPrompt:
        text = self.render_chat(list(req.messages), req.template, req.tools.for_template,
                                req.reasoning_effort)
        # The template already holds BOS and friends: no special tokens added (as vLLM).
        ids = self.encode(text, False, "messages")
        if not ids:
            raise BadRequestError("The rendered chat prompt is empty", param="messages")
        return PreparedPrompt(token_ids=ids, text=text)

    def max_tokens_for(self, prompt_len: int, requested: int | None, prompt_param: str,
                       max_param: str) -> int:
        """The generation budget: `requested`, or all the room left; 400 if it cannot fit."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the "
                f"prompt has {prompt_len} tokens, leaving no room to generate.",
                param=prompt_param, code=CONTEXT_CODE)
        if requested is None:
            return room
        if requested > room:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                f"{requested} in the completion). Reduce the prompt or '{max_param}'.",
                param=max_param, code=CONTEXT_CODE)
        return requested

    def sampling_params(self, sampling: SamplingFields, max_tokens: int, logprobs: int | None,
                        renames: dict[str, str]) -> SamplingParams:
        self.check_token_ids(sampling.stop_token_ids, "stop_token_ids")
        self.check_token_ids([t for t, _ in sampling.logit_bias], "logit_bias")
        if sampling.top_k >= self.vocab_size:
            sampling = dataclasses.replace(sampling, top_k=0)  # same distribution, no huge top-k
        return sampling.to_params(max_tokens, logprobs, renames)
