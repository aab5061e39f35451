"""The engine-side capability the KV service needs, and block I/O on the real cache layout.

`KVBlockStore` is the narrow interface: the cache tensor
`kv_cache[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]` (shared.model.attention)
plus allocation calls that must run on the engine thread (hence async). Block data moves
through the *block-major* view `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`
of that tensor, so one block's bytes across layers are contiguous on the wire and a digest is
computed per block without a copy. `gather` and `scatter` each make exactly one copy.

Two implementations: `InMemoryBlockStore` (the same contract without an engine: tests,
benchmark) and `EngineBlockStore`, over a real engine's KV connector
(shared.engine.kv_connector), whose calls run on the engine thread between steps. A worker
builds the latter as
    store = EngineBlockStore(engine.kv_connector, await engine.kv_connector.cache_view())
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from shared.engine.kv_connector import AsyncKVConnector, KVCacheView
from shared.engine.runner import KVGeometry
from shared.protocol.tensors import Box, dtype_name


class KVBlockStore(Protocol):
    """What the KV service needs from an engine (a worker adapts its AsyncEngine to this).

    Reading and writing `kv_cache` happens on the event loop thread and is safe because the
    blocks involved are either held (the engine never writes them) or freshly allocated (the
    engine does not know them until the request is added with them).
    """

    @property
    def kv_cache(self) -> torch.Tensor: ...

    async def allocate(self, num_tokens: int) -> list[int] | None:
        """Blocks for `num_tokens` tokens, owned by the caller; None when the cache is full."""

    async def free(self, block_ids: list[int]) -> None:
        """Return blocks obtained from `allocate`."""

    async def release_held(self, request_id: str) -> None:
        """Free the blocks the engine kept for a finished request (hold_kv=True)."""


@dataclass(frozen=True)
class CacheBlocks:
    """A cache tensor as the KV service moves it: the engine's `KVGeometry` (what one block
    holds) and how many blocks the tensor has. Derived from the tensor, never configured
    separately, so it cannot disagree with the cache it describes."""

    geometry: KVGeometry
    num_blocks: int

    @staticmethod
    def of(kv_cache: torch.Tensor) -> CacheBlocks:
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(f"not a [L, 2, N, bs, kvh, hd] KV cache: {tuple(kv_cache.shape)}")
        layers, _, blocks, bs, kvh, hd = kv_cache.shape
        geometry = KVGeometry(num_layers=layers, num_kv_heads=kvh, head_dim=hd, block_size=bs,
                              dtype=kv_cache.dtype)
        return CacheBlocks(geometry, blocks)

    @property
    def block_size(self) -> int:
        return self.geometry.block_size

    @property
    def dtype_name(self) -> str:
        """The cache dtype as the wire names it (TensorChunk.dtype, ModelKVSpec.kv_dtype)."""
        return dtype_name(self.geometry.dtype)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block in the block-major view: [L, 2, bs, kvh, hd]."""
        g = self.geometry
        return (g.num_layers, 2, g.block_size, g.num_kv_heads, g.head_dim)

    @property
    def itemsize(self) -> int:
        return self.geometry.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.geometry.bytes_per_block

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)


def block_major(kv_cache: torch.Tensor) -> torch.Tensor:
    """[L, 2, N, bs, kvh, hd] -> a [N, L, 2, bs, kvh, hd] view of the same storage."""
    return kv_cache.permute(2, 0, 1, 3, 4, 5)


def gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, box: Box,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy box `box` of the block-major gather of `block_ids` (rows index into block_ids).

    The result is contiguous, ready for shared.protocol.tensors.raw_bytes. `out` (contiguous,
    `box.shape`, the cache's dtype) is written instead of a fresh tensor when given: senders
    pass a reused staging buffer, since a fresh 4 MiB tensor page-faults on every chunk.
    """
    rows = block_ids[box.offset[0]: box.offset[0] + box.shape[0]].tolist()
    view, inner = block_major(kv_cache), box.slices()[1:]
    if out is None:
        out = torch.empty(box.shape, dtype=kv_cache.dtype)  # [rows, ...box], one copy in all
    assert tuple(out.shape) == tuple(box.shape) and out.is_contiguous()
    for j, block in enumerate(rows):  # per block: ~2x faster than index_select on the view
        out[j].copy_(view[block][inner])
    return out


def scatter(kv_cache: torch.Tensor, block_ids: torch.Tensor, box: Box, data: torch.Tensor) -> None:
    """Write `data` (box `box` of the block-major layout) into blocks `block_ids[rows]`.

    One strided copy per block: about 4x faster than index_copy_ on the permuted view, and the
    loop is short (a chunk holds at most a few dozen blocks).
    """
    rows = block_ids[box.offset[0]: box.offset[0] + box.shape[0]].tolist()
    view, inner = block_major(kv_cache), box.slices()[1:]
    for j, block in enumerate(rows):
        view[block][inner].copy_(data[j])  # a view of kv_cache: lands in its storage


class InMemoryBlockStore:
    """A KVBlockStore over its own tensor: a free list, an allocated set, a held table.

    `hold(request_id, block_ids)` plays the engine finishing a request with hold_kv=True.
    `blocks_in_use` is the leak detector: allocated plus held blocks.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.bfloat16) -> None:
        self._kv = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                               dtype=dtype)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._allocated: set[int] = set()
        self._held: dict[str, list[int]] = {}

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._kv

    @property
    def geometry(self) -> CacheBlocks:
        return CacheBlocks.of(self._kv)

    @property
    def blocks_in_use(self) -> int:
        return len(self._allocated) + sum(len(b) for b in self._held.values())

    @property
    def held_blocks(self) -> int:
        return sum(len(b) for b in self._held.values())

    async def allocate(self, num_tokens: int) -> list[int] | None:
        n = self.geometry.blocks_for(num_tokens)
        if num_tokens < 1 or n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        self._allocated.update(ids)
        return ids

    async def free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if b not in self._allocated:
                raise ValueError(f"block {b} is not allocated")
        self._allocated.difference_update(block_ids)
        self._free.extend(block_ids)

    def hold(self, request_id: str, block_ids: list[int]) -> None:
        if not self._allocated.issuperset(block_ids):
            raise ValueError("only allocated blocks can be held")
        self._allocated.difference_update(block_ids)
        self._held[request_id] = list(block_ids)

    async def release_held(self, request_id: str) -> None:
        self._free.extend(self._held.pop(request_id, []))


# ---- engine adapter ------------------------------------------------------------------


class EngineBlockStore:
    """The KVBlockStore protocol over a running engine's KV connector (its `allocate` is
    cancellation-safe: see AsyncKVConnector)."""

    def __init__(self, connector: AsyncKVConnector, view: KVCacheView) -> None:
        self._connector = connector
        self._kv = view.kv_cache

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._kv

    async def allocate(self, num_tokens: int) -> list[int] | None:
        return await self._connector.allocate(num_tokens)

    async def free(self, block_ids: list[int]) -> None:
        await self._connector.free(block_ids)

    async def release_held(self, request_id: str) -> None:
        await self._connector.release_held(request_id)
