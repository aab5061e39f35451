"""Offline batch inference in vLLM's style: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from shared.config import DEFAULT_MODEL, EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.outputs import FinishReason, TokenLogprob
from shared.engine.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


@dataclass
class CompletionOutput:
    """One choice of one prompt."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationOutput:
    """The result for one prompt; the shortcuts read choice 0 (`outputs[0]`)."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs


def _normalise_prompts(prompts: str | Sequence[Prompt]) -> list[Prompt]:
    """str | list[str] | list[int] | list[list[int]] -> a list of single prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items: list[object] = list(prompts)
    if not items:
        raise ValueError("no prompts given")
    ids = [p for p in items if isinstance(p, int)]
    if len(ids) == len(items):  # one prompt given as token ids
        return [ids]
    out: list[Prompt] = []
    for p in items:
        if isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)):
            out.append(p)
        else:
            raise TypeError("a prompt is a str or a list of token ids")
    return out


class LLM:
    """Loads a model once and runs batches of prompts to completion on the calling thread.

    `LLM(model=PATH_OR_NAME, dtype="float32"|"bfloat16", max_model_len=..., **EngineConfig
    fields)`. All prompts of a call are queued at once and run with continuous batching.
    A subclass runs another engine by overriding `_build_engine`.
    """

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "float32",
                 max_model_len: int | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, dtype=dtype, max_model_len=max_model_len, **kwargs)
        self.engine = self._build_engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def _build_engine(self, config: EngineConfig) -> LLMEngine:
        return LLMEngine.from_config(config)

    def generate(self, prompts: str | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[GenerationOutput]:
        items = _normalise_prompts(prompts)
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(items)
        if len(plist) != len(items):
            raise ValueError(f"{len(plist)} SamplingParams for {len(items)} prompts")
        encoded = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in items]
        for ids, p in zip(encoded, plist, strict=True):  # all checked before any is queued
            self.engine.validate(ids, p.for_choice(0))
        results: list[GenerationOutput] = []
        by_id: dict[str, tuple[GenerationOutput, CompletionOutput]] = {}
        for prompt, ids, p in zip(items, encoded, plist, strict=True):
            result = GenerationOutput(prompt if isinstance(prompt, str) else None, ids, [])
            for i in range(p.n):
                choice = CompletionOutput(index=i, logprobs=[] if p.logprobs is not None else None)
                result.outputs.append(choice)
                by_id[f"llm-{self._counter}"] = (result, choice)
                self.engine.add_request(f"llm-{self._counter}", ids, p.for_choice(i))
                self._counter += 1
            results.append(result)
        try:
            self._run(by_id)
        except BaseException:  # e.g. KeyboardInterrupt: leave the engine empty for next time
            for rid in by_id:
                self.engine.abort_request(rid)
            self.engine.step()  # flush the abort outputs
            raise
        return results

    def _run(self, by_id: dict[str, tuple[GenerationOutput, CompletionOutput]]) -> None:
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                result, choice = by_id[out.request_id]
                choice.token_ids, choice.text = out.token_ids, out.text
                choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
                if choice.logprobs is not None and out.new_logprobs:
                    choice.logprobs.extend(out.new_logprobs)
                if choice.index == 0:
                    result.num_cached_tokens = out.num_cached_tokens

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             ) -> list[GenerationOutput]:
        """One conversation (a list of messages) or a list of them; the chat template is
        applied with add_generation_prompt=True."""
        # The first item tells the two shapes apart: a message is a dict, a conversation is not.
        convs: list[Sequence[Message]]
        if messages and isinstance(messages[0], dict):
            convs = [cast(Sequence[Message], messages)]
        else:
            convs = list(cast(Sequence[Sequence[Message]], messages))
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c), add_special_tokens=False)
                   for c in convs]
        results = self.generate(prompts, params)
        for r in results:
            r.prompt = self.tokenizer.decode(r.prompt_token_ids, skip_special_tokens=False)
        return results
