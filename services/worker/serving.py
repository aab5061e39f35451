"""Serving one generation request: model check, prompts, admission, engine run, response.

`GenerationService` turns a parsed `CompletionRequest` / `ChatRequest` into engine choices
(`generation.py`), feeds their outputs to metrics and to the response builder, and answers
either one JSON body or an SSE stream. A client that disconnects cancels the handler (the
runner enables aiohttp's handler cancellation), which closes the merged engine stream and
aborts every unfinished choice.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

from aiohttp import web

from services.common.errors import NotFoundError
from services.common.json_body import json_response
from services.worker.admission import AdmissionControl
from services.worker.config import WorkerConfig
from services.worker.engine_client import EngineClient
from services.worker.generation import (
    ChoiceJob,
    ChoiceState,
    EndpointKind,
    EngineRequestError,
    PreparedPrompt,
    run_choices,
)
from services.worker.logprobs import LogprobFormatter
from services.worker.metrics import ChoiceTimer, WorkerMetrics
from services.worker.openai_protocol import ChatRequest, CommonFields, CompletionRequest
from services.worker.prompts import PromptBuilder
from services.worker.responses import ResponseBuilder, ResponseSpec
from services.worker.streaming import SseWriter
from shared.engine.outputs import RequestOutput
from shared.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

Events = AsyncIterator[tuple[ChoiceJob, RequestOutput]]


class GenerationService:
    """The completions and chat endpoints' logic, bound to one loaded engine."""

    def __init__(self, engine: EngineClient, config: WorkerConfig, metrics: WorkerMetrics,
                 admission: AdmissionControl) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.admission = admission
        self.prompts = PromptBuilder(engine)
        self.formatter = LogprobFormatter(engine.tokenizer)
        self.system_fingerprint = f"pdmesh-{engine.fingerprint[:16]}"

    def resolve_model(self, name: str | None) -> str:
        """The name to report; 404 (param "model", code "model_not_found") if unknown."""
        names = self.config.model_names
        if name is None:
            return names[0]
        if name not in names:
            raise NotFoundError(f"The model '{name}' does not exist. Available: {', '.join(names)}",
                                param="model", code="model_not_found")
        return name

    def _spec(self, kind: EndpointKind, common: CommonFields, model: str,
              prompts: list[PreparedPrompt], logprobs: int | None, echo: bool) -> ResponseSpec:
        prefix = "chatcmpl" if kind is EndpointKind.CHAT else "cmpl"
        return ResponseSpec(kind=kind, response_id=f"{prefix}-{uuid.uuid4().hex}",
                            created=int(time.time()), model=model,
                            system_fingerprint=self.system_fingerprint, prompts=prompts,
                            logprobs=logprobs, echo=echo, return_token_ids=common.return_token_ids,
                            include_usage=common.include_usage)

    @staticmethod
    def _jobs(spec: ResponseSpec, params: list[SamplingParams], n: int) -> list[ChoiceJob]:
        """`n` choices per prompt; choice index = prompt index * n + i (as vLLM)."""
        return [ChoiceJob(index=p * n + i, prompt_index=p,
                          engine_request_id=f"{spec.response_id}-{p * n + i}",
                          params=params[p].for_choice(i))
                for p in range(len(params)) for i in range(n)]

    async def completion(self, request: web.Request, req: CompletionRequest) -> web.StreamResponse:
        arrival = time.monotonic()
        model = self.resolve_model(req.common.model)
        prompts = [self.prompts.completion_prompt(p, need_text=req.echo) for p in req.prompts]
        params = []
        for prompt in prompts:
            max_tokens = self.prompts.max_tokens_for(len(prompt.token_ids), req.max_tokens,
                                                     "prompt", "max_tokens")
            params.append(self.prompts.sampling_params(req.common.sampling, max_tokens, req.logprobs, {}))
        spec = self._spec(EndpointKind.COMPLETION, req.common, model, prompts, req.logprobs, req.echo)
        jobs = self._jobs(spec, params, req.common.sampling.n)
        return await self._execute(request, spec, jobs, req.common.stream, arrival)

    async def chat(self, request: web.Request, req: ChatRequest) -> web.StreamResponse:
        arrival = time.monotonic()
        model = self.resolve_model(req.common.model)
        prompt = self.prompts.chat_prompt(req)
        max_tokens = self.prompts.max_tokens_for(len(prompt.token_ids), req.max_tokens,
                                                 "messages", req.max_tokens_param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        renames = {"logprobs": "top_logprobs", "max_tokens": req.max_tokens_param}
        params = self.prompts.sampling_params(req.common.sampling, max_tokens, logprobs, renames)
        spec = self._spec(EndpointKind.CHAT, req.common, model, [prompt], logprobs, echo=False)
        jobs = self._jobs(spec, [params], req.common.sampling.n)
        return await self._execute(request, spec, jobs, req.common.stream, arrival)

    async def _execute(self, request: web.Request, spec: ResponseSpec, jobs: list[ChoiceJob],
                       stream: bool, arrival: float) -> web.StreamResponse:
        with self.admission.admit(len(jobs)):
            states = {job.index: ChoiceState(job) for job in jobs}
            timers = {job.index: ChoiceTimer(self.metrics, arrival,
                                             len(spec.prompts[job.prompt_index].token_ids))
                      for job in jobs}
            builder = ResponseBuilder(spec, self.formatter)
            try:
                async with contextlib.aclosing(run_choices(self.engine, jobs, spec.prompts)) as events:
                    if stream:
                        return await self._stream(request, builder, events, states, timers)
                    return await self._collect(builder, events, states, timers)
            finally:
                for timer in timers.values():
                    timer.abandoned()

    async def _collect(self, builder: ResponseBuilder, events: Events,
                       states: dict[int, ChoiceState], timers: dict[int, ChoiceTimer]) -> web.Response:
        try:
            async for job, out in events:
                states[job.index].update(out)
                timers[job.index].on_output(out)
        except EngineRequestError as exc:
            log.error("generation failed: %s", exc)
            raise exc.api_error from None
        return json_response(builder.full_body(list(states.values())))

    async def _stream(self, request: web.Request, builder: ResponseBuilder, events: Events,
                      states: dict[int, ChoiceState], timers: dict[int, ChoiceTimer]) -> web.StreamResponse:
        writer = SseWriter(request)
        try:
            # Headers go out now (as vLLM): clients see the request accepted before the first
            # token; failures from here on are SSE error events.
            await writer.start()
            async for job, out in events:
                state = states[job.index]
                state.update(out)
                timers[job.index].on_output(out)
                await writer.send(builder.chunks_for(state, out))
            if builder.spec.include_usage:
                await writer.send([builder.usage_chunk(list(states.values()))])
            await writer.done()
        except EngineRequestError as exc:
            log.error("generation failed mid-stream: %s", exc)
            if not writer.started:
                raise exc.api_error from None
            with contextlib.suppress(ConnectionError):
                await writer.send_error(exc.api_error)
                await writer.done()
        except ConnectionError:
            log.info("client went away during %s", builder.spec.response_id)
        return writer.response
