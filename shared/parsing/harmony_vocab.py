"""The o200k vocabulary file that openai-harmony needs, found or derived offline.

openai-harmony's encoding (`HARMONY_GPT_OSS`, o200k_harmony) is built from OpenAI's
`o200k_base.tiktoken`: one line per ordinary token, `base64(token bytes) rank\\n` in rank
order. The library downloads it unless the environment variable `TIKTOKEN_ENCODINGS_BASE`
names a directory that holds it, and in both cases checks the file's SHA-256 against
`VOCAB_SHA256`: a stand-in vocabulary is refused, so the file must be byte-identical.

No download is needed here: a gpt-oss checkpoint ships the same vocabulary in its
`tokenizer.json` (byte-level BPE, the first `BASE_TOKENS` ranks are o200k_base's), from
which `derive_vocab` writes the exact file. An operator may instead point at a directory or
file holding it (`pdmesh serve --harmony-vocab`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

VOCAB_FILE = "o200k_base.tiktoken"
# What openai-harmony 0.0.8 expects (src/tiktoken_ext/public_encodings.rs, expected_hash).
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
BASE_TOKENS = 199998  # o200k_base's ordinary tokens: ranks 0..199997; specials come after


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character standing for each byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def vocab_lines(ranks: dict[bytes, int]) -> bytes:
    """The tiktoken file format: `base64(token) rank\\n` per token, in rank order."""
    ordered = sorted(ranks.items(), key=lambda item: item[1])
    return b"".join(base64.b64encode(token) + b" %d\n" % rank for token, rank in ordered)


def _checked(data: bytes, source: str) -> bytes:
    digest = hashlib.sha256(data).hexdigest()
    if digest != VOCAB_SHA256:
        raise ValueError(f"{source} is not OpenAI's o200k vocabulary (sha256 {digest}, "
                         f"openai-harmony needs {VOCAB_SHA256})")
    return data


def derive_vocab(tokenizer_json: Path, out_dir: Path) -> Path:
    """Write `out_dir/o200k_base.tiktoken` from a gpt-oss `tokenizer.json`; ValueError if the
    tokenizer does not hold exactly the o200k vocabulary (checked by the file's hash)."""
    try:
        model = json.loads(tokenizer_json.read_text(encoding="utf-8"))["model"]
        vocab: dict[str, int] = model["vocab"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read a BPE vocabulary from {tokenizer_json}: {exc}") from None
    decoder = _byte_decoder()
    ranks: dict[bytes, int] = {}
    for token, rank in vocab.items():
        if rank >= BASE_TOKENS:
            continue
        try:
            ranks[bytes(decoder[c] for c in token)] = rank
        except KeyError:
            raise ValueError(f"{tokenizer_json}: token {token!r} is not byte-level BPE, so "
                             "this is not an o200k tokenizer") from None
    data = _checked(vocab_lines(ranks), f"the vocabulary of {tokenizer_json}")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / VOCAB_FILE
    partial = target.with_suffix(f".tmp{os.getpid()}")
    partial.write_bytes(data)
    partial.replace(target)  # atomic: a concurrent worker never reads half a file
    return target


def _has_valid_vocab(directory: Path) -> bool:
    path = directory / VOCAB_FILE
    if not path.is_file():
        return False
    return hashlib.sha256(path.read_bytes()).hexdigest() == VOCAB_SHA256


def resolve_vocab_dir(explicit: Path | None, model_dir: Path, cache_dir: Path) -> Path:
    """The directory holding a verified `o200k_base.tiktoken` for openai-harmony.

    `explicit` (the operator's file or directory) wins; otherwise `cache_dir/harmony` is
    used, derived from `model_dir/tokenizer.json` the first time. ValueError names what is
    missing or wrong, for a clear startup failure."""
    if explicit is not None:
        directory = explicit.parent if explicit.is_file() else explicit
        if explicit.is_file() and explicit.name != VOCAB_FILE:
            raise ValueError(f"--harmony-vocab: the file must be named {VOCAB_FILE} "
                             f"(openai-harmony looks it up by that name), got {explicit}")
        if not (directory / VOCAB_FILE).is_file():
            raise ValueError(f"--harmony-vocab: no {VOCAB_FILE} in {directory}")
        _checked((directory / VOCAB_FILE).read_bytes(), str(directory / VOCAB_FILE))
        return directory
    directory = cache_dir / "harmony"
    if not _has_valid_vocab(directory):
        logger.info("deriving %s from %s into %s", VOCAB_FILE, model_dir / "tokenizer.json",
                    directory)
        derive_vocab(model_dir / "tokenizer.json", directory)
    return directory
