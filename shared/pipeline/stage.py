"""One pipeline stage: its layers over its slice of the shared KV cache, and the loop that the
stage processes (ranks 1..N-1) run.

The KV cache is one shared-memory tensor over ALL layers, `[num_layers, 2, num_blocks, ...]`
(the layout of shared.model.attention), allocated by stage 0 and mapped by every stage
process; stage i reads and writes only `kv_cache[start_i:end_i]`. Stage 0 can therefore hand
the whole tensor to the KV-transfer service exactly as a single-process engine does.

A stage process: joins the group, loads its layers, reports ready, then forever receives a
step (header + hidden states), runs its layers and passes the hidden states on; the last
stage instead samples the step's sampling rows and posts the token ids back to stage 0
without waiting for them to be received. A step without sampling rows sends nothing back.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.model.attention import AttentionMetadata
from shared.model.llama import LlamaForCausalLM
from shared.pipeline.channel import (
    StageChannel,
    join_group,
    leave_group,
    open_store,
)
from shared.pipeline.config import PipelineConfig
from shared.pipeline.handoff import PipelineError
from shared.pipeline.mirror import SamplingMirror
from shared.pipeline.netns import enter_netns
from shared.pipeline.wire import MessageKind, MirrorUpdate, StepHeader

log = logging.getLogger(__name__)


def step_positions(num_computed: list[int], num_scheduled: list[int]) -> torch.Tensor:
    """LongTensor[T]: position of each packed new token (sequence-major, as the runner packs)."""
    sched = torch.tensor(num_scheduled)
    ends = sched.cumsum(0)  # [B] exclusive end of each sequence in T
    offset = torch.tensor(num_computed) - (ends - sched)
    return torch.arange(int(ends[-1])) + offset.repeat_interleave(sched)


class StageModel:
    """A stage's layers (LlamaForCausalLM with a layer_range) bound to its cache slice."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache  # every layer: what the KV-transfer service reads
        self.local_kv = kv_cache[model.start:model.end]  # local layer 0 is global `start`
        self.block_size = block_size
        self.num_blocks = kv_cache.shape[2]

    @torch.inference_mode()
    def forward(self, header: StepHeader, inputs: torch.Tensor) -> torch.Tensor:
        """ids [T] (stage 0) or hidden [T, hidden] -> hidden [T, hidden]; writes this
        stage's layers' KV for the step's new tokens."""
        positions = step_positions(header.num_computed, header.num_scheduled)
        meta = AttentionMetadata.build(header.num_computed, header.num_scheduled,
                                       header.block_tables, self.block_size)
        return self.model(inputs, positions, meta, self.local_kv)

    @torch.inference_mode()
    def sampling_logits(self, header: StepHeader, hidden: torch.Tensor) -> torch.Tensor:
        """logits [S, V] fp32 at the last new token of each sampling row (last stage)."""
        ends = torch.tensor(header.num_scheduled).cumsum(0) - 1
        rows = [i for i, s in enumerate(header.samples) if s]
        return self.model.compute_logits(hidden[ends[rows]])


@dataclass(frozen=True)
class StageSpec:
    """Everything a stage process needs, pickled to it at spawn."""

    rank: int
    pipeline: PipelineConfig
    store_port: int  # the port the master store actually bound (config may say 0)
    model_dir: Path
    dtype: str
    layer_range: tuple[int, int]
    block_size: int
    seed: int
    num_threads: int
    kernel_tier: str = "auto"  # EngineConfig.kernel_tier: the cap is per process

    @property
    def world_size(self) -> int:
        return self.pipeline.pp_size

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1


class StageWorker:
    """The receive -> forward -> pass on (or sample and post back) loop of ranks >= 1."""

    def __init__(self, spec: StageSpec, stage: StageModel, channel: StageChannel,
                 mirror: SamplingMirror | None, token_gate: Any = None,
                 step_gate: Any = None) -> None:
        self.spec, self.stage, self.channel = spec, stage, channel
        self.mirror, self.token_gate, self.step_gate = mirror, token_gate, step_gate

    def serve(self) -> None:
        """Run steps until a SHUTDOWN message (passed on down the chain) arrives."""
        while True:
            msg = self.channel.recv_forward()
            if msg.kind is MessageKind.SHUTDOWN:
                if not self.spec.is_last:
                    self.channel.send_forward(MessageKind.SHUTDOWN)
                self.channel.flush()
                return
            header = msg.header
            if not header.slots:
                raise PipelineError(f"stage {self.spec.rank} received an empty step")
            assert msg.hidden is not None
            if self.step_gate is not None:  # test hook: hold this stage's KV writes back
                self.step_gate.acquire(timeout=self.spec.pipeline.step_timeout_s)
            hidden = self.stage.forward(header, msg.hidden)
            if self.mirror is None:
                self.channel.send_forward(MessageKind.BATCH, msg.lane, msg.header_data, hidden,
                                          msg.blob)
            else:
                self.mirror.apply(MirrorUpdate.decode(msg.blob))
                self._sample(header, hidden)

    def _sample(self, header: StepHeader, hidden: torch.Tensor) -> None:
        assert self.mirror is not None
        if header.num_samples == 0:  # a non-final prefill chunk: nothing to hand back
            return
        payload, _ = self.mirror.sample(header, self.stage.sampling_logits(header, hidden))
        if self.token_gate is not None:  # test hook: a controllable delay before the send
            self.token_gate.acquire(timeout=self.spec.pipeline.step_timeout_s)
        self.channel.send_tokens(header.lane, payload,
                                 blocking=self.spec.pipeline.blocking_handoff)


def stage_main(spec: StageSpec, kv_cache: torch.Tensor, counters: torch.Tensor,
               status: Any, token_gate: Any = None, step_gate: Any = None) -> None:
    """Entry point of stage process `spec.rank` (spawned by StageGroup)."""
    # Rank 0 owns a stage's lifetime: it drains the pipeline and sends SHUTDOWN, or kills the
    # stage. A SIGINT / SIGTERM sent to the whole process group (Ctrl-C, `kill -- -pgid`,
    # a container stop) must not end a stage first: rank 0 would then see a dead stage
    # mid-drain and turn a clean stop into a pipeline failure (exit 1). An orphaned stage
    # still ends: its channel to rank 0 times out (PipelineError, exit 1).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from kernels.tier import set_max_tier
    from shared.model.loader import load_model

    pipe = spec.pipeline
    try:
        if pipe.stage_netns is not None:  # first: the sockets and threads made later inherit it
            enter_netns(pipe.stage_netns)
        torch.set_num_threads(spec.num_threads)
        set_max_tier(spec.kernel_tier)
        model, model_config = load_model(spec.model_dir, spec.dtype, spec.layer_range)
        channel = StageChannel(spec.rank, spec.world_size, hidden_size=model_config.hidden_size,
                               dtype=model.dtype, timeout_s=pipe.step_timeout_s,
                               counters=counters)
        mirror = SamplingMirror(spec.seed, model_config.vocab_size) if spec.is_last else None
        worker = StageWorker(spec, StageModel(model, kv_cache, spec.block_size), channel,
                             mirror, token_gate, step_gate)
    except BaseException as exc:
        status.put((spec.rank, f"failed to start: {exc!r}"))
        raise
    status.put((spec.rank, None))
    # Joining blocks until every rank joins; rank 0 joins once all stages reported ready.
    store = open_store(pipe.master_addr, spec.store_port, spec.world_size, is_master=False,
                       timeout_s=pipe.connect_timeout_s)
    join_group(store, pipe.bind_addr(spec.rank), spec.rank, spec.world_size)
    try:
        worker.serve()
    except PipelineError as exc:
        log.error("pipeline stage %d stopped: %s", spec.rank, exc)
        raise SystemExit(1) from None
    finally:
        leave_group()
