"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from shared.engine.structured_spec import StructuredOutputSpec

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; `param` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one sequence, in vLLM's vocabulary.

    `temperature == 0` means greedy. A `seed` makes every draw a pure function of
    (seed, position of the token being sampled), so a request gives the same tokens alone,
    in any batch, and when its prefill and decode run on different workers.
    `n` is handled by the callers (offline `LLM` and the services) by fanning out into
    `n` engine requests with `for_choice(i)`; the engine itself always sees `n == 1`.
    `structured` constrains the output to a grammar (JSON schema, regex, choice...), applied
    as a token mask in the sampler (shared.engine.structured).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one is always added)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutputSpec | None = None
    # (token id, bias) pairs added to the logits before penalties (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Output ids this sequence already produced elsewhere (a migrated request: the router
    # re-dispatches it after its decode failed). The caller appends them to the prompt; the
    # detokenizer and stop strings start from them, so the new text is exactly what follows
    # theirs. max_tokens and min_tokens count the new tokens only.
    resumed_token_ids: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "resumed_token_ids",
                           tuple(int(t) for t in self.resumed_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        checks = [
            (self.n >= 1, "n", "must be >= 1"),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be -1, 0 or a positive integer"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (self.min_tokens >= 0, "min_tokens", "must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "must be <= max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (all(t >= 0 and -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT
                 for t, b in self.logit_bias), "logit_bias",
             f"must map token ids >= 0 to biases in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"),
            (len({t for t, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias",
             "must name each token once"),
        ]
        if self.structured is not None and not isinstance(self.structured, StructuredOutputSpec):
            raise InvalidSamplingParams("structured must be a StructuredOutputSpec", "structured")
        for ok, param, msg in checks:
            if not ok:
                raise InvalidSamplingParams(f"{param} {msg}, got {getattr(self, param)!r}", param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_choice(self, index: int) -> SamplingParams:
        """Params for choice `index` of an n>1 request: n=1, and a distinct derived seed."""
        seed = self.seed
        if seed is not None and index > 0:
            seed = (seed * 1_000_003 + index) & 0x7FFF_FFFF_FFFF_FFFF
        return dataclasses.replace(self, n=1, seed=seed)
