"""GGUF tokenizer metadata -> Hugging Face tokenizer files (tokenizer.json and friends).

A GGUF carries no tokenizer.json, only llama.cpp's description of one: the token strings (already
spelled in GPT-2's byte-to-unicode alphabet for byte-level BPE), the merges as "a b" strings, a
type per token, special ids, and a `tokenizer.ggml.pre` name that stands for a pre-tokenizer regex
hard-coded inside llama.cpp (src/llama-vocab.cpp). We rebuild the equivalent `tokenizers`
pipeline so that ids match llama.cpp / the original HF tokenizer exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors


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


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer part of a GGUF's metadata, as plain Python values."""

    model: str  # tokenizer.ggml.model, e.g. "gpt2"
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

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]

    def ids_of_type(self, kind: GgufTokenType) -> list[int]:
        return [i for i, t in enumerate(self.token_types) if t == kind]


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_vocab(reader: GGUFReader) -> GgufVocab:
    """Pull the tokenizer metadata out of an open GGUF; raises for tokenizers we cannot rebuild."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE GGUF tokenizers (model 'gpt2') are supported, got {model!r}")
    tokens = list(_field(reader, "tokenizer.ggml.tokens", []))
    types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type", [GgufTokenType.NORMAL] * len(tokens))]
    if not tokens or len(types) != len(tokens):
        raise ValueError("GGUF tokenizer metadata is missing tokens or has mismatched token types")
    return GgufVocab(
        model=model,
        pre=str(_field(reader, "tokenizer.ggml.pre", "default")),
        tokens=tokens,
        token_types=types,
        merges=list(_field(reader, "tokenizer.ggml.merges", [])),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        unk_token_id=_field(reader, "tokenizer.ggml.unknown_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_PRE:
        return byte_level
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; known: {sorted(_DIGIT_SPLIT_PRE | _GPT2_PRE)}")


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        # Byte-level tokens never contain a literal space (it is spelled "Ġ"), so one space separates.
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right or " " in right:
            raise ValueError(f"malformed GGUF merge {merge!r}")
        pairs.append((left, right))
    return pairs


def build_tokenizer(vocab: GgufVocab) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` equivalent to llama.cpp's for this vocabulary.

    CONTROL tokens become special added tokens (matched whole in input text, skippable on decode);
    USER_DEFINED tokens become non-special added tokens. Ids are the GGUF's ids.
    """
    ids = {tok: i for i, tok in enumerate(vocab.tokens)}
    if len(ids) != len(vocab.tokens):
        raise ValueError("GGUF vocabulary has duplicate token strings")
    bpe = models.BPE(vocab=ids, merges=_split_merges(vocab.merges), fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(vocab.pre)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [vocab.tokens[i] for i in vocab.ids_of_type(GgufTokenType.CONTROL)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    user = [vocab.tokens[i] for i in vocab.ids_of_type(GgufTokenType.USER_DEFINED)]
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    assert tok.get_vocab_size(with_added_tokens=True) == len(vocab.tokens)
    return tok


def tokenizer_config(vocab: GgufVocab, model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json in the shape transformers writes for a fast GPT-2 style tokenizer."""
    control = vocab.ids_of_type(GgufTokenType.CONTROL)
    named = {vocab.bos_token_id, vocab.eos_token_id, vocab.unk_token_id, vocab.pad_token_id}
    added = {
        str(i): {
            "content": vocab.tokens[i],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": vocab.token_types[i] == GgufTokenType.CONTROL,
        }
        for i in control + vocab.ids_of_type(GgufTokenType.USER_DEFINED)
    }
    return {
        "add_bos_token": vocab.add_bos_token,
        "add_eos_token": vocab.add_eos_token,
        "add_prefix_space": False,
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
