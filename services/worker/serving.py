"""Serving one generation request: model check, prompts, admission, engine run, response.

`GenerationService` turns a parsed `CompletionRequest` / `ChatRequest` into engine choices
(`generation.py`), feeds their outputs to metrics and to the response builder, and answers
either one JSON body or an SSE stream. A client that disconnects cancels the handler (the
runner enables aiohttp's handler cancellation), which closes the merged engine stream and
aborts every unfinished choice.

On a prefill or decode worker a request may be a P/D leg (`kv_transfer_params`, see
`kv_params.py`): the prefill leg runs one token with its KV held and answers the usual body
plus top-level `kv_transfer_params`; the decode leg loads the KV (before any response byte,
so a failure is a plain HTTP error) and answers the whole completion, starting with the
prefill's first token. `PDLegs` (pd_legs.py) does the KV side of both.

A chat request's output may be parsed (tool calls, reasoning: `chat_output.py`); the decode
leg parses it like a mixed worker, and a prefill leg says so in its answer
(`OUTPUT_PARSED_FIELD`), so that the router sends none of the raw first token ahead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from aiohttp import web

from services.common.errors import BadRequestError, InternalServerError, NotFoundError
from services.common.json_body import dumps, json_response
from services.common.middleware import REQUEST_ID_KEY
from services.worker.admission import AdmissionControl
from services.worker.chat_format import load_chat_format
from services.worker.chat_output import ChatOutputPlan, plan_chat_output
from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineClient
from services.worker.generation import (
    ChoiceJob,
    ChoiceState,
    EngineRequestError,
    PreparedPrompt,
    running_choices,
)
from services.worker.generation_defaults import model_defaults
from services.worker.kv_params import parse_kv_transfer_params
from services.worker.leg_auth import require_trusted_leg
from services.worker.logprobs import LogprobFormatter
from services.worker.metrics import ChoiceTimer, WorkerMetrics
from services.worker.openai_protocol import (
    ChatRequest,
    CommonFields,
    CompletionRequest,
    SamplingFields,
)
from services.worker.pd_legs import LegState, PDLegs, wire_logprob
from services.worker.prompts import PromptBuilder
from services.worker.responses import ResponseBuilder, ResponseSpec
from services.worker.streaming import SseWriter
from shared.engine.kv_connector import KVRequestOptions
from shared.engine.outputs import RequestOutput
from shared.engine.sampling_params import SamplingParams
from shared.engine.structured_spec import InvalidStructuredOutput, StructuredOutputSpec
from shared.protocol.pd import (
    OUTPUT_PARSED_FIELD,
    PHASES_HEADER,
    RESUME_FIELD,
    ApiKind,
    PrefillLegParams,
)

log = logging.getLogger(__name__)

Events = AsyncIterator[tuple[ChoiceJob, RequestOutput]]


class GenerationService:
    """The completions and chat endpoints' logic, bound to one loaded engine."""

    def __init__(self, engine: EngineClient, config: WorkerConfig, metrics: WorkerMetrics,
                 admission: AdmissionControl, pd_legs: PDLegs | None = None) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.admission = admission
        self.pd_legs = pd_legs  # None on a mixed worker, which ignores kv_transfer_params
        self.chat_format = load_chat_format(config.parsers, engine.model_config,
                                            engine.model_dir, config.engine.resolved_cache_dir,
                                            engine.tokenizer)
        self.prompts = PromptBuilder(engine, self.chat_format.harmony)
        self.formatter = LogprobFormatter(engine.tokenizer)
        self.system_fingerprint = f"pdmesh-{engine.fingerprint[:16]}"
        self.sampling_defaults = model_defaults(config.generation_config, engine.model_dir)

    def resolve_model(self, name: str | None) -> str:
        """The name to report; 404 (param "model", code "model_not_found") if unknown."""
        names = self.config.model_names
        if name is None:
            return names[0]
        if name not in names:
            raise NotFoundError(f"The model '{name}' does not exist. Available: {', '.join(names)}",
                                param="model", code="model_not_found")
        return name

    @contextlib.contextmanager
    def leg(self, body: dict[str, Any], *, trusted: bool) -> Iterator[LegState | None]:
        """The request's P/D leg, if any, for the duration of its handling.

        Whatever fails before the KV transfer started (a bad field, an unknown model, 429...)
        frees the leg's resources on both sides at once: a decode that refuses a request
        still releases the prefill's lease. A prefill leg from a caller that is not `trusted`
        (services.worker.leg_auth) is refused before anything is held.
        """
        if self.pd_legs is None:
            yield None
            return
        leg = parse_kv_transfer_params(body.get("kv_transfer_params"))
        if leg is None:
            yield None
            return
        if isinstance(leg, PrefillLegParams):
            assert self.config.kv is not None, "a worker with P/D legs has a KV service"
            require_trusted_leg(self.config.kv.secret is not None, trusted)
        state = LegState(leg)
        self.pd_legs.arrive(state)
        try:
            yield state
        except BaseException as exc:
            self.pd_legs.abandon(state, str(exc) or type(exc).__name__)
            raise
        finally:
            self.pd_legs.leave(state)

    @staticmethod
    def _leg_sampling(leg: LegState | None, sampling: SamplingFields,
                      max_tokens: int | None) -> tuple[SamplingFields, int | None]:
        """A prefill leg samples exactly the first token: max_tokens 1, and min_tokens only
        as far as it concerns that token (so EOS is banned there exactly as in one piece)."""
        if leg is None or not leg.is_prefill:
            return sampling, max_tokens
        return dataclasses.replace(sampling, min_tokens=min(sampling.min_tokens, 1)), 1

    def _resume(self, prompts: list[PreparedPrompt], sampling: SamplingFields,
                leg: LegState | None) -> list[PreparedPrompt]:
        """A migrated request (RESUME_FIELD) runs on its prompt plus the earlier output; the
        prompt's text stays the client's (echo, chat output plans)."""
        ids = sampling.resumed_token_ids
        if not ids:
            return prompts
        if leg is not None:
            raise BadRequestError(f"'{RESUME_FIELD}' cannot be combined with a P/D leg",
                                  param=RESUME_FIELD)
        self.prompts.check_token_ids(ids, RESUME_FIELD)
        return [dataclasses.replace(p, token_ids=[*p.token_ids, *ids]) for p in prompts]

    def _spec(self, kind: ApiKind, common: CommonFields, model: str,
              prompts: list[PreparedPrompt], logprobs: int | None, echo: bool) -> ResponseSpec:
        prefix = "chatcmpl" if kind is ApiKind.CHAT else "cmpl"
        return ResponseSpec(kind=kind, response_id=f"{prefix}-{uuid.uuid4().hex}",
                            created=int(time.time()), model=model,
                            system_fingerprint=self.system_fingerprint, prompts=prompts,
                            logprobs=logprobs, echo=echo, return_token_ids=common.return_token_ids,
                            stream_usage=common.stream_usage)

    @staticmethod
    def _jobs(spec: ResponseSpec, params: list[SamplingParams], n: int) -> list[ChoiceJob]:
        """`n` choices per prompt; choice index = prompt index * n + i (as vLLM)."""
        return [ChoiceJob(index=p * n + i, prompt_index=p,
                          engine_request_id=f"{spec.response_id}-{p * n + i}",
                          params=params[p].for_choice(i))
                for p in range(len(params)) for i in range(n)]

    async def completion(self, request: web.Request, req: CompletionRequest,
                         leg: LegState | None = None) -> web.StreamResponse:
        arrival = time.monotonic()
        model = self.resolve_model(req.common.model)
        prompts = [self.prompts.completion_prompt(p, need_text=req.echo) for p in req.prompts]
        prompts = self._resume(prompts, req.common.sampling, leg)
        sampling, wanted = self._leg_sampling(leg, req.common.sampling, req.max_tokens)
        params = []
        for prompt in prompts:
            max_tokens = self.prompts.max_tokens_for(len(prompt.token_ids), wanted,
                                                     "prompt", "max_tokens")
            params.append(self.prompts.sampling_params(sampling, max_tokens, req.logprobs, {}))
        spec = self._spec(ApiKind.COMPLETIONS, req.common, model, prompts, req.logprobs, req.echo)
        jobs = self._jobs(spec, params, req.common.sampling.n)
        return await self._execute(request, spec, jobs, req.common.stream, arrival, leg)

    async def chat(self, request: web.Request, req: ChatRequest,
                   leg: LegState | None = None) -> web.StreamResponse:
        arrival = time.monotonic()
        model = self.resolve_model(req.common.model)
        prompt = self._resume([self.prompts.chat_prompt(req)], req.common.sampling, leg)[0]
        plan = plan_chat_output(self.chat_format.parsers, req.tools, prompt.text)
        sampling = plan.sampling(self.chat_format.sampling(req.common.sampling),
                                 self.engine.tokenizer)
        sampling, wanted = self._leg_sampling(leg, sampling, req.max_tokens)
        max_tokens = self.prompts.max_tokens_for(len(prompt.token_ids), wanted,
                                                 "messages", req.max_tokens_param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        renames = {"logprobs": "top_logprobs", "max_tokens": req.max_tokens_param}
        params = self.prompts.sampling_params(sampling, max_tokens, logprobs, renames)
        spec = self._spec(ApiKind.CHAT, req.common, model, [prompt], logprobs, echo=False)
        jobs = self._jobs(spec, [params], req.common.sampling.n)
        return await self._execute(request, spec, jobs, req.common.stream, arrival, leg, plan)

    async def _execute(self, request: web.Request, spec: ResponseSpec, jobs: list[ChoiceJob],
                       stream: bool, arrival: float, leg: LegState | None,
                       chat: ChatOutputPlan | None = None) -> web.StreamResponse:
        await self._compile_grammar(jobs[0].params.structured)
        kv: KVRequestOptions | None = None
        if leg is not None:
            assert self.pd_legs is not None
            self.pd_legs.check(leg.leg, len(jobs), stream)
            leg.request_id = jobs[0].engine_request_id
            kv = self.pd_legs.engine_options(leg, len(spec.prompts[0].token_ids))
        with self.admission.admit(len(jobs)):
            states = {job.index: ChoiceState(job) for job in jobs}
            timers = {job.index: ChoiceTimer(self.metrics, arrival,
                                             len(spec.prompts[job.prompt_index].token_ids))
                      for job in jobs}
            builder = ResponseBuilder(spec, self.formatter, chat)
            headers: dict[str, str] = {}
            try:
                async with running_choices(self.engine, jobs, spec.prompts, kv) as events:
                    if leg is not None and not leg.is_prefill:
                        assert self.pd_legs is not None
                        load = await self.pd_legs.load(leg, spec.prompts[0].token_ids,
                                                       jobs[0].params.logprobs is not None)
                        headers[PHASES_HEADER] = dumps(load.phases())
                    if stream:
                        return await self._stream(request, builder, events, states, timers, headers)
                    await self._collect(request, builder, events, states, timers)
                body = builder.full_body(list(states.values()))
                if leg is not None and leg.is_prefill:
                    await self._export_kv(leg, spec, states[0], body)
                    if builder.chat is not None:
                        body[OUTPUT_PARSED_FIELD] = True
                return json_response(body, headers=headers)
            finally:
                for timer in timers.values():
                    timer.abandoned()

    async def _compile_grammar(self, structured: StructuredOutputSpec | None) -> None:
        """A structured-output grammar is compiled (off the loop, bounded in time) before
        anything is admitted or streamed: one that cannot be is a plain 400."""
        if structured is None:
            return
        try:
            await self.engine.compile_grammar(structured)
        except InvalidStructuredOutput as exc:
            raise BadRequestError(str(exc), param=exc.param) from None

    async def _export_kv(self, leg: LegState, spec: ResponseSpec, state: ChoiceState,
                        body: dict[str, Any]) -> None:
        """Prefill leg: hand the held KV off; `body` gains `kv_transfer_params` and the
        prefix-cache hits the router reports as cached tokens."""
        assert self.pd_legs is not None
        if not state.token_ids:
            raise InternalServerError("the prefill produced no first token", code="kv_no_token")
        first = wire_logprob(state.logprobs[0] if state.logprobs else None, state.token_ids[0])
        body["kv_transfer_params"] = await self.pd_legs.export_kv(leg, spec.prompts[0].token_ids,
                                                                 first)
        body["usage"]["prompt_tokens_details"] = {"cached_tokens": state.num_cached_tokens}

    async def _collect(self, request: web.Request, builder: ResponseBuilder, events: Events,
                       states: dict[int, ChoiceState], timers: dict[int, ChoiceTimer]) -> None:
        try:
            async for job, out in events:
                states[job.index].update(out)
                builder.observe(states[job.index], out)
                timers[job.index].on_output(out)
        except EngineRequestError as exc:
            rid = request.get(REQUEST_ID_KEY)
            log.error("request %s: generation failed: %s", rid, exc)
            raise exc.for_request(rid) from None

    async def _stream(self, request: web.Request, builder: ResponseBuilder, events: Events,
                      states: dict[int, ChoiceState], timers: dict[int, ChoiceTimer],
                      headers: dict[str, str]) -> web.StreamResponse:
        writer = SseWriter(request, headers)
        try:
            # Headers go out now (as vLLM): clients see the request accepted before the first
            # token; failures from here on are SSE error events.
            await writer.start()
            async for job, out in events:
                state = states[job.index]
                state.update(out)
                timers[job.index].on_output(out)
                await writer.send(builder.chunks_for(state, out))
            if builder.spec.stream_usage.include_usage:
                await writer.send([builder.usage_chunk(list(states.values()))])
            await writer.done()
        except EngineRequestError as exc:
            rid = request.get(REQUEST_ID_KEY)
            log.error("request %s: generation failed mid-stream: %s", rid, exc)
            if not writer.started:
                raise exc.for_request(rid) from None
            with contextlib.suppress(ConnectionError):
                await writer.send_error(exc.for_request(rid))
                await writer.done()
        except ConnectionError:
            log.info("client went away during %s", builder.spec.response_id)
        return writer.response
