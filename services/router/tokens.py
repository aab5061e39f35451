"""Prompt token ids for routing decisions (prefix-aware policy, conditional disaggregation).

Only asked when a decision needs them. Token-id prompts are used as they are; text prompts and
chat messages go through the router's own tokenizer (`shared.model.tokenizer`, loaded once from
the model directory a worker reports) or, failing that, a worker's `/tokenize`. Routing only
needs an approximation: any failure yields None and the request is routed without token ids.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from services.router.config import TokenizerSource
from services.router.legs import prompt_token_ids
from services.router.registry import WorkerRegistry
from services.router.upstream import Upstream, UpstreamFailure
from shared.protocol.pd import ApiKind

log = logging.getLogger(__name__)


def _load_local(source: str) -> Any:
    from shared.model.registry import resolve_model
    from shared.model.tokenizer import Tokenizer

    return Tokenizer(resolve_model(source, progress=False))


class PromptTokenizer:
    """Token ids of a request's prompt, by the cheapest available route."""

    def __init__(self, source: TokenizerSource, registry: WorkerRegistry,
                 upstream: Upstream) -> None:
        self._source = source
        self._registry = registry
        self._upstream = upstream
        self._local: Any = None
        self._loading: asyncio.Task[None] | None = None
        self._local_failed = source is TokenizerSource.WORKER

    async def token_ids(self, kind: ApiKind, body: dict[str, Any],
                        request_id: str) -> list[int] | None:
        if kind is ApiKind.COMPLETIONS:
            ids = prompt_token_ids(body)
            if ids is not None or not isinstance(body.get("prompt"), str):
                return ids
        local = await self._local_tokenizer()
        if local is not None:
            try:
                return _encode_local(local, kind, body)
            except Exception as exc:  # a template error here is the worker's to report
                log.debug("local tokenisation failed: %s", exc)
                return None
        return await self._via_worker(kind, body, request_id)

    @property
    def local_loaded(self) -> bool:
        return self._local is not None

    def warm(self) -> None:
        """Start loading the local tokenizer in the background once a worker has said which
        model it serves; until it is loaded, requests use a worker's /tokenize."""
        if self._local is not None or self._loading is not None or self._local_failed:
            return
        source = next((w.metadata.model_source for w in self._registry.usable()
                       if w.metadata and w.metadata.model_source), None)
        if source is not None:
            self._loading = asyncio.create_task(self._load(source))

    async def _load(self, source: str) -> None:
        try:
            self._local = await asyncio.to_thread(_load_local, source)
            log.info("router tokenizer loaded for %s", source)
        except Exception as exc:
            self._local_failed = True
            log.warning("router tokenizer unavailable (%s); using the workers' /tokenize", exc)

    async def _local_tokenizer(self) -> Any:
        self.warm()
        if self._local is None and self._loading is not None and (
                self._source is TokenizerSource.LOCAL):
            await asyncio.shield(self._loading)  # local only: wait for it
        return self._local

    async def close(self) -> None:
        if self._loading is not None:
            self._loading.cancel()
            await asyncio.gather(self._loading, return_exceptions=True)

    async def _via_worker(self, kind: ApiKind, body: dict[str, Any],
                          request_id: str) -> list[int] | None:
        workers = self._registry.usable()
        if not workers:
            return None
        worker = min(workers, key=lambda w: w.inflight)
        query: dict[str, Any] = {"model": body.get("model")}
        if kind is ApiKind.CHAT:
            query["messages"] = body.get("messages")
        else:
            query["prompt"] = body.get("prompt")
        try:
            doc, _ = await self._upstream.post_json(worker.id, worker.url + "/tokenize", query,
                                                    request_id)
        except UpstreamFailure as exc:
            log.debug("tokenize via %s failed: %s", worker.id, exc)
            return None
        tokens = doc.get("tokens")
        return tokens if isinstance(tokens, list) else None


def _encode_local(tok: Any, kind: ApiKind, body: dict[str, Any]) -> list[int]:
    if kind is ApiKind.CHAT:
        # The worker's rendering options (a malformed one raises here, and the worker's 400
        # names it).
        kwargs = body.get("chat_template_kwargs")
        text = tok.apply_chat_template(
            body.get("messages") or [],
            add_generation_prompt=body.get("add_generation_prompt") is not False,
            continue_final_message=body.get("continue_final_message") is True,
            **(kwargs if isinstance(kwargs, dict) else {}))
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(body["prompt"], add_special_tokens=True)
