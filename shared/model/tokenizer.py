"""The tokenizer of a Hugging Face-format model directory (tokenizer.json + configs).

Wraps `tokenizers.Tokenizer` (Rust, fast) and reads the special-token facts scattered over
tokenizer_config.json, config.json and generation_config.json. Chat templates come from
chat_template.jinja when present (transformers' newer layout), else tokenizer_config.json.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from shared.model.chat_template import ChatTemplate, ChatTemplateError

__all__ = ["ChatTemplateError", "Tokenizer"]

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _token_str(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template_source(model_dir: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]: use "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class Tokenizer:
    """Text <-> token ids for one model directory, plus its special ids and chat template.

    `encode` recognises special tokens written in the text (e.g. "<|im_start|>" -> one id), as
    HF does by default; `add_special_tokens` only controls what the post-processor adds (BOS
    etc.). `eos_token_ids` is the ordered union of every EOS the checkpoint declares.
    """

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self.backend = tokenizers.Tokenizer.from_file(str(tok_file))
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        config = _read_json(model_dir / "config.json")
        gen_config = _read_json(model_dir / "generation_config.json")
        self.special_tokens = {n: _token_str(tok_config.get(n)) for n in _SPECIAL_NAMES}
        self.bos_token_id = self._first_id(self.special_tokens["bos_token"], config.get("bos_token_id"))
        self.pad_token_id = self._first_id(self.special_tokens["pad_token"], config.get("pad_token_id"))
        eos = _id_list(gen_config.get("eos_token_id")) + _id_list(config.get("eos_token_id"))
        eos_tok = self.token_to_id(self.special_tokens["eos_token"] or "")
        eos += [eos_tok] if eos_tok is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        added = self.backend.get_added_tokens_decoder()
        self.all_special_ids: tuple[int, ...] = tuple(sorted(i for i, t in added.items() if t.special))
        # add_bos_token with a post-processor that does not add it itself (older HF dirs).
        self._prepend_bos = (
            bool(tok_config.get("add_bos_token")) and self.bos_token_id is not None
            and self.bos_token_id not in self.backend.encode("", add_special_tokens=True).ids
        )
        self.chat_template = ChatTemplate(_chat_template_source(model_dir, tok_config), self.special_tokens)

    def _first_id(self, token: str | None, fallback: Any) -> int | None:
        found = self.token_to_id(token) if token else None
        if found is not None:
            return found
        ids = _id_list(fallback)
        return ids[0] if ids else None

    @functools.cached_property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included); fixed once loaded
        (decode asks for it at every step)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)  # _prepend_bos implies a bos id; mypy can't see it
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. An id the tokenizer cannot spell (>= vocab_size: the padding rows of
        a model whose embedding has more rows than the tokenizer has tokens, e.g. Qwen2.5's
        151,936 rows for 151,665 tokens) decodes to "", as in HF transformers; a negative id
        is no token id at all and raises ValueError."""
        ids = list(ids)
        if any(i < 0 for i in ids):
            raise ValueError("token ids must be >= 0")
        vocab = self.vocab_size
        known = [i for i in ids if i < vocab]
        return self.backend.decode(known, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of an id (byte-level spelling, e.g. "Ġthe"); None if unknown."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[Any], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        """Render `messages` to a prompt string (HF semantics; `kwargs` are extra template
        variables); raises ChatTemplateError."""
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, continue_final_message=continue_final_message,
                                         **kwargs)
