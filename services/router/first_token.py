"""The prefill's first token as stream chunks, and removing it again from the decode's stream.

The decode leg returns the *whole* completion, starting with the token the prefill produced. When
the router has already streamed that token, `FirstTokenSkipper` cuts it out of the decode's
chunks, per choice index: its text (by characters), its logprobs entries and its token ids (by
count), the repeated role delta and the repeated prompt ids.

A prefill whose answer says its output is parsed (`OUTPUT_PARSED_FIELD`: the workers read tool
calls or reasoning out of it) gets no early chunks: the decode's parser may hold that first
token back or turn it into reasoning or a call, and text already sent cannot be taken back.
Its skipper then cuts nothing. (The orchestrator also asks the decode's metadata: a decode with
a reasoning parser gets no early chunks whatever its prefill says.)

With continuous usage (services/common/stream_usage.py) the early chunks carry the counts a
mixed worker's would: the prefill's prompt tokens, none generated on the role chunk, then the
first token. The decode's own chunks count that token too (its engine emits it first), so once
the skipper has dropped the decode's copies, the stream's counts are the mixed worker's. A
decode chunk whose every choice is cut goes, even with its usage: the client already has
those counts from the early chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.stream_usage import StreamUsage, TokenCounts
from shared.protocol.pd import OUTPUT_PARSED_FIELD, ApiKind


def _choice_text(kind: ApiKind, choice: dict[str, Any]) -> str:
    if kind is ApiKind.COMPLETIONS:
        return choice.get("text") or ""
    return (choice.get("message") or {}).get("content") or ""


def decode_parses(prefill: dict[str, Any]) -> bool:
    """Whether the workers parse this request's output (so nothing may go out early)."""
    return prefill.get(OUTPUT_PARSED_FIELD) is True


def early_chunks(kind: ApiKind, prefill: dict[str, Any], usage: StreamUsage,
                 num_prompt_tokens: int = 0) -> list[dict[str, Any]]:
    """Stream chunks carrying the prefill's first token (role chunk first for chat); none when
    the output is parsed (`decode_parses`). `num_prompt_tokens` (the prefill's usage) is
    reported on each chunk when `usage.continuous`."""
    if decode_parses(prefill):
        return []
    base = {"id": prefill.get("id"), "object": kind.chunk_object,
            "created": prefill.get("created"), "model": prefill.get("model")}
    if "system_fingerprint" in prefill:  # the same engine fingerprint the decode's chunks carry
        base["system_fingerprint"] = prefill["system_fingerprint"]
    if usage.include_usage:
        base["usage"] = None
    chunks: list[dict[str, Any]] = []
    num_completion_tokens = 0
    for choice in prefill.get("choices") or []:
        out: dict[str, Any] = {"index": choice.get("index", 0), "logprobs": choice.get("logprobs"),
                               "finish_reason": None}
        if "token_ids" in choice:
            out["token_ids"] = choice["token_ids"]
        if kind is ApiKind.CHAT:
            role = {**base, "choices": [{"index": out["index"], "logprobs": None,
                                         "finish_reason": None,
                                         "delta": {"role": "assistant", "content": ""}}]}
            if usage.continuous:
                role["usage"] = TokenCounts(num_prompt_tokens, num_completion_tokens).usage()
            chunks.append(role)
            out["delta"] = {"content": _choice_text(kind, choice)}
        else:
            out["text"] = _choice_text(kind, choice)
        chunk = {**base, "choices": [out]}
        num_completion_tokens += _count_tokens(choice)
        if usage.continuous:
            chunk["usage"] = TokenCounts(num_prompt_tokens, num_completion_tokens).usage()
        chunks.append(chunk)
    if chunks and "prompt_token_ids" in prefill:
        chunks[0]["prompt_token_ids"] = prefill["prompt_token_ids"]
    return chunks


@dataclass
class _Skip:
    chars: int  # characters of the first token's text still to cut
    logprobs: int  # logprob entries still to cut
    token_ids: int  # token ids still to cut
    role: bool  # the decode's role delta (chat) is still to drop


def _count_tokens(choice: dict[str, Any]) -> int:
    ids = choice.get("token_ids")
    return len(ids) if isinstance(ids, list) and ids else 1


class FirstTokenSkipper:
    """Per-choice cutting state; `apply(chunk)` returns the trimmed chunk or None to drop it."""

    def __init__(self, kind: ApiKind, prefill: dict[str, Any]) -> None:
        self.kind = kind
        self._skip: dict[int, _Skip] = {}
        # Nothing went out early (early_chunks): nothing to cut.
        early = [] if decode_parses(prefill) else prefill.get("choices") or []
        for choice in early:
            n = _count_tokens(choice)
            self._skip[choice.get("index", 0)] = _Skip(
                chars=len(_choice_text(kind, choice)),
                logprobs=n if choice.get("logprobs") else 0,
                token_ids=n if "token_ids" in choice else 0, role=kind is ApiKind.CHAT)
        self._prompt_ids = "prompt_token_ids" in prefill and not decode_parses(prefill)

    @property
    def done(self) -> bool:
        return not self._prompt_ids and not self._skip

    def apply(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        if self._prompt_ids and chunk.pop("prompt_token_ids", None) is not None:
            self._prompt_ids = False
        choices = chunk.get("choices")
        if not choices:
            return chunk
        kept = [c for c in choices if self._trim(c)]
        if not kept and "prompt_token_ids" not in chunk:  # (continuous usage: sent early)
            return None
        chunk["choices"] = kept
        return chunk

    def _trim(self, choice: dict[str, Any]) -> bool:
        """Cut what is left of the first token from one choice; False if nothing remains."""
        skip = self._skip.get(choice.get("index", 0))
        if skip is None:
            return True
        holder, key = (choice, "text") if self.kind is ApiKind.COMPLETIONS else (
            choice.setdefault("delta", {}), "content")
        if self.kind is ApiKind.CHAT and skip.role:
            holder.pop("role", None)
            skip.role = False
        text = holder.get(key)
        if isinstance(text, str) and skip.chars:
            cut = min(len(text), skip.chars)
            holder[key] = text[cut:]
            skip.chars -= cut
        skip.logprobs -= _cut_logprobs(choice, skip.logprobs)
        skip.token_ids -= _cut_list(choice, "token_ids", skip.token_ids)
        if not (skip.chars or skip.logprobs or skip.token_ids or skip.role):
            del self._skip[choice.get("index", 0)]
        return _has_payload(self.kind, choice)


def _cut_list(holder: dict[str, Any], key: str, n: int) -> int:
    values = holder.get(key)
    if not n or not isinstance(values, list):
        return 0
    cut = min(n, len(values))
    holder[key] = values[cut:]
    return cut


def _cut_logprobs(choice: dict[str, Any], n: int) -> int:
    lp = choice.get("logprobs")
    if not n or not isinstance(lp, dict):
        return 0
    if "content" in lp:  # chat: a list of per-token entries
        return _cut_list(lp, "content", n)
    cut = 0  # completions: parallel lists
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        cut = max(cut, _cut_list(lp, key, n))
    return cut


def _has_payload(kind: ApiKind, choice: dict[str, Any]) -> bool:
    if choice.get("finish_reason") is not None or choice.get("token_ids"):
        return True
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and any(v for v in lp.values()):
        return True
    if kind is ApiKind.COMPLETIONS:
        return bool(choice.get("text"))
    delta = choice.get("delta") or {}
    return any(v not in (None, "", []) for v in delta.values())
