"""LLMEngine: the synchronous core that the offline LLM and the AsyncEngine thread drive.

`step()` is the whole loop body: schedule, run (forward + sample), update, emit. Every
feature lives in a component (scheduler, block manager, runner, sampler, output processor).
The P/D hooks (held KV, pre-allocated receiving blocks, prefilled requests, the public
`runner.kv_cache`) are plain methods here, to be called on the engine thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from shared.config import EngineConfig
from shared.engine.accelerate import accelerate
from shared.engine.block_manager import KVCacheManager
from shared.engine.core_share import CoreShare
from shared.engine.grammar import GrammarCompiler
from shared.engine.kv_stream import KVProgress, KVStreamTracker
from shared.engine.output_processor import OutputProcessor
from shared.engine.outputs import RequestOutput
from shared.engine.request import PrefilledKV, Request, RequestStatus
from shared.engine.runner import CacheRunner, CausalLM, KVGeometry, ModelRunner
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler
from shared.engine.spec.drafter import Drafter, SpecDecodeStats
from shared.engine.stats import EngineStats
from shared.engine.structured import StructuredOutputRequest
from shared.engine.structured_spec import InvalidStructuredOutput, StructuredOutputSpec
from shared.model.config import ModelConfig
from shared.model.loader import release_freed_heap
from shared.model.quant import DEFAULT_ENCODER, QuantConfig, QuantMethod
from shared.model.tokenizer import Tokenizer
from shared.speculative_config import SpeculativeMethod

log = logging.getLogger(__name__)
NON_FINITE_LOGITS = "the model produced non-finite logits (NaN or inf) for this request"


class LLMEngine:
    """One model, one KV cache, one scheduler; not thread-safe (one engine thread owns it).

    Build with `LLMEngine.from_config(config)` (resolves, loads, tokenizer), or
    `from_model` from an already-built model (tests). The constructor takes the parts: the
    runner that owns the KV cache and, optionally, how to build the scheduler over the
    engine's block pool (a plain Scheduler by default); the pipeline engine passes its stage
    and its lanes. max_model_len is the checkpoint's limit (or the configured one), capped by
    what the KV cache can hold and, without chunked prefill, by max_num_batched_tokens, so
    that any single request always fits.
    """

    # Per-step KV progress of stream_kv requests (None: an engine that reports none).
    kv_stream: KVStreamTracker | None = None

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer: Tokenizer,
                 runner: CacheRunner, *,
                 make_scheduler: Callable[[KVCacheManager], Scheduler] | None = None,
                 model_dir: Path | None = None, fingerprint: str = "") -> None:
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.model_dir, self.fingerprint = model_dir, fingerprint
        self.runner = runner
        self.max_model_len = self._max_model_len()
        self.kv = KVCacheManager(runner.num_blocks, config.block_size,
                                 config.enable_prefix_caching,
                                 sliding_window=model_config.kv_window)
        self.scheduler = make_scheduler(self.kv) if make_scheduler is not None else Scheduler(
            self.kv, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill, drafter=self._drafter())
        self.output_processor = OutputProcessor(tokenizer, self.max_model_len)
        self.kv_stream = KVStreamTracker(config.block_size)
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(model_config.eos_token_ids)
        # Structured output: grammars compiled against this tokenizer (thread-safe cache).
        self.grammars = GrammarCompiler(tokenizer, self.eos_token_ids, config.grammar_cache_size)
        self.last_num_scheduled_tokens = 0
        self.cores = (CoreShare(config.core_share, config.num_threads or torch.get_num_threads())
                      if config.core_share is not None else None)
        self._threads = torch.get_num_threads()
        self._pending: list[RequestOutput] = []  # outputs produced between steps

    def _drafter(self) -> Drafter | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        if spec.method is SpeculativeMethod.DRAFT_MODEL:
            from shared.engine.spec.draft_model import build_draft_proposer

            cache = self.runner.kv_cache if isinstance(self.runner, ModelRunner) else None
            return Drafter(spec, self.max_model_len,
                           build_draft_proposer(self.config, self.tokenizer, cache))
        return Drafter(spec, self.max_model_len)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        from shared.model.loader import load_model, open_checkpoint
        from shared.model.registry import resolve_model

        model_dir = resolve_model(config.model, config.resolved_cache_dir,
                                  revision=config.revision, hub_cache=config.hf_hub_cache)
        apply_kernel_tier(config)  # before load_model: MXFP4 quantisation resolves kernels too
        model, model_config = load_model(model_dir, config.dtype,
                                         quantization=_quant_config(config))
        accelerate(model, config)
        release_freed_heap()  # again: accelerate repacks weights (load_model trimmed its own)
        return cls.from_model(config, model, model_config, Tokenizer(model_dir),
                              model_dir=model_dir,
                              fingerprint=open_checkpoint(model_dir).fingerprint())

    @classmethod
    def from_model(cls, config: EngineConfig, model: CausalLM, model_config: ModelConfig,
                   tokenizer: Tokenizer, *, model_dir: Path | None = None,
                   fingerprint: str = "") -> LLMEngine:
        """One process: a ModelRunner over `model` (and its own KV cache) and a Scheduler."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        geometry = KVGeometry.for_model(
            config, model_config, getattr(model, "num_local_layers", model_config.num_layers))
        return cls(config, model_config, tokenizer,
                   ModelRunner(model, geometry, config, model_config.vocab_size),
                   model_dir=model_dir, fingerprint=fingerprint)

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's limit {limit}")
        caps = [wanted, self.runner.num_blocks * self.config.block_size]
        if not self.config.enable_chunked_prefill:
            caps.append(self.config.max_num_batched_tokens)
        if min(caps) < wanted:  # only worth a warning when the user asked for the length
            level = logging.WARNING if self.config.max_model_len else logging.INFO
            log.log(level, "max_model_len capped from %d to %d (KV cache / batch budget)",
                    wanted, min(caps))
        return min(caps)

    # ---- requests --------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request this engine cannot run (thread-safe: reads config)."""
        if params.n != 1:
            raise ValueError("the engine runs n=1 requests; fan out with params.for_choice(i)")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; the context length "
                             f"is {self.max_model_len} (one must be left to generate)")
        if params.structured is not None:
            self.check_structured(params.structured)

    def check_structured(self, spec: StructuredOutputSpec) -> None:
        """Raise InvalidStructuredOutput if this engine cannot mask its sampler (thread-safe).
        A pipeline's last stage samples in another process, without the grammar state."""
        if not isinstance(self.runner, ModelRunner):
            raise InvalidStructuredOutput(
                f"{spec.param or 'structured output'}: structured output is not supported by "
                "this engine (pipeline parallel)", spec.param or "response_format")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, hold_kv: bool = False, prefilled: PrefilledKV | None = None,
                    wait_for_remote_kv: bool = False, arrival_time: float | None = None,
                    stream_kv: bool = False) -> Request:
        """Queue a request.

        hold_kv: when it finishes normally its blocks are kept until `release_held`.
        prefilled: it starts from KV already in `prefilled.block_ids` (which it then owns).
        wait_for_remote_kv: it waits (WAITING_FOR_REMOTE_KV, abortable, never scheduled)
        until `remote_kv_ready` hands it its prefilled KV.
        stream_kv (with hold_kv): report its full prompt blocks as they are computed
        (`take_kv_progress`), so a push prefill can send them while the prompt still runs.
        """
        self.validate(prompt_token_ids, params)
        if request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if hold_kv and self.kv.held_block_ids(request_id) is not None:
            raise ValueError(f"request id {request_id!r} still holds KV blocks")
        if prefilled is not None and wait_for_remote_kv:
            raise ValueError("prefilled and wait_for_remote_kv are exclusive")
        if stream_kv and not hold_kv:
            raise ValueError("stream_kv needs hold_kv (the blocks must outlive the request)")
        if stream_kv and self.kv_stream is None:
            raise ValueError("this engine does not report KV progress (stream_kv)")
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids,
                      hold_kv=hold_kv,
                      arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        if params.structured is not None:  # a cache hit when the services compiled it first
            matcher = self.grammars.compile(params.structured).matcher()
            req.structured = StructuredOutputRequest(params.structured, matcher)
        if prefilled is not None:
            self._adopt(req, prefilled)
        if wait_for_remote_kv:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.scheduler.add_request(req)
        self.output_processor.add_request(req)
        if stream_kv and self.kv_stream is not None:
            self.kv_stream.track(req)
        if req.output_token_ids:  # the prefilled first token is emitted first
            self._emit(req)
        return req

    def remote_kv_ready(self, request_id: str, prefilled: PrefilledKV) -> None:
        """Give a WAITING_FOR_REMOTE_KV request its received KV; it becomes schedulable."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request_id!r} is not waiting for remote KV")
        self._adopt(req, prefilled)
        req.status = RequestStatus.WAITING
        if req.output_token_ids:
            self._emit(req)

    def _adopt(self, req: Request, pre: PrefilledKV) -> None:
        n = pre.num_computed_tokens
        if pre.first_token_id is not None and n != req.num_prompt_tokens:
            raise ValueError("a prefilled first token needs the whole prompt's KV")
        if not 0 < n < req.num_prompt_tokens + (pre.first_token_id is not None):
            raise ValueError(f"num_computed_tokens={n} must be in [1, prompt length]")
        first = pre.first_token_id
        if first is not None and req.structured is not None and not req.structured.allows(first):
            raise ValueError(f"the prefilled first token {first} is outside the request's grammar")
        self.kv.adopt_blocks(req, list(pre.block_ids), n)
        if pre.first_token_id is not None:
            req.append_output_token(pre.first_token_id)
            if pre.first_logprob is not None:
                req.pending_logprobs.append(pre.first_logprob)

    def _emit(self, req: Request) -> RequestOutput:
        out = self.output_processor.process(req)
        if req.is_finished:
            self.scheduler.finish_request(req.request_id, req.status)
        self._pending.append(out)
        return out

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                      error: str | None = None) -> bool:
        """Finish a request now (its blocks are freed at once); its final output is emitted
        by the next step(). Unknown or finished ids are ignored."""
        if self.kv_stream is not None:
            self.kv_stream.forget(request_id)
        req = self.scheduler.finish_request(request_id, status)
        if req is None:
            return False
        req.error = error
        self._pending.append(self.output_processor.finish(req))
        return True

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every request with FINISHED_ERROR; returns their (and pending) outputs."""
        for rid in list(self.scheduler.requests):
            self.abort_request(rid, RequestStatus.FINISHED_ERROR, error)
        outputs, self._pending = self._pending, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    def has_work(self) -> bool:
        """Whether step() can make progress with no outside change: outputs are pending, or
        requests exist and the last step computed something. False while every request is
        blocked (waiting for KV blocks held elsewhere, or for remote KV)."""
        return bool(self._pending) or (self.scheduler.has_unfinished_requests()
                                       and self.last_num_scheduled_tokens > 0)

    # ---- the loop body -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        self.last_num_scheduled_tokens = batch.total_num_scheduled_tokens
        if batch.is_empty:
            self._lend_cores()
            return outputs
        # An engine built on another runner (a pipeline stage) has its own step().
        assert isinstance(self.runner, ModelRunner)
        self._borrow_cores()
        result = self.runner.execute(batch)
        for i in result.non_finite:  # that request fails (before its blocks get cached)
            self.abort_request(batch.requests[i].request_id, RequestStatus.FINISHED_ERROR,
                               NON_FINITE_LOGITS)
        for req in self.scheduler.update_from_output(batch, result.sampled_token_ids,
                                                     result.logprobs, result.draft_samples):
            outputs.append(self.output_processor.process(req))
            if req.is_finished:
                self.scheduler.finish_request(req.request_id, req.status)
        if self.kv_stream is not None:
            self.kv_stream.collect(batch.requests)
        if not self.has_work():
            self._lend_cores()
        return outputs

    def _borrow_cores(self) -> None:
        """Run the coming step on our threads plus those of idle sibling engines."""
        if self.cores is None:
            return
        threads = self.cores.claim()
        if threads != self._threads:  # per thread: the engine thread runs every step
            torch.set_num_threads(threads)
            self._threads = threads

    def _lend_cores(self) -> None:
        if self.cores is not None:
            self.cores.release()

    def close(self) -> None:
        """Give back what outlives the object: this engine's slot in a core share."""
        if self.cores is not None:
            self.cores.close()

    def activate_structured(self, request_id: str) -> bool:
        """The request's reasoning ended: its grammar applies from its next token on (for
        reasoning_first specs without reasoning_end_ids). False if it has none or is gone."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.structured is None:
            return False
        req.structured.activate()
        return True

    # ---- P/D hooks (engine thread only) ----------------------------------------------------
    def take_kv_progress(self) -> list[KVProgress]:
        """Full prompt blocks newly computed for `stream_kv` requests since the last call."""
        return self.kv_stream.take() if self.kv_stream is not None else []

    def held_block_ids(self, request_id: str) -> list[int] | None:
        return self.kv.held_block_ids(request_id)

    def release_held(self, request_id: str) -> bool:
        return self.kv.release_held(request_id)

    def allocate_blocks(self, num_tokens: int) -> list[int] | None:
        return self.kv.allocate_blocks(num_tokens)

    def free_blocks(self, block_ids: list[int]) -> None:
        self.kv.free_blocks(block_ids)

    # ---- misc ------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        kv = self.kv
        runner = self.runner if isinstance(self.runner, ModelRunner) else None
        guard = runner.logits_guard if runner else None
        drafter = self.scheduler.drafter
        spec = drafter.stats if drafter is not None else SpecDecodeStats()
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.num_blocks,
            kv_usage=kv.usage, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits, num_preemptions=self.scheduler.num_preemptions,
            block_size=kv.block_size, num_held_blocks=kv.num_held_blocks,
            num_non_finite_logits=guard.num_non_finite if guard else 0,
            non_finite_logits_at=guard.last_non_finite_at if guard else None,
            weights_bytes=runner.weights_bytes if runner else 0,
            kv_cache_bytes=runner.kv_cache.nbytes if runner else 0,
            spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=tuple(spec.accepted_per_position),
            num_threads=self._threads,
            num_borrowed_thread_steps=self.cores.borrowed_steps if self.cores else 0)

    def warmup(self) -> None:
        """Run one short request through every component, then forget it (cache, counters)."""
        prompt = list(range(1, min(17, self.max_model_len)))
        self.add_request("__warmup__", prompt, SamplingParams(temperature=0.0, max_tokens=2,
                                                              ignore_eos=True))
        while self.has_unfinished_requests():
            self.step()
        self.kv.reset_prefix_cache()
        self.scheduler.num_preemptions = 0
        if self.scheduler.drafter is not None:
            self.scheduler.drafter.stats = self.scheduler.drafter.new_stats()
        # The first step allocates and frees its one-off buffers (prefill scratch, kernel
        # set-up): give their pages back too, as after loading (release_freed_heap's why).
        release_freed_heap()
        if isinstance(self.runner, ModelRunner) and self.runner.logits_guard.reset():
            log.warning("the warm-up request got NaN or infinite logits: the weights may be "
                        "broken (%s); every request will fail until they are fixed",
                        self.model_dir or self.config.model)


def apply_kernel_tier(config: EngineConfig) -> None:
    """Cap automatic kernel dispatch at config.kernel_tier (process-wide, kernels/tier.py).

    Called once per load, before any kernel path is resolved; the libraries drop the paths they
    resolved under an earlier cap, so the last engine built in a process sets the tier.
    """
    from kernels.tier import set_max_tier

    cap = set_max_tier(config.kernel_tier)
    log.info("kernel tier: %s (cap %s)", config.kernel_tier, cap.label)


def _quant_config(config: EngineConfig) -> QuantConfig | None:
    """config.quantization as a QuantConfig; None leaves the LM head to the default (dense, or
    what a pre-quantised checkpoint stores)."""
    if config.quantization is None:
        return None
    quant = QuantConfig.parse(config.quantization, config.quant_encoder or DEFAULT_ENCODER,
                              config.quant_activations)
    assert quant is not None and quant.method is QuantMethod(config.quantization)
    return replace(quant, quantize_lm_head=True if config.quantize_lm_head else None)
