"""Test helpers for model tests.

`PagedRunner` plays the engine's part just enough to exercise the model: it gives every
sequence a scrambled block table (so paging bugs cannot hide behind contiguous slots),
tracks computed tokens, and builds `AttentionMetadata` for each mixed batch.
"""

from __future__ import annotations

import torch

from shared.model.attention import AttentionMetadata
from shared.model.llama import LlamaForCausalLM


class PagedRunner:
    """Runs batches of (sequence id, new token ids) through a model over a paged KV cache."""

    def __init__(self, model: LlamaForCausalLM, block_size: int = 4, num_blocks: int = 96,
                 seed: int = 0) -> None:
        cfg = model.config
        self.model, self.block_size = model, block_size
        self.kv_cache = torch.zeros(model.num_local_layers, 2, num_blocks, block_size,
                                    cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
        # Hand out blocks in a fixed random order, never block 0 (the padding slot).
        self._free = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))
        self._free = (self._free + 1).tolist()
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def _reserve(self, seq: str, total: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < total:
            table.append(self._free.pop())
        return table

    def step(self, batch: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
        """One forward over all new tokens; returns fp32 logits [n_new, vocab] per sequence."""
        computed = [self.computed.get(seq, 0) for seq, _ in batch]
        sched = [len(ids) for _, ids in batch]
        tables = [self._reserve(seq, c + n) for (seq, _), c, n in zip(batch, computed, sched, strict=True)]
        meta = AttentionMetadata.build(computed, sched, tables, self.block_size)
        ids = torch.tensor([t for _, new in batch for t in new], dtype=torch.long)
        positions = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, sched, strict=True)])
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(ids, positions, meta, self.kv_cache))
        out, start = {}, 0
        for (seq, _), c, n in zip(batch, computed, sched, strict=True):
            out[seq] = logits[start:start + n]
            self.computed[seq] = c + n
            start += n
        return out

    def greedy(self, seq: str, prompt: list[int], max_new_tokens: int,
               ) -> tuple[list[int], list[torch.Tensor]]:
        """Prefill `prompt` then decode greedily; returns (new tokens, logits of each step)."""
        logits = self.step([(seq, prompt)])[seq][-1]
        tokens, steps = [], []
        for _ in range(max_new_tokens):
            steps.append(logits)
            tokens.append(int(logits.argmax()))
            logits = self.step([(seq, [tokens[-1]])])[seq][-1]
        return tokens, steps


def random_ids(n: int, seed: int) -> list[int]:
    """n token ids, avoiding the special ids below 17 that SmolLM2 reserves."""
    return torch.randint(17, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
