"""GGUF tokenizer metadata -> Hugging Face tokenizer files (tokenizer.json and friends).

A GGUF carries no tokenizer.json, only llama.cpp's description of one: the token strings (already
spelled in GPT-2's byte-to-unicode alphabet for byte-level BPE), the merges as "a b" strings, a
type per token, special ids, and a `tokenizer.ggml.pre` name that stands for a pre-tokenizer regex
hard-coded inside llama.cpp (src/llama-vocab.cpp). We rebuild the equivalent `tokenizers`
pipeline so that ids match llama.cpp / the original HF tokenizer exactly.

`tokenizer.ggml.model` "gpt2" (byte-level BPE: SmolLM2, Llama 3, Qwen2/2.5/3) is rebuilt here,
with the pre-tokenizers of `_DIGIT_SPLIT_PRE`, `_GPT2_PRE` and `_SPLIT_PRE`; "llama"
(SentencePiece BPE: Llama 2, Mistral v0.1...) in `shared.model.gguf_spm`. Anything else is
refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from dataclasses import field as dc_field
from enum import IntEnum
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from shared.model.gguf_arch import UnsupportedGgufError, field


class GgufTokenType(IntEnum):
    """llama.cpp's `llama_token_type` values stored in `tokenizer.ggml.token_type`."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# `tokenizer.ggml.pre` names whose llama.cpp regex list is {"\p{N}", <GPT-2 regex>}: every digit is
# its own pre-token, then the GPT-2 split. `Digits(individual_digits=True)` + byte-level GPT-2 regex
# is exactly that (and is what the original SmolLM2 / StarCoder tokenizer.json uses).
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone"})
# Plain GPT-2 regex.
_GPT2_PRE = frozenset({"default", "gpt-2", "gpt2", "mpt", "olmo", "jais"})
# Pre-tokenizers that are one regex split (llama.cpp's regex list for the name; the same as the
# `Split` of the original tokenizer.json), then byte-level without regex. Qwen2's tokenizer.json
# also NFC-normalises (transformers' Qwen2Tokenizer), which `_NFC_PRE` adds.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_PRE = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "llama-v3": _LLAMA3_REGEX,
              "smaug-bpe": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}
_NFC_PRE = frozenset({"qwen2"})
TOKENIZER_MODELS = ("gpt2", "llama")


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer part of a GGUF's metadata, as plain Python values."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str  # tokenizer.ggml.pre, e.g. "smollm"
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    scores: list[float] = dc_field(default_factory=list)  # SentencePiece piece scores
    add_space_prefix: bool = True  # SentencePiece: prefix the text with "▁"
    eot_token_id: int | None = None  # llama.cpp's end-of-turn / end-of-message ids
    eom_token_id: int | None = None

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]

    def ids_of_type(self, kind: GgufTokenType) -> list[int]:
        return [i for i, t in enumerate(self.token_types) if t == kind]


def read_vocab(reader: GGUFReader) -> GgufVocab:
    """Pull the tokenizer metadata out of an open GGUF; raises for tokenizers we cannot rebuild."""
    model = field(reader, "tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        raise UnsupportedGgufError(
            f"GGUF tokenizer model {model!r} is not supported (supported: gpt2 = byte-level BPE, "
            "llama = SentencePiece BPE)")
    tokens = list(field(reader, "tokenizer.ggml.tokens", []))
    types = [int(t) for t in field(reader, "tokenizer.ggml.token_type",
                                   [GgufTokenType.NORMAL] * len(tokens))]
    if not tokens or len(types) != len(tokens):
        raise UnsupportedGgufError("GGUF tokenizer metadata is missing tokens or has mismatched "
                                   "token types")
    return GgufVocab(
        model=model,
        pre=str(field(reader, "tokenizer.ggml.pre", "default")),
        tokens=tokens,
        token_types=types,
        merges=list(field(reader, "tokenizer.ggml.merges", [])),
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id"),
        unk_token_id=field(reader, "tokenizer.ggml.unknown_token_id"),
        pad_token_id=field(reader, "tokenizer.ggml.padding_token_id"),
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
        add_bos_token=bool(field(reader, "tokenizer.ggml.add_bos_token", model == "llama")),
        add_eos_token=bool(field(reader, "tokenizer.ggml.add_eos_token", False)),
        chat_template=field(reader, "tokenizer.chat_template"),
        scores=[float(x) for x in field(reader, "tokenizer.ggml.scores", [])],
        add_space_prefix=bool(field(reader, "tokenizer.ggml.add_space_prefix", True)),
        eot_token_id=field(reader, "tokenizer.ggml.eot_token_id"),
        eom_token_id=field(reader, "tokenizer.ggml.eom_token_id"),
    )


def check_vocab(vocab: GgufVocab) -> None:
    """Refuse a vocabulary whose tokenizer we cannot rebuild, without building it."""
    if vocab.model == "gpt2":
        _pre_tokenizer(vocab.pre)
    elif len(vocab.scores) != len(vocab.tokens):
        raise UnsupportedGgufError("GGUF SentencePiece tokenizer has no score per token")


def eos_token_ids(vocab: GgufVocab) -> list[int]:
    """eos, then llama.cpp's end-of-turn and end-of-message ids, deduplicated."""
    ids = (vocab.eos_token_id, vocab.eot_token_id, vocab.eom_token_id)
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_PRE:
        return byte_level
    known = sorted(_DIGIT_SPLIT_PRE | _GPT2_PRE | set(_SPLIT_PRE))
    raise UnsupportedGgufError(f"unsupported GGUF pre-tokenizer {pre!r}; known: {known}")


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        # Byte-level tokens never contain a literal space (it is spelled "Ġ"), so one space separates.
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right or " " in right:
            raise UnsupportedGgufError(f"malformed GGUF merge {merge!r}")
        pairs.append((left, right))
    return pairs


def _byte_level_tokenizer(vocab: GgufVocab, ids: dict[str, int]) -> Tokenizer:
    bpe = models.BPE(vocab=ids, merges=_split_merges(vocab.merges), fuse_unk=False,
                     byte_fallback=False)
    tok = Tokenizer(bpe)
    if vocab.pre in _NFC_PRE:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(vocab.pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _post_processor(vocab: GgufVocab, byte_level: bool) -> processors.PostProcessor | None:
    """BOS / EOS added as the GGUF asks (TemplateProcessing, as in HF's own tokenizer.json)."""
    first = [vocab.bos_token_id] if vocab.add_bos_token and vocab.bos_token_id is not None else []
    last = [vocab.eos_token_id] if vocab.add_eos_token and vocab.eos_token_id is not None else []
    base = processors.ByteLevel(trim_offsets=False) if byte_level else None
    if not first and not last:
        return base
    f, la = [vocab.tokens[i] for i in first], [vocab.tokens[i] for i in last]
    template = processors.TemplateProcessing(
        single=" ".join([*f, "$A", *la]), pair=" ".join([*f, "$A", *la, *f, "$B:1", *la]),
        special_tokens=[(vocab.tokens[i], i) for i in dict.fromkeys(first + last)])
    return template if base is None else processors.Sequence([base, template])


def build_tokenizer(vocab: GgufVocab) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to llama.cpp's for this vocabulary.

    CONTROL tokens become special added tokens (matched whole in input text, skippable on decode);
    USER_DEFINED tokens become non-special added tokens. Ids are the GGUF's ids.
    """
    from shared.model.gguf_spm import sentencepiece_tokenizer

    check_vocab(vocab)
    ids = {tok: i for i, tok in enumerate(vocab.tokens)}
    if len(ids) != len(vocab.tokens):
        raise UnsupportedGgufError("GGUF vocabulary has duplicate token strings")
    if vocab.model == "gpt2":
        tok = _byte_level_tokenizer(vocab, ids)
    else:
        tok = sentencepiece_tokenizer(vocab, ids)
    post = _post_processor(vocab, byte_level=vocab.model == "gpt2")
    if post is not None:
        tok.post_processor = post
    specials = [vocab.tokens[i] for i in sorted(vocab.ids_of_type(GgufTokenType.CONTROL)
                                                + vocab.ids_of_type(GgufTokenType.UNKNOWN))]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    user = [vocab.tokens[i] for i in vocab.ids_of_type(GgufTokenType.USER_DEFINED)]
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    assert tok.get_vocab_size(with_added_tokens=True) == len(vocab.tokens)
    return tok


def tokenizer_config(vocab: GgufVocab, model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json in the shape transformers writes for a fast tokenizer."""
    control = sorted(vocab.ids_of_type(GgufTokenType.CONTROL)
                     + vocab.ids_of_type(GgufTokenType.UNKNOWN))
    named = {vocab.bos_token_id, vocab.eos_token_id, vocab.unk_token_id, vocab.pad_token_id}
    added = {
        str(i): {
            "content": vocab.tokens[i],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": vocab.token_types[i] != GgufTokenType.USER_DEFINED,
        }
        for i in control + vocab.ids_of_type(GgufTokenType.USER_DEFINED)
    }
    # add_prefix_space only for byte-level BPE (False, as GPT-2); a SentencePiece prefix lives
    # in tokenizer.json's Metaspace, which transformers would rebuild from this key.
    prefix = {"add_prefix_space": False} if vocab.model == "gpt2" else {}
    return {
        "add_bos_token": vocab.add_bos_token,
        "add_eos_token": vocab.add_eos_token,
        **prefix,
        "added_tokens_decoder": added,
        "additional_special_tokens": [vocab.tokens[i] for i in control if i not in named],
        "bos_token": vocab.token(vocab.bos_token_id),
        "eos_token": vocab.token(vocab.eos_token_id),
        "pad_token": vocab.token(vocab.pad_token_id),
        "unk_token": vocab.token(vocab.unk_token_id),
        "chat_template": vocab.chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        # The generic fast class loads tokenizer.json as written, without re-deriving a pipeline.
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_tokenizer_files(vocab: GgufVocab, dest: Path, model_max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and (when the GGUF has one) chat_template.jinja."""
    build_tokenizer(vocab).save(str(dest / "tokenizer.json"))
    config = tokenizer_config(vocab, model_max_length)
    (dest / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    if vocab.chat_template:
        (dest / "chat_template.jinja").write_text(vocab.chat_template, encoding="utf-8")
