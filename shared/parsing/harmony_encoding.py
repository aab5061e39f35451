"""The process's openai-harmony encoding (o200k_harmony), loaded once from a local vocabulary.

openai-harmony reads its vocabulary's location from the environment variable
`TIKTOKEN_ENCODINGS_BASE` when the encoding is loaded (and downloads it otherwise, which a
server must never do). `load_encoding` is the one place that sets it, right before the load,
to the directory `harmony_vocab.resolve_vocab_dir` verified; the worker calls it once at
startup for a gpt-oss model. Parsers and renderers then take `encoding()`, which refuses to
fall back to a download.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from openai_harmony import HarmonyEncoding, HarmonyEncodingName, load_harmony_encoding

from shared.parsing.harmony_vocab import VOCAB_FILE

ENCODINGS_BASE_ENV = "TIKTOKEN_ENCODINGS_BASE"  # read by openai-harmony itself, never by us

_lock = threading.Lock()
_loaded: tuple[Path, HarmonyEncoding] | None = None


class HarmonyNotConfigured(RuntimeError):
    """The harmony format was used before `load_encoding` gave it a vocabulary."""


def load_encoding(vocab_dir: Path) -> HarmonyEncoding:
    """Load (once per process) the gpt-oss encoding from `vocab_dir/o200k_base.tiktoken`.

    Later calls with the same directory return the same encoding; another directory is a
    ValueError (the library keeps one vocabulary per process)."""
    global _loaded
    vocab_dir = vocab_dir.resolve()
    with _lock:
        if _loaded is not None:
            if _loaded[0] != vocab_dir:
                raise ValueError(f"harmony's vocabulary is already loaded from {_loaded[0]}, "
                                 f"not {vocab_dir}")
            return _loaded[1]
        if not (vocab_dir / VOCAB_FILE).is_file():
            raise ValueError(f"no {VOCAB_FILE} in {vocab_dir}")
        os.environ[ENCODINGS_BASE_ENV] = str(vocab_dir)
        encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        _loaded = (vocab_dir, encoding)
        return encoding


def encoding() -> HarmonyEncoding:
    """The loaded encoding; HarmonyNotConfigured before `load_encoding`."""
    loaded = _loaded
    if loaded is None:
        raise HarmonyNotConfigured("the harmony format needs its o200k vocabulary: the worker "
                                   "loads it at startup for gpt-oss models (--harmony-vocab)")
    return loaded[1]
