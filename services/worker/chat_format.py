"""Which chat format a worker speaks: its checkpoint's chat template, or harmony (gpt-oss).

Decided once, when the model is loaded, from its `model_type`: a harmony model renders its
prompts with openai-harmony and, unless the operator configured other parsers, reads its
output with the harmony parsers (ParsersConfig.for_model). The library's vocabulary is
resolved and loaded here, so a missing or wrong vocabulary stops the worker at startup with
a clear message instead of failing its first chat request.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openai_harmony import HarmonyEncoding

from services.worker.engine_client import TokenizerLike
from services.worker.openai_protocol import SamplingFields
from services.worker.parsers_config import HARMONY_MODEL_TYPES, ParsersConfig
from shared.parsing.harmony_encoding import load_encoding
from shared.parsing.harmony_vocab import resolve_vocab_dir

log = logging.getLogger(__name__)

# Where a harmony turn ends for the caller: the answer, or a call the client must run. (<|end|>
# only closes one message of the turn.) gpt-oss's generation_config lists them as EOS; a
# checkpoint that does not still stops there.
HARMONY_STOPS = ("<|return|>", "<|call|>")


def harmony_stop_ids(tokenizer: TokenizerLike) -> tuple[int, ...]:
    """The ids of HARMONY_STOPS in the model's tokenizer, those that are one token each."""
    ids = []
    for marker in HARMONY_STOPS:
        encoded = tokenizer.encode(marker, add_special_tokens=False)
        if len(encoded) == 1:
            ids.append(encoded[0])
        else:
            log.warning("harmony: %s is not one token of this tokenizer: no stop on it", marker)
    return tuple(ids)


@dataclass(frozen=True)
class ChatFormat:
    """The loaded model's chat format: `harmony` is its encoding when prompts are rendered in
    harmony (None: the chat template); `parsers` are the ones its output is read with."""

    parsers: ParsersConfig
    harmony: HarmonyEncoding | None = None
    stop_token_ids: tuple[int, ...] = ()  # added to every chat request's

    def sampling(self, sampling: SamplingFields) -> SamplingFields:
        """A chat request's sampling with this format's stop tokens."""
        extra = tuple(t for t in self.stop_token_ids if t not in sampling.stop_token_ids)
        if not extra:
            return sampling
        return dataclasses.replace(sampling, stop_token_ids=sampling.stop_token_ids + extra)


def load_chat_format(parsers: ParsersConfig, model_config: Any, model_dir: Path | None,
                     cache_dir: Path, tokenizer: TokenizerLike) -> ChatFormat:
    """The format of the model described by `model_config` (its `model_type`, when it has
    one), loading openai-harmony's vocabulary for a harmony model. ValueError if that
    vocabulary cannot be found or derived."""
    model_type = str(getattr(model_config, "model_type", "") or "")
    effective = parsers.for_model(model_type)
    if model_type not in HARMONY_MODEL_TYPES:
        return ChatFormat(effective)
    if model_dir is None and parsers.harmony_vocab is None:
        raise ValueError("a harmony model needs --harmony-vocab when its checkpoint directory "
                         "is unknown")
    vocab_dir = resolve_vocab_dir(parsers.harmony_vocab, model_dir or Path(), cache_dir)
    encoding = load_encoding(vocab_dir)
    log.info("chat format: harmony (vocabulary in %s; parsers %s/%s)", vocab_dir,
             effective.tool_call_parser, effective.reasoning_parser)
    return ChatFormat(effective, encoding, harmony_stop_ids(tokenizer))
