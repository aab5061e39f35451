"""Moving a list of KV blocks as wire chunks: the sending side's chunks, the receiving sink.

Both sides see the blocks of one request as the block-major tensor
`[n, num_layers, 2, block_size, kv_heads, head_dim]` (row i = block i of the request) and cut
it with shared.protocol.tensors.plan_boxes, so every chunk is at most `max_bytes`, whole blocks
when a block fits, and the receiver can digest each block as it lands.

Copies and digests run inline on the event loop: per 4 MiB chunk a gather, a scatter and an
XXH3 digest cost well under a millisecond each, less than handing the chunk to a thread and
back (GIL switches). Being synchronous, a chunk is either fully written or not at all when
the transfer is cancelled, so blocks can be freed right away on any failure path.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from services.kv_transfer.errors import BadGatewayError
from services.kv_transfer.store import KVGeometry, gather, scatter
from shared.protocol.codec import ProtocolError
from shared.protocol.messages import TensorChunk
from shared.protocol.tensors import Box, RowDigester, check_box, from_raw, plan_boxes, raw_bytes


def request_shape(geometry: KVGeometry, num_blocks: int) -> tuple[int, ...]:
    return (num_blocks,) + geometry.block_shape


def plan(geometry: KVGeometry, num_blocks: int, max_bytes: int) -> list[Box]:
    return list(plan_boxes(request_shape(geometry, num_blocks), geometry.itemsize, max_bytes))


@dataclass(frozen=True)
class OutChunk:
    """One gathered chunk: its header, the tensor that owns the bytes, and a view of them."""

    header: TensorChunk
    data: torch.Tensor
    payload: memoryview


def iter_chunk_headers(geometry: KVGeometry, num_blocks: int, max_bytes: int,
                       first_row: int = 0) -> Iterator[TensorChunk]:
    """The headers `iter_chunks` yields, without touching any block (sizes known upfront).

    `first_row` shifts the boxes: the blocks are rows [first_row, first_row + num_blocks)
    of the request (a push stream sends a request's blocks in several ranges)."""
    for box in plan(geometry, num_blocks, max_bytes):
        offset = [box.offset[0] + first_row, *box.offset[1:]]
        yield TensorChunk(geometry.dtype, list(box.shape), offset)


def iter_chunks(kv_cache: torch.Tensor, block_ids: list[int], geometry: KVGeometry,
                max_bytes: int, digester: RowDigester | None = None,
                first_row: int = 0) -> Iterator[OutChunk]:
    """The chunks of `block_ids` (request rows from `first_row` on) in order, each gathered
    (one copy) only when asked for.

    Lazy on purpose: a caller that checks its lease before taking the next chunk never reads
    a block after the lease ended.
    """
    ids = torch.tensor(block_ids, dtype=torch.long)
    for header in iter_chunk_headers(geometry, len(block_ids), max_bytes, first_row):
        box = Box(tuple(header.offset), tuple(header.shape))
        local = Box((box.offset[0] - first_row,) + box.offset[1:], box.shape)
        data = gather(kv_cache, ids, local)
        payload = raw_bytes(data)
        if digester is not None:
            digester.feed(box, payload)
        yield OutChunk(header, data, payload)


def compute_digests(kv_cache: torch.Tensor, block_ids: list[int], geometry: KVGeometry,
                    max_bytes: int) -> list[str]:
    """Digest of every block, chunk by chunk (bounded memory); fine to run in a thread."""
    digester = RowDigester(len(block_ids), geometry.block_shape, geometry.itemsize)
    for _ in iter_chunks(kv_cache, block_ids, geometry, max_bytes, digester):
        pass
    assert all(d is not None for d in digester.digests)
    return [d for d in digester.digests if d is not None]


class BlockSink:
    """Receives chunks for `block_ids` (local, pre-allocated) and writes them into the cache.

    Every chunk is validated (dtype, rank, box inside the request, pieces of a block in order)
    before it touches the cache, so a hostile or confused sender can only write into this
    request's own blocks. `verify` fails closed: any block missing or differing from its
    digest raises 502.
    """

    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int], geometry: KVGeometry) -> None:
        self._kv = kv_cache
        self._ids = torch.tensor(block_ids, dtype=torch.long)
        self._geometry = geometry
        self._shape = request_shape(geometry, len(block_ids))
        self._digester = RowDigester(len(block_ids), geometry.block_shape, geometry.itemsize)
        self.num_chunks = 0
        self.num_bytes = 0

    def accept(self, chunk: TensorChunk, payload: bytes | memoryview) -> None:
        try:
            box = check_box(chunk, self._shape, self._geometry.dtype)
            data = from_raw(payload, chunk.dtype, chunk.shape)
            self._digester.feed(box, payload)
        except ProtocolError as exc:
            raise BadGatewayError(f"bad KV chunk from peer: {exc}", code="kv_bad_chunk") from None
        scatter(self._kv, self._ids, box, data)
        self.num_chunks += 1
        self.num_bytes += len(payload)

    def verify(self, expected: list[str]) -> None:
        try:
            bad = self._digester.mismatches(expected)
        except ProtocolError as exc:
            raise BadGatewayError(f"KV digest check impossible: {exc}",
                                  code="kv_digest_mismatch") from None
        if bad:
            missing = sum(1 for i in bad if self._digester.digests[i] is None)
            raise BadGatewayError(
                f"KV digest mismatch on {len(bad) - missing} block(s) and {missing} block(s) "
                f"never received, of {len(expected)} (first bad index {bad[0]}); blocks dropped",
                code="kv_digest_mismatch")
