"""Paged attention in plain torch, and the metadata that describes one batch to it.

KV cache layout ("kv layout" in the compatibility hash, `KV_LAYOUT`):
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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KV_LAYOUT = "L2NBHD"  # [layers, k/v, blocks, block_size, kv_heads, head_dim]


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step; built once per step by the model runner.

    slot_mapping: LongTensor[T], flat cache slot of every new token.
    gather_slots: LongTensor[B, Lmax], flat cache slots of each sequence's whole context
        (computed + new), padded with slot 0.
    query_index: LongTensor[B, Qmax], index into T of each sequence's new tokens, padded with 0.
    query_valid: BoolTensor[B, Qmax], which entries of query_index are real.
    attn_mask: BoolTensor[B, 1, Qmax, Lmax], True where query i may attend to key j
        (causal within the sequence, and not padding).
    """

    slot_mapping: torch.Tensor
    gather_slots: torch.Tensor
    query_index: torch.Tensor
    query_valid: torch.Tensor
    attn_mask: torch.Tensor

    @staticmethod
    def build(
        num_computed_tokens: list[int],
        num_scheduled_tokens: list[int],
        block_tables: list[list[int]],
        block_size: int,
    ) -> AttentionMetadata:
        """Vectorised over the batch; the only per-sequence Python work is list flattening."""
        b = len(num_scheduled_tokens)
        assert b == len(num_computed_tokens) == len(block_tables) and b > 0
        computed = torch.tensor(num_computed_tokens, dtype=torch.long)
        sched = torch.tensor(num_scheduled_tokens, dtype=torch.long)
        ctx = computed + sched  # [B] context length after this step
        lmax, qmax = int(ctx.max()), int(sched.max())
        nblk = max(len(t) for t in block_tables)
        tables = torch.zeros(b, nblk, dtype=torch.long)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        pos = torch.arange(lmax)  # [Lmax]
        blk = tables.gather(1, (pos // block_size).clamp(max=nblk - 1).expand(b, -1))
        gather_slots = blk * block_size + pos % block_size  # [B, Lmax]
        key_valid = pos[None, :] < ctx[:, None]  # [B, Lmax]
        gather_slots = torch.where(key_valid, gather_slots, torch.zeros_like(gather_slots))

        q = torch.arange(qmax)  # [Qmax]
        query_valid = q[None, :] < sched[:, None]  # [B, Qmax]
        starts = torch.cumsum(sched, 0) - sched  # [B]
        query_index = torch.where(query_valid, starts[:, None] + q[None, :], 0)
        q_pos = computed[:, None] + q[None, :]  # absolute position of each query
        attn_mask = (pos[None, None, :] <= q_pos[:, :, None]) & key_valid[:, None, :]
        attn_mask = attn_mask & query_valid[:, :, None]
        # Padding query rows attend to key 0 so softmax never sees an all-masked row.
        attn_mask[:, :, 0] |= ~query_valid
        slot_mapping = gather_slots.gather(1, q_pos.clamp(max=lmax - 1))[query_valid]
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            gather_slots=gather_slots,
            query_index=query_index,
            query_valid=query_valid,
            attn_mask=attn_mask[:, None],
        )


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, KVH, D], one layer of the cache
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Write the new K/V into the cache, then attend over each sequence's whole context."""
    kvh, d = k.shape[1], k.shape[2]
    k_flat = kv_layer[0].view(-1, kvh, d)  # [num_slots, KVH, D]
    v_flat = kv_layer[1].view(-1, kvh, d)
    k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
    # Attention math runs in fp32 whatever the model dtype: torch's CPU SDPA is several times
    # slower in bf16 than in fp32 at these sizes, and the upcast of [B, Lmax] rows is cheap.
    keys = k_flat[meta.gather_slots].float().transpose(1, 2)  # [B, KVH, Lmax, D]
    values = v_flat[meta.gather_slots].float().transpose(1, 2)
    queries = q[meta.query_index].float().transpose(1, 2)  # [B, H, Qmax, D]
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=meta.attn_mask, scale=scale,
        enable_gqa=queries.shape[1] != keys.shape[1],
    )  # [B, H, Qmax, D]
    return out.transpose(1, 2)[meta.query_valid].to(q.dtype)  # [T, H, D]
