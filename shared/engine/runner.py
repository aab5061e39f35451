"""ModelRunner: owns the paged KV cache, turns a ScheduledBatch into one forward, samples.

The KV cache is ONE tensor `kv_cache[num_layers, 2, num_blocks, block_size, kv_heads,
head_dim]` (layout in shared.model.attention); it is public (`runner.kv_cache`) so the
KV-transfer service can read and write whole blocks with `kv_cache[:, :, block_ids]`.
The number of blocks is `EngineConfig.kv_cache_memory_bytes` divided by one block's bytes
over every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from shared.config import EngineConfig
from shared.engine.logits_guard import LogitsGuard
from shared.engine.outputs import TokenLogprob
from shared.engine.sampler import Sampler, SamplingTensors
from shared.engine.scheduler import ScheduledBatch
from shared.model.attention import AttentionMetadata
from shared.model.config import ModelConfig

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class CausalLM(Protocol):
    """What the runner needs of a model (LlamaForCausalLM, or a test double)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class CacheRunner(Protocol):
    """What an engine holds its runner for outside `step()`: the paged KV cache (which the
    KV-transfer service reads and writes) and its size. ModelRunner is one; so is a pipeline's
    stage 0 (shared.pipeline.stage.StageModel), whose engine has its own step."""

    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class KVGeometry:
    """Shape of the cache, derived from the model and the memory budget."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, config: EngineConfig, model_config: ModelConfig,
                  num_layers: int | None = None) -> KVGeometry:
        """The cache of `model_config` under `config`; num_layers: the layers this process
        holds KV for (default: all of the model's)."""
        return cls(num_layers=model_config.num_layers if num_layers is None else num_layers,
                   num_kv_heads=model_config.num_kv_heads, head_dim=model_config.head_dim,
                   block_size=config.block_size, dtype=KV_DTYPES[config.resolved_kv_dtype])

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        """[num_layers, 2, num_blocks, block_size, kv_heads, head_dim] (KV_LAYOUT)."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads,
                self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks(self, memory_bytes: int) -> int:
        n = memory_bytes // self.bytes_per_block
        if n < 1:
            raise ValueError(f"kv_cache_memory_bytes={memory_bytes} is smaller than one block "
                             f"({self.bytes_per_block} bytes)")
        return n


@dataclass(frozen=True)
class RunnerOutput:
    """Per request of the batch (same order): the sampled token, or None for a prefill chunk
    that did not reach the end of the prompt; logprobs likewise (None when not asked).
    `non_finite` lists the batch indices whose logits held NaN or inf: they got no token, and
    the engine fails those requests (and only those)."""

    sampled_token_ids: list[int | None]
    logprobs: list[TokenLogprob | None]
    non_finite: tuple[int, ...] = ()


class ModelRunner:
    """Runs one model on CPU over a paged KV cache; single-threaded (the engine thread)."""

    def __init__(self, model: CausalLM, geometry: KVGeometry, config: EngineConfig,
                 vocab_size: int) -> None:
        self.model = model
        self.geometry = geometry
        self.block_size = geometry.block_size
        self.num_blocks = geometry.num_blocks(config.kv_cache_memory_bytes)
        self.vocab_size = vocab_size
        # zeros, not empty: padded attention slots read block 0, and 0 * NaN garbage would
        # poison the softmax-weighted sum even where the mask gives weight 0.
        self.kv_cache = torch.zeros(geometry.cache_shape(self.num_blocks), dtype=geometry.dtype)
        self.weights_bytes = tensor_bytes(model) if isinstance(model, torch.nn.Module) else 0
        self.sampler = Sampler(config.seed)
        self.logits_guard = LogitsGuard()
        # Test-only: when set, called with every batch before its forward, on the engine
        # thread. What it raises escapes the engine step exactly as a model failure would, so
        # tests can inject one without patching internals. Always None in production.
        self.fault_hook: Callable[[ScheduledBatch], None] | None = None

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        if self.fault_hook is not None:
            self.fault_hook(batch)
        reqs, computed, sched = batch.requests, batch.num_computed_tokens, batch.num_scheduled_tokens
        ids: list[int] = []
        pos: list[int] = []
        for r, c, n in zip(reqs, computed, sched, strict=True):
            ids.extend(r.all_token_ids[c:c + n])
            pos.extend(range(c, c + n))
        positions = torch.tensor(pos)  # (plain lists: cheaper than repeat_interleave here)
        ends = torch.tensor(sched).cumsum(0)  # [B] exclusive end of each sequence in T
        meta = AttentionMetadata.build(computed, sched, [r.block_table for r in reqs],
                                       self.block_size)
        hidden = self.model(torch.tensor(ids), positions, meta, self.kv_cache)  # [T, hidden]
        rows = [i for i, s in enumerate(batch.samples) if s]
        tokens: list[int | None] = [None] * len(reqs)
        logprobs: list[TokenLogprob | None] = [None] * len(reqs)
        if not rows:
            return RunnerOutput(tokens, logprobs)
        last = (ends - 1)[rows] if len(rows) < len(reqs) else ends - 1
        logits = self.model.compute_logits(hidden[last])  # [R, V] fp32
        checked = self.logits_guard.check(logits)  # NaN/inf rows: sampled from zeros, dropped
        logits, bad_rows = checked.logits, checked.bad_rows
        out = self.sampler(logits, SamplingTensors.from_requests([reqs[i] for i in rows],
                                                                  logits.shape[1]))
        for j, i in enumerate(rows):
            tokens[i] = out.token_ids[j]
            if out.logprobs is not None:
                logprobs[i] = out.logprobs[j]
        for j in bad_rows:
            tokens[rows[j]] = logprobs[rows[j]] = None
        return RunnerOutput(tokens, logprobs, tuple(rows[j] for j in bad_rows))


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (packed MXFP4 blocks, RoPE tables), each
    storage counted once: a tied LM head and its embedding share one."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*module.parameters(), *module.buffers())}
    return sum(storages.values())
