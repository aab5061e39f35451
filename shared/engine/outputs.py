"""What the engine hands back: incremental per-request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # aborted by the caller (client disconnect, shutdown)
    ERROR = "error"  # the engine failed this request


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of one generated token plus the top-N alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic()) of a request's life; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """One incremental update for one request.

    `new_token_ids` / `new_text` / `new_logprobs` are what was produced since the previous
    update (text never retracts: held-back bytes of a partial UTF-8 character or a possible
    stop string are released later). `token_ids` and `text` are cumulative.
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
