"""Which chat format a worker speaks: its checkpoint's chat template, or harmony (gpt-oss).

Decided once, when the model is loaded, from its `model_type`: a harmony model renders its
prompts with openai-harmony and, unless the operator configured other parsers, reads its
output with the harmony parsers (ParsersConfig.for_model). The library's vocabulary is
resolved and loaded here, so a missing or wrong vocabulary stops the worker at startup with
a clear message instead of failing its first chat request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openai_harmony import HarmonyEncoding

from services.worker.parsers_config import HARMONY_MODEL_TYPES, ParsersConfig
from shared.parsing.harmony_encoding import load_encoding
from shared.parsing.harmony_vocab import resolve_vocab_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatFormat:
    """The loaded model's chat format: `harmony` is its encoding when prompts are rendered in
    harmony (None: the chat template); `parsers` are the ones its output is read with."""

    parsers: ParsersConfig
    harmony: HarmonyEncoding | None = None


def load_chat_format(parsers: ParsersConfig, model_config: Any, model_dir: Path | None,
                     cache_dir: Path) -> ChatFormat:
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
    return ChatFormat(effective, encoding)
