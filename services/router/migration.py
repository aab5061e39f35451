"""Request migration: a streamed request whose decode fails mid-stream continues on another.

When the decode leg of a streamed request breaks after the client got bytes (the connection
reset or closed without [DONE], an in-stream error event from a worker whose engine failed, or
a stall: see `MigrationConfig`), the router re-dispatches the request whole to another healthy
decode of the same compatibility group, with the output token ids the client already got as
`RESUME_FIELD`. That worker appends them to the prompt, re-prefills it locally, and continues:
its detokenizer and stop strings start from those ids (SamplingParams.resumed_token_ids), so the
text it streams is exactly what follows the text already sent, with no gap and no duplicate.
`max_tokens` and `min_tokens` shrink by what was produced; seeded sampling continues
identically (a seeded draw depends on the token's position, which is unchanged). The client's
stream keeps its completion id, and its usage counts the original prompt and every generated
token. At most `max_migrations` per request; past that, or with no other decode, the client gets
the error event and [DONE], as without migration.

Migratable: streamed, one prompt, n=1, no structured output or offered tools (the grammar's
state is not carried), no presence/frequency penalty (they count output tokens, which become
prompt tokens), and output the workers do not parse (no tool-call / reasoning deltas seen).
Non-streamed requests need none of this: nothing reached the client, so a failed decode is a
plain retry (orchestrator.py). To follow the output, the router asks the legs for token ids
(`return_token_ids`) and removes them from the chunks when the client did not ask.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services.router.config import MigrationConfig
from services.router.metrics import RouterMetrics
from services.router.registry import WorkerRegistry
from services.router.upstream import UpstreamFailure
from services.router.workers import Worker
from shared.protocol.pd import PARAM, RESUME_FIELD, ApiKind

log = logging.getLogger(__name__)

# Fields whose output the workers constrain or parse: their state is not carried over.
_STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar")
_CHAT_DELTA = frozenset({"role", "content"})


def not_migratable(kind: ApiKind, body: dict[str, Any]) -> str | None:
    """Why this request cannot move to another decode mid-stream (None: it can)."""
    if not body.get("stream"):
        return "not streamed"
    n = body.get("n")
    if n not in (None, 1):
        return "n > 1"
    prompt = body.get("prompt")
    if kind is ApiKind.COMPLETIONS and isinstance(prompt, list) and prompt and all(
            isinstance(p, str | list) for p in prompt) and len(prompt) > 1:
        return "several prompts"
    fmt = body.get("response_format")
    if any(body.get(k) is not None for k in _STRUCTURED) and not (
            isinstance(fmt, dict) and fmt.get("type") == "text"):
        return "structured output"
    if body.get("tools") and body.get("tool_choice") != "none":
        return "tools"
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        return "presence/frequency penalty"
    return None


def failure_reason(failure: UpstreamFailure) -> str:
    """The `reason` label of pdmesh:router_migrations_total."""
    if failure.stalled:
        return "stall"
    return "disconnect" if failure.status is None else "error_event"


@dataclass
class StreamTracker:
    """What the client has been sent of one migratable stream, and the filter that keeps a
    continuation's chunks looking like the rest of the stream.

    Every chunk bound for the client passes `outgoing`: it records the choice's token ids,
    text length and finish, strips the token ids the client did not ask for, and, while a
    continuation runs, drops its repeated role / prompt ids, keeps the stream's id, shifts
    completions logprob offsets and corrects usage.
    """

    kind: ApiKind
    client_wants_ids: bool
    token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0
    finished: bool = False
    parsed: bool = False  # a tool-call / reasoning delta went out: not migratable
    migrations: int = 0
    compat_hash: str | None = None  # the group of the decode serving it
    stream_id: Any = None
    created: Any = None
    _resumed: int = 0  # ids in the running continuation's prompt
    _offset: int = 0  # text already sent when the continuation started

    def resume(self) -> list[int]:
        """Start a continuation: the ids to resume from."""
        self.migrations += 1
        self._resumed, self._offset = len(self.token_ids), self.text_chars
        return list(self.token_ids)

    def outgoing(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """The chunk as the client gets it, or None to drop it."""
        if self.stream_id is None:
            self.stream_id, self.created = chunk.get("id"), chunk.get("created")
        elif self.migrations:
            chunk["id"], chunk["created"] = self.stream_id, self.created
        if not self.client_wants_ids or self.migrations:
            chunk.pop("prompt_token_ids", None)
        if isinstance(chunk.get("usage"), dict) and self._resumed:
            _patch_usage(chunk["usage"], self._resumed)
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices:
            return chunk
        kept = [c for c in choices if isinstance(c, dict) and self._choice(c)]
        if not kept:  # its continuous usage, if any, is no news: the next chunk has it too
            return None
        chunk["choices"] = kept
        return chunk

    def _choice(self, choice: dict[str, Any]) -> bool:
        """Record one choice; False when a continuation's choice carries nothing new."""
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.token_ids.extend(t for t in ids if isinstance(t, int))
        if not self.client_wants_ids:
            choice.pop("token_ids", None)
        if self.migrations or not self.client_wants_ids:
            choice.pop("prompt_token_ids", None)
        delta: dict[str, Any] = {}
        if self.kind is ApiKind.COMPLETIONS:
            text = choice.get("text")
            if self.migrations:
                _shift_offsets(choice.get("logprobs"), self._offset)
        else:
            raw = choice.get("delta")
            delta = raw if isinstance(raw, dict) else {}
            if self.migrations:
                delta.pop("role", None)
            self.parsed = self.parsed or bool(set(delta) - _CHAT_DELTA)
            text = delta.get("content")
        if isinstance(text, str):
            self.text_chars += len(text)
        if choice.get("finish_reason") is not None:
            self.finished = True
        # A chunk only the token ids made (a held-back character) is not one the client
        # would have got without them; a continuation's repeated role chunk neither.
        return (self.client_wants_ids and not self.migrations) or _has_payload(choice, delta)


def _has_payload(choice: dict[str, Any], delta: dict[str, Any]) -> bool:
    return bool(choice.get("text") or choice.get("token_ids") or choice.get("logprobs")
                or choice.get("finish_reason") is not None
                or any(v not in (None, "", []) for v in delta.values()))


def _shift_offsets(logprobs: Any, offset: int) -> None:
    if isinstance(logprobs, dict) and isinstance(logprobs.get("text_offset"), list):
        logprobs["text_offset"] = [o + offset if isinstance(o, int) else o
                                   for o in logprobs["text_offset"]]


def _patch_usage(usage: dict[str, Any], resumed: int) -> None:
    """The continuation counted the resumed ids as prompt: they are completion tokens."""
    if isinstance(usage.get("prompt_tokens"), int):
        usage["prompt_tokens"] -= resumed
    if isinstance(usage.get("completion_tokens"), int):
        usage["completion_tokens"] += resumed


def continuation_body(kind: ApiKind, body: dict[str, Any],
                      ids: list[int]) -> dict[str, Any] | None:
    """The request a new decode continues from `ids` with; None if nothing is left to make."""
    out = {k: v for k, v in body.items() if k not in (PARAM, "echo")}
    out[RESUME_FIELD] = ids
    out["return_token_ids"] = True
    done = len(ids)
    keys = ("max_tokens",) if kind is ApiKind.COMPLETIONS else (
        "max_completion_tokens", "max_tokens")
    for key in keys:
        limit = out.get(key, 16 if kind is ApiKind.COMPLETIONS else None)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - done < 1:
                return None
            out[key] = limit - done
    for key in ("min_tokens", "min_completion_tokens"):
        if isinstance(out.get(key), int):
            out[key] = max(0, out[key] - done)
    return out


def pick_decode(candidates: list[Worker], avoid: set[str]) -> Worker | None:
    """The least loaded usable decode not yet tried (closed breakers first)."""
    pool = [w for w in candidates if w.id not in avoid and w.usable()]
    if not pool:
        return None
    return min(pool, key=lambda w: (not w.breaker.available(), w.inflight,
                                    w.metadata.running + w.metadata.waiting if w.metadata else 0))


LegRunner = Callable[[Worker, dict[str, Any]], Awaitable[web.StreamResponse]]


class Migrator:
    """Continues broken streams on other decodes of their group (see the module docstring)."""

    def __init__(self, config: MigrationConfig, registry: WorkerRegistry,
                 metrics: RouterMetrics) -> None:
        self._cfg = config
        self._registry = registry
        self._metrics = metrics

    def _candidates(self, compat_hash: str | None) -> list[Worker]:
        group = next((g for g in self._registry.groups() if g.compat_hash == compat_hash), None)
        return [] if group is None else [*group.usable_decode, *group.usable_mixed]

    def _refusal(self, tracker: StreamTracker, failure: UpstreamFailure) -> str | None:
        if not failure.retryable:
            return "the worker refused the request"
        if tracker.parsed:
            return "its output is parsed (tool calls, reasoning)"
        if tracker.finished:
            return "the stream had finished"
        if tracker.migrations >= self._cfg.max_migrations:
            return f"it was migrated {tracker.migrations} times (--max-migrations)"
        return None

    async def resume(self, kind: ApiKind, body: dict[str, Any], tracker: StreamTracker,
                     failure: UpstreamFailure, request_id: str,
                     run: LegRunner) -> web.StreamResponse:
        """Run continuations until one finishes; raise the last failure's ApiError when the
        stream cannot go on (the caller sends it as the error event)."""
        avoid = {failure.worker_id}
        while True:
            why = self._refusal(tracker, failure)
            worker = None if why else pick_decode(self._candidates(tracker.compat_hash), avoid)
            body_next = None if worker is None else continuation_body(
                kind, body, tracker.token_ids)
            if worker is None or body_next is None:
                why = why or ("no other healthy decode in its group" if worker is None
                              else "no tokens left to generate")
                log.warning("%s: %s failed mid-stream (%s); not migrated: %s", request_id,
                            failure.worker_id, failure.detail, why)
                raise failure.to_api_error() from None
            reason = failure_reason(failure)
            self._metrics.migrations.labels(reason).inc()
            log.warning("%s: %s failed mid-stream (%s, %s); continuing on %s after %d tokens",
                        request_id, failure.worker_id, reason, failure.detail, worker.id,
                        len(tracker.token_ids))
            tracker.resume()
            try:
                return await run(worker, body_next)
            except UpstreamFailure as again:
                self._metrics.upstream_failures.labels("decode", str(again.status)).inc()
                failure = again
                avoid.add(again.worker_id)
