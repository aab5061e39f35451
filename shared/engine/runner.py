"""ModelRunner: owns the paged KV cache, turns a ScheduledBatch into one forward, samples.

The KV cache is ONE tensor `kv_cache[num_layers, 2, num_blocks, block_size, kv_heads,
head_dim]` (layout in shared.model.attention); it is public (`runner.kv_cache`) so the
KV-transfer service can read and write whole blocks with `kv_cache[:, :, block_ids]`.
The number of blocks is `EngineConfig.kv_cache_memory_bytes` divided by one block's bytes
over every layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels.huge_pages import huge_page_empty
from shared.config import EngineConfig
from shared.engine.accelerate import greedy_head
from shared.engine.logits_guard import LogitsGuard
from shared.engine.outputs import TokenLogprob
from shared.engine.request import Request
from shared.engine.sampler import Sampler, SamplerOutput, SamplingTensors
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
    the engine fails those requests (and only those). `draft_samples` (empty when no request
    speculated): for a request with a draft, the target's sample at each of its 1 + len(draft)
    positions (sampled_token_ids holds the first), else []."""

    sampled_token_ids: list[int | None]
    logprobs: list[TokenLogprob | None]
    non_finite: tuple[int, ...] = ()
    draft_samples: tuple[list[int], ...] = ()


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
        # poison the softmax-weighted sum even where the mask gives weight 0. On huge pages,
        # as the weights are (kernels/huge_pages.py): long-context decode streams it too.
        # zero_() touches every page now, so the worker's RSS when ready is its RSS under load.
        shape = geometry.cache_shape(self.num_blocks)
        nbytes = math.prod(shape) * geometry.dtype.itemsize
        self.kv_cache = huge_page_empty(nbytes).view(geometry.dtype).view(shape).zero_()
        # Plain-greedy rows' tokens without the full head's logits (None: not for this model).
        self.greedy_head = greedy_head(model, config)
        self.weights_bytes = ((tensor_bytes(model) if isinstance(model, torch.nn.Module) else 0)
                              + (tensor_bytes(self.greedy_head) if self.greedy_head else 0))
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
        for i, (r, c, n) in enumerate(zip(reqs, computed, sched, strict=True)):
            draft = batch.draft(i)  # computed after the known tokens (verified below)
            ids.extend(r.all_token_ids[c:c + n - len(draft)])
            ids.extend(draft)
            pos.extend(range(c, c + n))
        positions = torch.tensor(pos)  # (plain lists: cheaper than repeat_interleave here)
        meta = AttentionMetadata.build(computed, sched, [r.block_table for r in reqs],
                                       self.block_size)
        hidden = self.model(torch.tensor(ids), positions, meta, self.kv_cache)  # [T, hidden]
        return self._sample(batch, hidden)

    def _sample(self, batch: ScheduledBatch, hidden: torch.Tensor) -> RunnerOutput:
        """Logits at the last scheduled position of each sampling request (at its last
        1 + len(draft) positions when it speculates), then one sampler call over them all."""
        reqs = batch.requests
        tokens: list[int | None] = [None] * len(reqs)
        logprobs: list[TokenLogprob | None] = [None] * len(reqs)
        # One logits row per sampled position: owner[j] its batch index, offset[j] its
        # position after the request's known tokens, pick[j] its index in hidden's T axis.
        owner: list[int] = []
        offset: list[int] = []
        pick: list[int] = []
        end = 0
        for i, n in enumerate(batch.num_scheduled_tokens):
            end += n
            if batch.samples[i]:
                d = len(batch.draft(i))
                owner += [i] * (d + 1)
                offset += range(d + 1)
                pick += range(end - d - 1, end)
        if not owner:
            return RunnerOutput(tokens, logprobs)
        spec = bool(batch.draft_token_ids)
        out, bad_rows = self._tokens(hidden[pick] if len(pick) < len(hidden) else hidden,
                                     [reqs[i] for i in owner], offset if spec else None)
        samples: list[list[int]] = [[] for _ in reqs] if spec else []
        for j, i in enumerate(owner):
            if offset[j] == 0:
                tokens[i] = out.token_ids[j]
                if out.logprobs is not None:
                    logprobs[i] = out.logprobs[j]
            if spec and batch.draft(i):
                samples[i].append(out.token_ids[j])
        bad = sorted({owner[j] for j in bad_rows})
        for i in bad:
            tokens[i] = logprobs[i] = None
        return RunnerOutput(tokens, logprobs, tuple(bad), tuple(samples))

    def _tokens(self, rows: torch.Tensor, requests: list[Request], offsets: list[int] | None
                ) -> tuple[SamplerOutput, tuple[int, ...]]:
        """One token per hidden row ([N, hidden], row j for requests[j]) and the rows whose
        logits were not finite. When every row's token is the plain argmax, the screened
        head picks it without the logits (the same token); otherwise, or when the screen
        cannot settle a row (non-finite values), the full head and the sampler run."""
        st = None
        screen = self.greedy_head
        if screen is not None and len(rows) <= screen.max_rows:
            st = SamplingTensors.from_requests(requests, screen.vocab_size, offsets)
            if st.plain_greedy and (picked := screen(rows)) is not None:
                self.logits_guard.clean()
                return SamplerOutput(picked, None), ()
        logits = self.model.compute_logits(rows)
        checked = self.logits_guard.check(logits)  # NaN/inf rows: sampled from zeros, dropped
        if st is None:
            st = SamplingTensors.from_requests(requests, checked.logits.shape[1], offsets)
        return self.sampler(checked.logits, st), checked.bad_rows


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (packed MXFP4 blocks, RoPE tables), each
    storage counted once: a tied LM head and its embedding share one."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*module.parameters(), *module.buffers())}
    return sum(storages.values())
