"""Formatting engine logprobs in the two OpenAI shapes.

Completions: `{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}`
with up to N+1 alternatives (the sampled token is always included). Chat:
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`
with exactly the top N. Token text is the single-token decode (as vLLM), so a token holding
part of a UTF-8 character shows U+FFFD while `bytes` stays exact where the decode is.
"""

from __future__ import annotations

import math
from typing import Any

from services.worker.engine_client import TokenizerLike
from shared.engine.outputs import TokenLogprob

# JSON has no -Infinity; vLLM reports impossible tokens with this value too.
LOGPROB_FLOOR = -9999.0


def safe_logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


class LogprobFormatter:
    """Renders TokenLogprob lists for one tokenizer; caches single-token decodes."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            try:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            except ValueError:  # an id the model has but the tokenizer lacks (padded vocab)
                text = ""
            self._text[token_id] = text
        return text

    def _top_sorted(self, entry: TokenLogprob, limit: int) -> list[tuple[int, float]]:
        return sorted(entry.top.items(), key=lambda kv: kv[1], reverse=True)[:limit]

    def completion(self, entries: list[TokenLogprob], top_n: int, offset: int) -> tuple[dict[str, Any], int]:
        """The completions `logprobs` object and the text offset after these tokens."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for entry in entries:
            text = self.token_text(entry.token_id)
            tokens.append(text)
            token_logprobs.append(safe_logprob(entry.logprob))
            top = {self.token_text(t): safe_logprob(lp) for t, lp in self._top_sorted(entry, top_n)}
            top.setdefault(text, safe_logprob(entry.logprob))
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}
        return body, offset

    def _chat_item(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": safe_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    def chat(self, entries: list[TokenLogprob], top_n: int) -> dict[str, Any]:
        content = []
        for entry in entries:
            item = self._chat_item(entry.token_id, entry.logprob)
            item["top_logprobs"] = [self._chat_item(t, lp) for t, lp in self._top_sorted(entry, top_n)]
            content.append(item)
        return {"content": content}
