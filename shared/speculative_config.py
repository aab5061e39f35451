"""SpeculativeConfig: the `--speculative-config` JSON (as vLLM takes it), parsed once.

Two proposers: n-gram (prompt lookup) and a draft model (a smaller model, or the target
itself quantised to MXFP4). Every key is checked here, so that a typo or an out-of-range value
is refused at start-up with a ValueError naming the key, never deep in the scheduler.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

# The largest K accepted: buffers and the tests are sized for max_num_seqs x (1 + K).
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeMethod(StrEnum):
    """Which proposer drafts the tokens the target model verifies."""

    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (vLLM's names).

    num_speculative_tokens (K) drafts per step at most; the n-gram proposer matches a suffix of
    prompt_lookup_min..prompt_lookup_max tokens. disable_by_batch_size: no request speculates in
    a step where more requests than this are running (on a CPU a batched step is no longer
    memory-bound, and verifying drafts then costs more than it saves). min_acceptance_rate (a
    pdmesh key, no vLLM equivalent): a request whose accepted / proposed draft tokens stay
    below it once it has proposed acceptance_window draft tokens stops speculating, so a
    workload that never accepts costs little more than speculation off (0 disables that).
    model / quantization (draft_model only): the draft checkpoint (a name or directory, as the
    engine's model) and an optional run-time quantisation of it ("mxfp4"; with model = the
    target's own checkpoint this is the quantised self-draft). draft_vocab_size (draft_model
    only, a pdmesh key): the draft's LM head scores token ids below it only (FR-Spec's idea,
    without its token map: BPE vocabularies number tokens by merge order, so the low ids are
    the frequent ones). The head is the largest single read of a small draft's step; ids above
    the cut are never drafted, and verification by the full target keeps the output lossless.
    quantize_lm_head (draft_model with quantization "mxfp4" only, a pdmesh key): quantise the
    draft's LM head too (the engine's --quantize-lm-head for the draft); left dense otherwise.
    """

    method: SpeculativeMethod = SpeculativeMethod.NGRAM
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = 4
    min_acceptance_rate: float = 0.2
    acceptance_window: int = 16
    model: str | None = None
    quantization: str | None = None
    draft_vocab_size: int | None = None
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "method", SpeculativeMethod(self.method))
        except ValueError:
            raise ValueError(f"speculative_config.method: unknown method {self.method!r} "
                             f"(supported: {', '.join(m.value for m in SpeculativeMethod)})"
                             ) from None
        self._check_draft_keys()
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
            raise ValueError(f"speculative_config.min_acceptance_rate must be a number in "
                             f"[0, 1], got {rate!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "disable_by_batch_size", "acceptance_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, "
                                 f"got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be <= "
                             f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError("speculative_config.prompt_lookup_max must be >= prompt_lookup_min "
                             f"({self.prompt_lookup_max} < {self.prompt_lookup_min})")

    def _check_draft_keys(self) -> None:
        drafting = self.method is SpeculativeMethod.DRAFT_MODEL
        if drafting and not (isinstance(self.model, str) and self.model.strip()):
            raise ValueError("speculative_config.model is required for method draft_model "
                             "(the draft checkpoint)")
        if not drafting and (self.model, self.quantization, self.draft_vocab_size) != (None,) * 3:
            raise ValueError("speculative_config.model, .quantization and .draft_vocab_size "
                             f"apply to method draft_model only, not {self.method.value}")
        size = self.draft_vocab_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"speculative_config.draft_vocab_size must be an integer >= 1, "
                             f"got {size!r}")
        if self.quantization not in (None, "mxfp4"):
            raise ValueError(f"speculative_config.quantization must be \"mxfp4\" or absent, "
                             f"got {self.quantization!r}")
        if not isinstance(self.quantize_lm_head, bool):
            raise ValueError(f"speculative_config.quantize_lm_head must be true or false, "
                             f"got {self.quantize_lm_head!r}")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("speculative_config.quantize_lm_head needs quantization \"mxfp4\" "
                             "(it quantises the draft's LM head with the rest of the draft)")

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | SpeculativeConfig | None
              ) -> SpeculativeConfig | None:
        """A JSON object string, a mapping, a config or None (speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not valid JSON ({exc})") from None
        if not isinstance(value, Mapping):
            raise ValueError("speculative_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        if "method" not in value:
            raise ValueError("speculative_config.method is required (e.g. \"ngram\")")
        return cls(**value)
