"""The P/D legs of one worker: exporting a finished prompt's KV, and taking it over.

Prefill leg: the engine runs the request with `KVRequestOptions.hold()` (max_tokens 1), so its
blocks outlive it; `export_kv` then leases them (pull: the response carries the
kv_transfer_params) or pushes them into the decode registered under the transfer id (push). Decode leg: the engine
request is added with `KVRequestOptions.await_remote()` (it waits, abortable, never scheduled),
`load` pulls or receives the KV into freshly allocated blocks and hands them to the waiting
request through the engine's KV connector (`adopt`), which then emits the prefill's first
token and continues. The engine is reached only through `engine.kv_connector`.

Ownership of blocks is settled at one point per path, so nothing leaks on any failure:
- prefill: held blocks belong to the engine's held table until `offer`/`send` starts, which
  release them on their own failures; before that, `LegState.abandon` releases them.
- decode: received blocks belong to us until the connector's `adopt` runs on the engine
  thread, which either gives them to the request or frees them, atomically.
- remote side: until the transfer starts, `abandon` tells the peer to let go (a lease release,
  a push abort); once it started, `fetch`/`receive`/`send` do it on every path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.common.errors import (
    ApiError,
    BadGatewayError,
    BadRequestError,
    ConflictError,
    GatewayTimeoutError,
    InternalServerError,
)
from services.worker.config import KVLoadFailurePolicy, WorkerConfig
from services.worker.engine_client import EngineClient
from services.worker.kv_params import (
    DecodeLeg,
    Leg,
    PullDecodeLeg,
    parse_kv_transfer_params,
)
from services.worker.logprobs import safe_logprob
from shared.engine.kv_connector import AdoptOutcome, KVRequestOptions
from shared.engine.outputs import TokenLogprob
from shared.engine.request import PrefilledKV
from shared.protocol.messages import TokenLogprobWire, prompt_digest
from shared.protocol.pd import PARAM, PrefillLegParams, PushOverlap, PushPrefillResult, Role

if TYPE_CHECKING:  # torch-heavy; a mixed worker never loads them
    from services.kv_transfer.context import PulledKV
    from services.kv_transfer.push_prefill_stream import PushStream
    from services.worker.kv_link import KVLink

log = logging.getLogger(__name__)


@dataclass
class LegState:
    """One request's leg and how far it got. `transferring` flips when the KV service takes
    over the remote side (and, on a prefill, the held blocks); `request_id` is the engine
    request once created."""

    leg: Leg
    request_id: str | None = None
    transferring: bool = False
    stream: PushStream | None = None  # push prefill: opened at arrival, blocks stream out

    @property
    def is_prefill(self) -> bool:
        return isinstance(self.leg, PrefillLegParams)


@dataclass(frozen=True)
class KVLoad:
    """How the decode got its prompt KV (reported in the x-pdmesh-phases header)."""

    seconds: float
    num_bytes: int
    recomputed: bool

    def phases(self) -> dict[str, Any]:
        return {"kv_transfer_ms": round(self.seconds * 1000.0, 3), "kv_bytes": self.num_bytes,
                "kv_recomputed": self.recomputed}


def wire_logprob(entry: TokenLogprob | None, token_id: int) -> TokenLogprobWire:
    """The prefill's first token (and its logprobs, if asked for) as it travels; JSON has no
    infinities, so they travel as the floor the responses use too."""
    if entry is None:
        return TokenLogprobWire(token_id)
    top = sorted(entry.top.items(), key=lambda kv: kv[1], reverse=True)
    return TokenLogprobWire(token_id, safe_logprob(entry.logprob), [t for t, _ in top],
                            [safe_logprob(lp) for _, lp in top])


def engine_logprob(wire: TokenLogprobWire) -> TokenLogprob | None:
    """The first token's logprobs for the engine (None: the prefill sent none)."""
    if wire.logprob is None:
        return None
    return TokenLogprob(wire.token_id, wire.logprob, dict(zip(wire.top_ids, wire.top_logprobs,
                                                              strict=True)))


class PDLegs:
    """The P/D operations of one prefill or decode worker, over its engine and KV service.

    Stateless between requests (per-request progress lives in `LegState`); the serving flow
    calls `check`, `arrive`/`leave`, then `export_kv` (prefill) or `load` (decode), and
    `abandon` on any failure.
    """

    def __init__(self, engine: EngineClient, link: KVLink, config: WorkerConfig) -> None:
        self.engine = engine
        self.kv = engine.kv_connector
        self.link = link
        self.service = link.service
        self.config = config
        assert config.kv is not None
        self.reclaim_s = config.kv.reclaim_deadline_s
        self.vocab_size = int(engine.model_config.vocab_size)

    # ---- every leg ---------------------------------------------------------------------
    @staticmethod
    def _role_for(leg: Leg) -> Role:
        return Role.PREFILL if isinstance(leg, PrefillLegParams) else Role.DECODE

    def serves(self, leg: Leg) -> bool:
        return self._role_for(leg) is self.config.role and leg.mode == self.service.transfer.mode

    def check(self, leg: Leg, num_choices: int, stream: bool) -> None:
        """Refuse a leg this worker cannot serve, before any work (400 / 409)."""
        role, wanted = self.config.role, self._role_for(leg)
        if role is not wanted:
            raise BadRequestError(f"this is a {role.value} worker; it cannot serve a "
                                  f"{wanted.value} leg", param=PARAM, code="kv_wrong_role")
        if leg.mode != self.service.transfer.mode:
            raise ConflictError(f"kv_transfer_params ask for transfer_mode {leg.mode.value!r}, this "
                                f"worker runs transfer_mode {self.service.transfer.mode!r}",
                                param=f"{PARAM}.transfer_mode", code="kv_transfer_mode_mismatch")
        if num_choices != 1:
            raise BadRequestError("a P/D leg serves exactly one prompt with n=1",
                                  param="n", code="kv_one_choice")
        if stream and isinstance(leg, PrefillLegParams):
            raise BadRequestError("a prefill leg answers with one JSON body; set stream to false",
                                  param="stream")

    def engine_options(self, state: LegState, num_tokens: int) -> KVRequestOptions:
        """The engine request's P/D options. A push prefill opens its stream here, before
        the prompt runs, so full blocks go out while chunked prefill computes the rest
        (engines without per-step KV progress, e.g. pipeline-parallel, push at the end)."""
        leg = state.leg
        if not isinstance(leg, PrefillLegParams):
            return KVRequestOptions.await_remote()
        if leg.transfer_id is None or not self.kv.streams_kv_progress:
            return KVRequestOptions.hold()
        state.stream = self.service.push.prefill.open(leg.transfer_id, num_tokens, leg.decode_engine_id)
        return KVRequestOptions.hold(on_progress=state.stream.feed)

    def arrive(self, state: LegState) -> None:
        """Pull decode: heartbeat the prefill's lease from arrival until the request ends."""
        if isinstance(state.leg, PullDecodeLeg):
            self.service.pull.decode.track(state.leg.params)

    def leave(self, state: LegState) -> None:
        if isinstance(state.leg, PullDecodeLeg):
            self.service.pull.decode.untrack(state.leg.params)

    def abandon(self, state: LegState, reason: str) -> None:
        """The request failed before its transfer started: free what it holds here and tell
        the peer at once (never raises; the peer's lease or deadline is the backstop)."""
        if state.transferring or not self.serves(state.leg):  # a refused leg holds nothing
            return
        state.transferring = True  # once only
        leg = state.leg
        if isinstance(leg, PrefillLegParams):
            if state.request_id is not None:  # after the engine's abort (FIFO commands)
                self.service.release_held_soon(state.request_id)
            if state.stream is not None:
                state.stream.abort(reason)  # it tells the decode (once registered)
            elif leg.transfer_id is not None:
                self.service.push.prefill.decline(leg.transfer_id, reason)
        elif isinstance(leg, PullDecodeLeg):
            self.service.pull.decode.decline(leg.params)
        else:
            self.service.push.decode.decline(leg.transfer_id, leg.prefill_address,
                                              leg.remote_engine_id, reason)

    # ---- prefill -----------------------------------------------------------------------
    def abort_offer(self, value: Any) -> bool:
        """A dispatcher whose client left after the prefill leg answered: end that lease now
        (instead of at its expiry). `value` is the kv_transfer_params this worker returned;
        True if a held lease was ended, False if it was already gone."""
        params = parse_kv_transfer_params(value)
        if not isinstance(params, PullDecodeLeg):
            raise BadRequestError("expected the kv_transfer_params a pull prefill returned",
                                  param=PARAM, code="kv_bad_params")
        node = self.service.identity.node
        if (self.config.role, params.mode) != (Role.PREFILL, self.service.transfer.mode) \
                or params.params.remote_engine_id != node.engine_id:
            raise BadRequestError("these kv_transfer_params were not issued by this worker",
                                  param=f"{PARAM}.remote_engine_id", code="kv_not_issued_here")
        return self.service.pull.prefill.abort(params.params.remote_request_id, params.params.lease_id)

    async def export_kv(self, state: LegState, prompt: list[int],
                       first: TokenLogprobWire) -> dict[str, Any]:
        """Lease (pull) or push (push) the finished request's held blocks; the JSON object
        that goes out as the response's `kv_transfer_params`."""
        leg, request_id = state.leg, state.request_id
        assert isinstance(leg, PrefillLegParams) and request_id is not None
        ids = await self.kv.held_block_ids(request_id)
        if ids is None:
            raise InternalServerError("the engine kept no KV blocks for the prefilled request",
                                      code="kv_not_held")
        state.transferring = True  # offer/send release the held blocks on every path
        if leg.transfer_id is None:
            params = await self.service.pull.prefill.offer(request_id, ids, len(prompt), first,
                                                   prompt_digest(prompt))
            return params.to_wire()
        num_bytes = await self.service.push.prefill.send(leg.transfer_id, request_id, ids, len(prompt),
                                                 first, leg.decode_engine_id, state.stream)
        node = self.service.identity.node
        return PushPrefillResult(leg.transfer_id, node.engine_id, node.kv_host, node.kv_port,
                                 len(prompt), num_bytes, first,
                                 self._overlap(state, len(ids))).to_wire()

    @staticmethod
    def _overlap(state: LegState, num_blocks: int) -> PushOverlap:
        """How much of the push was hidden behind compute (blocks written before the
        prompt finished) and what stayed exposed after it."""
        stats = state.stream.stats if state.stream is not None else None
        if stats is None:
            return PushOverlap(num_blocks)
        return PushOverlap(num_blocks, stats.early_blocks, round(stats.finish_seconds * 1000, 3))

    # ---- decode ------------------------------------------------------------------------
    async def load(self, state: LegState, prompt: list[int], wants_logprobs: bool) -> KVLoad:
        """Bring the prompt's KV into the waiting engine request (or, by policy, let it
        recompute). Raises an ApiError for the client when the KV cannot be had."""
        leg, request_id, start = state.leg, state.request_id, time.perf_counter()
        assert not isinstance(leg, PrefillLegParams) and request_id is not None
        try:
            self._precheck(leg, prompt)
            state.transferring = True
            kv = await self._transfer(leg, len(prompt))
        except ApiError as exc:
            self.abandon(state, exc.message)
            if exc.status in (401, 403):  # the mesh's credentials, not the client's
                exc = BadGatewayError(f"KV peer refused this worker: {exc.message}", code=exc.code)
            return await self._fail(request_id, exc, start)
        problem = self._first_token_problem(kv.first_token, wants_logprobs)
        if problem is not None:  # a token the model has no row for would kill the engine
            await self.link.store.free(kv.block_ids)
            return await self._fail(request_id, BadGatewayError(
                f"unusable first token from the prefill: {problem}", code="kv_bad_first_token"),
                start)
        prefilled = PrefilledKV(tuple(kv.block_ids), kv.num_tokens, kv.first_token.token_id,
                                engine_logprob(kv.first_token))
        # Submitted before any suspension: the engine settles the blocks' owner even if we
        # are cancelled while waiting for the answer.
        adopted = await self.kv.adopt(request_id, prefilled)
        if adopted.outcome is AdoptOutcome.REFUSED:
            raise InternalServerError(f"the engine refused the received KV: {adopted.message}",
                                      code="kv_adopt_failed")
        return KVLoad(time.perf_counter() - start, kv.num_bytes, recomputed=False)

    def _first_token_problem(self, first: TokenLogprobWire, wants_logprobs: bool) -> str | None:
        if not 0 <= first.token_id < self.vocab_size:
            return f"token id {first.token_id} outside the vocabulary [0, {self.vocab_size})"
        if len(first.top_ids) != len(first.top_logprobs):
            return "top_ids and top_logprobs differ in length"
        if wants_logprobs and first.logprob is None:
            return "no logprobs, and the request asks for them"
        return None

    def _precheck(self, leg: DecodeLeg, prompt: list[int]) -> None:
        if not isinstance(leg, PullDecodeLeg):
            return
        params = leg.params
        if (problem := self._first_token_problem(params.first_token, False)) is not None:
            raise BadRequestError(f"kv_transfer_params.first_token: {problem}",
                                  param=f"{PARAM}.first_token", code="kv_bad_params")
        if params.num_tokens != len(prompt) or (
                params.prompt_digest and params.prompt_digest != prompt_digest(prompt)):
            raise BadRequestError(
                f"kv_transfer_params describe another prompt ({params.num_tokens} tokens) than "
                f"this request's ({len(prompt)} tokens)", param=PARAM, code="kv_prompt_mismatch")

    async def _transfer(self, leg: DecodeLeg, num_tokens: int) -> PulledKV:
        """Pull or receive, bounded by the reclaim deadline. No task is spawned around the
        call (asyncio.timeout, not wait_for), so a finished transfer's blocks can't be lost."""
        try:
            async with asyncio.timeout(self.reclaim_s):
                if isinstance(leg, PullDecodeLeg):
                    return await self.service.pull.decode.fetch(leg.params)
                return await self.service.push.decode.receive(leg.transfer_id, leg.prefill_address,
                                                       num_tokens, leg.remote_engine_id)
        except TimeoutError:
            raise GatewayTimeoutError(f"remote KV did not arrive within {self.reclaim_s:.0f}s",
                                      code="kv_reclaim_deadline") from None

    async def _fail(self, request_id: str, exc: ApiError, start: float) -> KVLoad:
        if self.config.kv_load_failure_policy is not KVLoadFailurePolicy.RECOMPUTE:
            await self.kv.fail_remote_load(request_id)
            raise exc
        log.warning("remote KV for %s failed (%s); recomputing the prompt locally",
                    request_id, exc.message)
        await self.kv.compute_locally(request_id)
        return KVLoad(time.perf_counter() - start, 0, recomputed=True)
