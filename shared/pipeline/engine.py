"""PipelineEngine: an LLMEngine whose layers run in N stage processes, microbatched in N lanes.

Stage 0 is this process: it owns the lanes' schedulers, the KV block accounting, the output
processor, and the first layers. One `step()` is one lane's turn (round robin):
    1. land the lane's previous step: wait for its sampled tokens (the handoff, exactly once,
       here where the lane's next input ids are about to be prepared), append them, emit;
    2. schedule the lane's next step, run this stage's layers, post the hidden states
       (async) and the receive for that step's tokens, and return at once.
While the last stage samples lane A's step, stage 0 schedules and runs lane B's: with N lanes
every stage is busy. A step whose rows sample nothing (a non-final prefill chunk) posts no
token receive; an empty schedule posts nothing at all. With `blocking_handoff` stage 0 waits
for the tokens right after the send instead (the benchmark baseline). A push prefill's
streamed prompt blocks are reported only once every stage has written them (StageKVGate).

A stage that dies or stalls past `step_timeout_s` raises PipelineError out of `step()`: the
pipeline is marked FAILED, its stages are killed, its handoffs abandoned; the AsyncEngine
thread then fails every request. A new PipelineEngine can start in the same process.
"""

from __future__ import annotations

import os
from enum import Enum
from typing import Any

import torch

from shared.config import EngineConfig
from shared.engine.block_manager import KVCacheManager
from shared.engine.engine import LLMEngine, apply_kernel_tier
from shared.engine.outputs import RequestOutput, TokenLogprob
from shared.engine.request import Request, RequestStatus
from shared.engine.runner import KVGeometry
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import ScheduledBatch
from shared.model.config import ModelConfig
from shared.model.tokenizer import Tokenizer
from shared.pipeline.channel import StageChannel, new_counters
from shared.pipeline.config import PipelineConfig
from shared.pipeline.events import EventKind, PipelineHooks
from shared.pipeline.handoff import HandoffLedger, PipelineError
from shared.pipeline.kv_gate import StageKVGate
from shared.pipeline.lanes import InFlightStep, Lane, LaneScheduler
from shared.pipeline.launcher import StageGroup
from shared.pipeline.mirror import MirrorFeed, token_spec
from shared.pipeline.stage import StageModel
from shared.pipeline.wire import MessageKind, StepHeader


class PipelineState(Enum):
    RUNNING = "running"
    FAILED = "failed"
    CLOSED = "closed"


def allocate_shared_cache(config: EngineConfig, mc: ModelConfig) -> torch.Tensor:
    """Zeroed shared-memory KV cache over every layer, sized as a one-process engine's."""
    geometry = KVGeometry.for_model(config, mc)
    shape = geometry.cache_shape(geometry.num_blocks(config.kv_cache_memory_bytes))
    return torch.empty(shape, dtype=geometry.dtype).share_memory_().zero_()


class PipelineEngine(LLMEngine):
    """LLMEngine's interface (add_request, abort_request, step, has_unfinished_requests,
    has_work, stats, warmup, the P/D hooks) over a pipeline of `pipeline.pp_size` stages.

    LLMEngine's constructor gets this engine's parts: stage 0 as the runner (its
    `kv_cache` is the whole shared cache, so the KV-transfer service reads a prefill's blocks
    of every layer from stage 0) and the lanes as the scheduler. Call `close()` (or use it as
    a context manager) to stop the stage processes.
    """

    runner: StageModel
    scheduler: LaneScheduler  # type: ignore[assignment]  # the Scheduler surface, per lane

    def __init__(self, config: EngineConfig, pipeline: PipelineConfig,
                 hooks: PipelineHooks | None = None) -> None:
        from shared.model.loader import load_model, open_checkpoint
        from shared.model.registry import resolve_model

        if not pipeline.enabled:
            raise ValueError("PipelineEngine needs pp_size >= 2 (use LLMEngine for one stage)")
        if config.quantization is not None:
            raise NotImplementedError("quantized models are not pipelined yet")
        if config.speculative_config is not None:
            # The last stage samples one token per request from the lanes' batches; drafts and
            # their verification are not carried through the stages.
            raise ValueError("speculative_config is not supported with pp_size > 1 "
                             "(pipeline-parallel engines decode one token per step)")
        model_dir = resolve_model(config.model, config.resolved_cache_dir,
                                  revision=config.revision, hub_cache=config.hf_hub_cache)
        ckpt = open_checkpoint(model_dir)
        ranges = pipeline.layer_ranges(ckpt.config.num_layers)
        apply_kernel_tier(config)  # rank 0; the stages apply the same tier (StageSpec)
        threads = config.num_threads or max(1, (os.cpu_count() or 1) // pipeline.pp_size)
        torch.set_num_threads(threads)
        self.pipeline, self.hooks = pipeline, hooks or PipelineHooks()
        self.layer_ranges = ranges  # [(start, end)] of global layers per stage
        self.counters = new_counters(pipeline.pp_size)
        self.ledger = HandoffLedger()
        kv_cache = allocate_shared_cache(config, ckpt.config)
        self._group = StageGroup(pipeline, model_dir=model_dir, dtype=config.dtype,
                                 layer_ranges=ranges, block_size=config.block_size,
                                 seed=config.seed, num_threads=threads,
                                 kernel_tier=config.kernel_tier, kv_cache=kv_cache,
                                 counters=self.counters, token_gate=self.hooks.token_gate,
                                 step_gate=self.hooks.step_gate)
        try:
            model, _ = load_model(model_dir, config.dtype, ranges[0])
            self._group.wait_ready()
            self.stage = StageModel(model, kv_cache, config.block_size)
            self.channel = StageChannel(0, pipeline.pp_size, hidden_size=ckpt.config.hidden_size,
                                        dtype=model.dtype, timeout_s=pipeline.step_timeout_s,
                                        counters=self.counters)
            self.feed = MirrorFeed()
            super().__init__(config, ckpt.config, Tokenizer(model_dir), self.stage,
                             # LaneScheduler has Scheduler's request surface but not its
                             # schedule(); step() is overridden. Debt: a scheduler Protocol.
                             make_scheduler=self._make_lanes,  # type: ignore[arg-type]
                             model_dir=model_dir,
                             fingerprint=ckpt.fingerprint())
            assert self.kv_stream is not None  # LLMEngine's constructor builds one
            self.kv_gate = StageKVGate(self.kv_stream)  # streamed blocks: final on every stage
        except BaseException:
            self._group.stop(graceful=False)
            raise
        self._next_step = 0
        self._idle_turns = 0  # consecutive lane turns that launched nothing
        self.state = PipelineState.RUNNING

    def _make_lanes(self, kv: KVCacheManager) -> LaneScheduler:
        """One lane per stage over the engine's block pool; a request that leaves also leaves
        the sampling mirror. Called by LLMEngine's constructor (after it set `config`)."""
        config = self.config
        return LaneScheduler(
            kv, self.pipeline.pp_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            on_finish=lambda req: self.feed.release(req.request_id))

    @classmethod
    def from_config(cls, config: EngineConfig,
                    pipeline: PipelineConfig | None = None) -> PipelineEngine:
        return cls(config, pipeline or PipelineConfig(pp_size=2))

    def __enter__(self) -> PipelineEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    **kwargs: Any) -> Request:
        req = super().add_request(request_id, prompt_token_ids, params, **kwargs)
        self._idle_turns = 0
        return req

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                      error: str | None = None) -> bool:
        """As LLMEngine; a request in an in-flight step is dropped now (its blocks too: any
        later step that reuses them runs after the in-flight one on every stage), and its
        token is discarded when the step lands."""
        self._idle_turns = 0
        return super().abort_request(request_id, status, error)

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or self.num_in_flight > 0

    def has_work(self) -> bool:
        return (bool(self._pending) or self.num_in_flight > 0
                or (self.scheduler.has_unfinished_requests()
                    and self._idle_turns < len(self.scheduler.lanes)))

    @property
    def num_in_flight(self) -> int:
        return sum(lane.inflight is not None for lane in self.scheduler.lanes)

    def allocate_blocks(self, num_tokens: int) -> list[int] | None:
        raise NotImplementedError("a pipeline-parallel engine does not receive remote KV yet "
                                  "(decode role); run decode workers with pp_size 1")

    # ---- the loop body ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.state is not PipelineState.RUNNING:
            raise PipelineError(f"the pipeline is {self.state.value}")
        try:
            self._group.check_alive()
            return self._lane_turn(self.scheduler.next_lane())
        except PipelineError:
            self._fail()
            raise

    def _lane_turn(self, lane: Lane) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if lane.inflight is not None:
            outputs += self._land(lane)
        batch = lane.scheduler.schedule()
        self.last_num_scheduled_tokens = batch.total_num_scheduled_tokens
        if batch.is_empty:
            self._idle_turns += 1
            return outputs
        self._idle_turns = 0
        self._record(EventKind.SCHEDULE, lane.index, self._next_step)
        self._launch(lane, batch)
        if self.pipeline.blocking_handoff:
            outputs += self._land(lane)
        return outputs

    def _launch(self, lane: Lane, batch: ScheduledBatch) -> None:
        step, self._next_step = self._next_step, self._next_step + 1
        reqs = batch.requests
        slots, records = self.feed.slots(reqs)
        header = StepHeader(step, lane.index, slots, batch.num_computed_tokens,
                            batch.num_scheduled_tokens, batch.samples,
                            [r.block_table for r in reqs])
        ids: list[int] = []
        for r, c, n in zip(reqs, batch.num_computed_tokens, batch.num_scheduled_tokens,
                           strict=True):
            ids.extend(r.all_token_ids[c:c + n])
        blob = self.feed.update(records).encode()
        self._record(EventKind.PREPARE, lane.index, step)
        hidden = self.stage.forward(header, torch.tensor(ids))
        self.channel.send_forward(MessageKind.BATCH, lane.index, header.encode(), hidden, blob)
        self._record(EventKind.SEND, lane.index, step)
        spec = token_spec(reqs, batch.samples)
        handoff = None
        if spec.num_rows:  # no sampling row: the last stage sends nothing, so post nothing
            handoff = self.channel.post_tokens(spec, lane=lane.index, step=step,
                                               ledger=self.ledger)
            self._record(EventKind.POST_RECV, lane.index, step)
        lane.inflight = InFlightStep(step, batch, handoff)

    def _land(self, lane: Lane) -> list[RequestOutput]:
        """Consume the lane's in-flight step: its tokens (awaited here, once), then outputs."""
        flight, lane.inflight = lane.inflight, None
        assert flight is not None
        batch = flight.batch
        tokens: list[int | None] = [None] * len(batch.requests)
        logprobs: list[TokenLogprob | None] = [None] * len(batch.requests)
        if flight.handoff is not None:
            self._record(EventKind.WAIT_BEGIN, lane.index, flight.step_id)
            sampled, sampled_lp = flight.handoff.wait()
            self._record(EventKind.ARRIVED, lane.index, flight.step_id)
            rows = [i for i, s in enumerate(batch.samples) if s]
            for j, i in enumerate(rows):
                tokens[i], logprobs[i] = sampled[j], sampled_lp[j]
        outputs = []
        for req in lane.scheduler.update_from_output(batch, tokens, logprobs):
            outputs.append(self.output_processor.process(req))
            if req.is_finished:
                self.scheduler.finish_request(req.request_id, req.status)
        self.kv_gate.landed(flight.step_id, batch.requests, complete=flight.handoff is not None)
        self._record(EventKind.CONSUME, lane.index, flight.step_id)
        return outputs

    def _record(self, kind: EventKind, lane: int, step: int) -> None:
        if self.hooks.events is not None:
            self.hooks.events.record(kind, lane, step)

    # ---- shutdown and failure ----------------------------------------------------------------
    def _fail(self) -> None:
        """The pipeline is broken: abandon every handoff and kill the stages."""
        if self.state is PipelineState.RUNNING:
            self.state = PipelineState.FAILED
            for lane in self.scheduler.lanes:
                lane.inflight = None
            self.ledger.abandon_all()
            self.kv_gate.clear()
            self._group.stop(graceful=False)

    def close(self) -> None:
        """Abort what is left, wait for every in-flight step (each handoff exactly once),
        stop the stages. Idempotent; never raises PipelineError."""
        if self.state is PipelineState.RUNNING:
            for rid in list(self.scheduler.requests):
                self.abort_request(rid)
            try:
                for lane in self.scheduler.lanes:
                    if lane.inflight is not None:
                        self._land(lane)
                self.channel.send_forward(MessageKind.SHUTDOWN)
                self.channel.flush()
            except PipelineError:
                self._fail()
            else:
                self._group.stop(graceful=True)
        self._pending = []
        self.state = PipelineState.CLOSED
