"""Paged attention in plain torch, and the metadata that describes one batch to it.

KV cache layout ("kv layout" in the compatibility hash, `shared.protocol.layout.KV_LAYOUT`):
    one tensor per worker, `kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`,
    where index 0 of dim 1 is K and 1 is V. A token at position p of a sequence lives in block
    `block_table[p // block_size]` at offset `p % block_size`; its flat slot is
    `block_id * block_size + offset`. Blocks of several layers are moved with
    `kv_cache[:, :, block_ids]` (KV transfer), never through Python lists.

A batch is a list of sequences, each contributing `num_scheduled_tokens` new tokens (a prefill
chunk or one decode token) on top of `num_computed_tokens` already in the cache. The new
tokens of all sequences are packed into one flat dimension T (sequence-major).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PaddedViews:
    """The batch as plain-torch attention reads it: padded to [B, Lmax] / [B, Qmax].

    slot_mapping: LongTensor[T], flat cache slot of every new token.
    gather_slots: LongTensor[B, Lmax], flat cache slots of each sequence's whole context
        (computed + new), padded with slot 0.
    query_index: LongTensor[B, Qmax], index into T of each sequence's new tokens, padded with 0.
    query_valid: BoolTensor[B, Qmax], which entries of query_index are real.
    query_pos: LongTensor[B, Qmax], absolute position of each query (padding rows too).
    attn_mask: BoolTensor[B, 1, Qmax, Lmax], True where query i may attend to key j
        (causal within the sequence, and not padding).
    """

    slot_mapping: torch.Tensor
    gather_slots: torch.Tensor
    query_index: torch.Tensor
    query_valid: torch.Tensor
    query_pos: torch.Tensor
    attn_mask: torch.Tensor


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step; built once per step by the model runner.

    block_tables: IntTensor[B, max_blocks] (int32), each sequence's blocks, padded with 0.
    context_lens: IntTensor[B] (int32), computed + new tokens of each sequence.
    query_start: IntTensor[B + 1] (int32), row in T of each sequence's first new token.
    The native paged attention (kernels.dense) reads only these: it walks the block tables
    itself, with no gather and no padding. The plain-torch path reads the PaddedViews
    (slot_mapping, gather_slots, ...), built on first access only, so a native step never
    pays for them.
    Sliding-window layers (ModelConfig.layer_windows) never read keys before their window,
    so a block table may hold any valid id there: the block manager drops blocks that left
    every layer's window and the runner fills their entries with block 0 (see
    shared/engine/block_manager.py).
    """

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start: torch.Tensor
    block_size: int

    @staticmethod
    def build(
        num_computed_tokens: list[int],
        num_scheduled_tokens: list[int],
        block_tables: list[list[int]],
        block_size: int,
    ) -> AttentionMetadata:
        """Three small tensors; the only per-sequence Python work is list padding."""
        b = len(num_scheduled_tokens)
        assert b == len(num_computed_tokens) == len(block_tables) and b > 0
        nblk = max(len(t) for t in block_tables)
        ctx = [c + n for c, n in zip(num_computed_tokens, num_scheduled_tokens, strict=True)]
        starts = [0]
        for n in num_scheduled_tokens:
            starts.append(starts[-1] + n)
        tables = torch.tensor([t + [0] * (nblk - len(t)) for t in block_tables],
                              dtype=torch.int32)
        return AttentionMetadata(
            block_tables=tables.clamp_(min=0),  # dropped blocks (-1) read as block 0
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            query_start=torch.tensor(starts, dtype=torch.int32),
            block_size=block_size,
        )

    @functools.cached_property
    def padded(self) -> PaddedViews:
        """The plain-torch path's views, vectorised over the batch (cached per step)."""
        ctx = self.context_lens.long()  # [B] context length after this step
        starts = self.query_start[:-1].long()  # [B]
        sched = self.query_start[1:].long() - starts  # [B]
        computed = ctx - sched
        b, nblk = self.block_tables.shape
        lmax, qmax = int(ctx.max()), int(sched.max())
        pos = torch.arange(lmax)  # [Lmax]
        blk = self.block_tables.long().gather(
            1, (pos // self.block_size).clamp(max=nblk - 1).expand(b, -1))
        gather_slots = blk * self.block_size + pos % self.block_size  # [B, Lmax]
        key_valid = pos[None, :] < ctx[:, None]  # [B, Lmax]
        gather_slots = torch.where(key_valid, gather_slots, torch.zeros_like(gather_slots))

        q = torch.arange(qmax)  # [Qmax]
        query_valid = q[None, :] < sched[:, None]  # [B, Qmax]
        query_index = torch.where(query_valid, starts[:, None] + q[None, :], 0)
        q_pos = computed[:, None] + q[None, :]  # absolute position of each query
        attn_mask = (pos[None, None, :] <= q_pos[:, :, None]) & key_valid[:, None, :]
        attn_mask = attn_mask & query_valid[:, :, None]
        # Padding query rows attend to key 0 so softmax never sees an all-masked row.
        attn_mask[:, :, 0] |= ~query_valid
        slot_mapping = gather_slots.gather(1, q_pos.clamp(max=lmax - 1))[query_valid]
        return PaddedViews(slot_mapping=slot_mapping, gather_slots=gather_slots,
                           query_index=query_index, query_valid=query_valid, query_pos=q_pos,
                           attn_mask=attn_mask[:, None])

    def attn_mask(self, window: int | None) -> torch.Tensor:
        """The padded views' mask [B, 1, Qmax, Lmax], narrowed to a sliding window of
        `window` keys (HF: query p attends to keys k with p - window < k <= p); cached per
        window, so the layers sharing one window build it once per step. When no context
        exceeds the window the causal mask alone is exact, and is returned as is."""
        views = self.padded
        if window is None or views.gather_slots.shape[1] <= window:  # Lmax = max context
            return views.attn_mask
        masks = self._window_masks
        if window not in masks:
            pos = torch.arange(views.gather_slots.shape[1])  # [Lmax]
            inside = pos[None, None, :] > views.query_pos[:, :, None] - window  # [B, Qmax, Lmax]
            # Padding rows keep key 0 (see padded): each valid row keeps its own position.
            inside[:, :, 0] |= ~views.query_valid
            masks[window] = views.attn_mask & inside[:, None]
        return masks[window]

    @functools.cached_property
    def _window_masks(self) -> dict[int, torch.Tensor]:
        return {}


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, KVH, D], one layer of the cache
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H] float32
) -> torch.Tensor:  # [T, H, D]
    """Write the new K/V into the cache, then attend over each sequence's context: all of it,
    or its last `window` positions up to each query (a sliding-window layer, masked by
    `meta.attn_mask`); `softcap` bounds the scores to (-cap, cap) with tanh before the softmax
    (Gemma 2); `sinks` are one learnt logit per head that joins every softmax's denominator
    but attends to no value (gpt-oss's attention sinks)."""
    kvh, d = k.shape[1], k.shape[2]
    views = meta.padded
    k_flat = kv_layer[0].view(-1, kvh, d)  # [num_slots, KVH, D]
    v_flat = kv_layer[1].view(-1, kvh, d)
    k_flat.index_copy_(0, views.slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, views.slot_mapping, v.to(v_flat.dtype))
    # Attention math runs in fp32 whatever the model dtype: torch's CPU SDPA is several times
    # slower in bf16 than in fp32 at these sizes, and the upcast of [B, Lmax] rows is cheap.
    keys = k_flat[views.gather_slots].float().transpose(1, 2)  # [B, KVH, Lmax, D]
    values = v_flat[views.gather_slots].float().transpose(1, 2)
    queries = q[views.query_index].float().transpose(1, 2)  # [B, H, Qmax, D]
    mask = meta.attn_mask(window)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scale,
            enable_gqa=queries.shape[1] != keys.shape[1],
        )  # [B, H, Qmax, D]
    else:  # SDPA has neither: the scores are materialised, [B, H, Qmax, Lmax]
        out = _materialised(queries, keys, values, mask, scale, softcap, sinks)
    return out.transpose(1, 2)[views.query_valid].to(q.dtype)  # [T, H, D]


def _materialised(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: torch.Tensor, scale: float, softcap: float | None,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention with soft-capped scores and/or sink logits, fp32 [B, H, Qmax, D]."""
    groups = queries.shape[1] // keys.shape[1]
    keys, values = (t.repeat_interleave(groups, dim=1) for t in (keys, values))
    scores = queries @ keys.transpose(-1, -2) * scale  # [B, H, Qmax, Lmax]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return scores.softmax(dim=-1) @ values
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]  # the sink takes mass
    return probs @ values
