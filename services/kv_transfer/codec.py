"""Moving a list of KV blocks as wire chunks: the sending side's chunks, the receiving sink.

Both sides see the blocks of one request as the block-major tensor
`[n, num_layers, 2, block_size, kv_heads, head_dim]` (row i = block i of the request) and cut
it with shared.protocol.tensors.plan_boxes, so every chunk is at most `max_bytes`, whole blocks
when a block fits, and the receiver can digest each block as it lands.

Copies and digests run inline on the event loop: per 4 MiB chunk a gather, a scatter and an
XXH3 digest cost well under a millisecond each, less than handing the chunk to a thread and
back (GIL switches). Being synchronous, a chunk is either fully written or not at all when
the transfer is cancelled, so blocks can be freed right away on any failure path.

Senders gather into a `StagingRing` of buffers kept in a service-wide `BufferPool` rather than
into a fresh tensor per chunk: a fresh 4 MiB allocation is often mmapped by glibc, so it
page-faults (and the kernel zeroes it) page by page; up to ~3,000 faults per 44 MiB KV were
measured on each side, none once the buffers are reused. The receiving `BlockSink` takes a
payload as the pieces the socket delivered and places each piece straight into the cache
(`_place`), so a received byte is copied once by us, not into a staging buffer and then again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from services.common.errors import BadGatewayError
from services.kv_transfer.store import CacheBlocks, gather, scatter
from shared.protocol.codec import ProtocolError
from shared.protocol.messages import TensorChunk
from shared.protocol.tensors import Box, RowDigester, check_box, from_raw, plan_boxes, raw_bytes


def request_shape(geometry: CacheBlocks, num_blocks: int) -> tuple[int, ...]:
    return (num_blocks,) + geometry.block_shape


def plan(geometry: CacheBlocks, num_blocks: int, max_bytes: int) -> list[Box]:
    return list(plan_boxes(request_shape(geometry, num_blocks), geometry.itemsize, max_bytes))


@dataclass(frozen=True)
class OutChunk:
    """One gathered chunk: its header, the tensor that owns the bytes, and a view of them."""

    header: TensorChunk
    data: torch.Tensor
    payload: memoryview


def iter_chunk_headers(geometry: CacheBlocks, num_blocks: int, max_bytes: int,
                       first_row: int = 0) -> Iterator[TensorChunk]:
    """The headers `iter_chunks` yields, without touching any block (sizes known upfront).

    `first_row` shifts the boxes: the blocks are rows [first_row, first_row + num_blocks)
    of the request (a push stream sends a request's blocks in several ranges)."""
    for box in plan(geometry, num_blocks, max_bytes):
        offset = [box.offset[0] + first_row, *box.offset[1:]]
        yield TensorChunk(geometry.dtype_name, list(box.shape), offset)


class BufferPool:
    """Byte buffers kept across transfers (gather slots, receive staging), one per service.

    A fresh 4 MiB buffer per transfer costs ~1,000 page faults (the kernel zeroes each page),
    several ms per 44 MiB KV. A buffer comes back with a `ready` test: a gather slot whose
    bytes a transport may still be sending is handed out again only once that test passes
    (an unready one is skipped, never waited for). At most `keep` buffers are kept.
    """

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._free: list[tuple[torch.Tensor, Callable[[], bool]]] = []

    def get(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of exactly `nbytes`, reused when one is free and ready."""
        for i, (buf, ready) in enumerate(self._free):
            if buf.numel() == nbytes and ready():
                del self._free[i]
                return buf
        return torch.empty(nbytes, dtype=torch.uint8)

    def put(self, buf: torch.Tensor, ready: Callable[[], bool] | None = None) -> None:
        if self._keep == 0:
            return
        if len(self._free) >= self._keep:
            self._free.pop(0)  # dropped: our reference only, a transport keeps its own
        self._free.append((buf, ready or _always))


def _always() -> bool:
    return True


class StagingRing:
    """A few reusable gather buffers for one sender, never overwritten while still in use.

    `take(shape)` hands out a free slot (or, when none is free, a fresh tensor: slower, never
    unsafe). A slot is busy from `take` until `done()`, which the caller invokes once the
    chunk's payload has been handed to the transport (pull) or acknowledged by the peer (push).
    With `in_transport` (the transport's `get_write_buffer_size`), a done slot is reused only
    once the transport no longer holds any of its bytes: uvloop queues the caller's memoryview
    itself, not a copy. The transport is FIFO, so the slot's bytes are gone when no more than
    the bytes written after them are still queued. A caller reports every byte it writes to
    that transport with `wrote(n)`, in order; bytes written before the first `wrote` (HTTP
    headers) do not matter, they leave first. `close()` returns the slots to `pool` with that
    same test (bytes written later on the connection only make it stricter).
    """

    def __init__(self, max_bytes: int, dtype: torch.dtype, slots: int = 2,
                 in_transport: Callable[[], int] | None = None,
                 pool: BufferPool | None = None) -> None:
        self._numel = max(1, max_bytes // dtype.itemsize)
        self._dtype = dtype
        self._bufs: list[torch.Tensor | None] = [None] * slots  # uint8, got on first use
        self._ends: list[int | None] = [0] * slots  # written position after the slot's
        # payload; None while the slot is handed out and its payload not yet written
        self._in_transport = in_transport
        self._pool = pool or BufferPool(keep=0)
        self._written = 0
        self._last: int | None = None
        self._next = 0
        self.misses = 0  # fresh tensors handed out because no slot was free

    def _free(self, slot: int) -> bool:
        end = self._ends[slot]
        if end is None:
            return False
        return self._in_transport is None or self._in_transport() <= self._written - end

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        slots = len(self._bufs)
        slot = next((i % slots for i in range(self._next, self._next + slots)
                     if self._free(i % slots)), None)
        if slot is None or numel > self._numel:
            self.misses += 1
            self._last = None
            return torch.empty(shape, dtype=self._dtype)
        buf = self._bufs[slot]
        if buf is None:
            buf = self._bufs[slot] = self._pool.get(self._numel * self._dtype.itemsize)
        self._ends[slot], self._last, self._next = None, slot, slot + 1
        return buf.view(self._dtype)[:numel].view(shape)

    def wrote(self, nbytes: int) -> None:
        self._written += nbytes

    def done(self) -> None:
        """The chunk last taken has been written (its bytes are behind all `wrote` so far)."""
        if self._last is not None:
            self._ends[self._last] = self._written
            self._last = None

    def close(self) -> None:
        """Give the slots back to the pool; a slot never marked done is dropped."""
        in_transport, written = self._in_transport, self._written
        for buf, end in zip(self._bufs, self._ends, strict=True):
            if buf is None or end is None:
                continue
            if in_transport is None:
                self._pool.put(buf)
            else:
                self._pool.put(buf, _drained_to(in_transport, written - end))
        self._bufs = [None] * len(self._bufs)


def _drained_to(in_transport: Callable[[], int], left: int) -> Callable[[], bool]:
    """A BufferPool ready test: the transport holds at most `left` bytes."""
    return lambda: in_transport() <= left


def iter_chunks(kv_cache: torch.Tensor, block_ids: list[int], geometry: CacheBlocks,
                max_bytes: int, digester: RowDigester | None = None,
                first_row: int = 0, ring: StagingRing | None = None) -> Iterator[OutChunk]:
    """The chunks of `block_ids` (request rows from `first_row` on) in order, each gathered
    (one copy) only when asked for, into `ring` when given (see StagingRing: the caller calls
    `ring.done()` after using each chunk, or its slot is never reused).

    Lazy on purpose: a caller that checks its lease before taking the next chunk never reads
    a block after the lease ended.
    """
    ids = torch.tensor(block_ids, dtype=torch.long)
    for header in iter_chunk_headers(geometry, len(block_ids), max_bytes, first_row):
        box = Box(tuple(header.offset), tuple(header.shape))
        local = Box((box.offset[0] - first_row,) + box.offset[1:], box.shape)
        data = gather(kv_cache, ids, local, ring.take(box.shape) if ring else None)
        payload = raw_bytes(data)
        if digester is not None:
            digester.feed(box, payload)
        yield OutChunk(header, data, payload)


def compute_digests(kv_cache: torch.Tensor, block_ids: list[int], geometry: CacheBlocks,
                    max_bytes: int) -> list[str]:
    """Digest of every block, chunk by chunk (bounded memory); fine to run in a thread."""
    digester = RowDigester(len(block_ids), geometry.block_shape, geometry.itemsize)
    # Each chunk is digested at once: one slot. No shared pool: this runs in a thread.
    ring = StagingRing(max_bytes, kv_cache.dtype, slots=1)
    for _ in iter_chunks(kv_cache, block_ids, geometry, max_bytes, digester, ring=ring):
        ring.done()
    assert all(d is not None for d in digester.digests)
    return [d for d in digester.digests if d is not None]


class BlockSink:
    """Receives chunks for `block_ids` (local, pre-allocated) and writes them into the cache.

    Every chunk is validated (dtype, rank, box inside the request, pieces of a block in order)
    before it touches the cache, so a hostile or confused sender can only write into this
    request's own blocks. `verify` fails closed: any block missing or differing from its
    digest raises 502.
    """

    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int], geometry: CacheBlocks) -> None:
        self._kv = kv_cache
        self._block_ids = list(block_ids)
        self._ids = torch.tensor(block_ids, dtype=torch.long)
        self._geometry = geometry
        self._shape = request_shape(geometry, len(block_ids))
        self._digester = RowDigester(len(block_ids), geometry.block_shape, geometry.itemsize)
        self._runs = _runs_view(kv_cache)
        self.num_chunks = 0
        self.num_bytes = 0

    def accept(self, chunk: TensorChunk, payload: bytes | memoryview | list[memoryview]) -> None:
        """Validate, digest and place one chunk; `payload` whole, or as the pieces it arrived
        in (placed piece by piece: no copy into a staging buffer first)."""
        pieces = payload if isinstance(payload, list) else [memoryview(payload)]
        nbytes = sum(len(p) for p in pieces)
        try:
            box = check_box(chunk, self._shape, self._geometry.dtype_name)
            if nbytes != math.prod(chunk.shape) * self._geometry.itemsize:
                raise ProtocolError(f"payload of {nbytes} bytes does not match "
                                    f"{chunk.dtype}{list(chunk.shape)}")
            self._digester.feed(box, pieces)
        except ProtocolError as exc:
            raise BadGatewayError(f"bad KV chunk from peer: {exc}", code="kv_bad_chunk") from None
        if len(pieces) == 1 or self._runs is None:
            data = from_raw(b"".join(pieces) if len(pieces) > 1 else pieces[0], chunk.dtype,
                            chunk.shape)
            scatter(self._kv, self._ids, box, data)
        else:
            row_offset = sum(o * s for o, s in zip(box.offset[1:], _strides(self._shape[1:],
                             self._geometry.itemsize), strict=True))
            _place(self._runs, self._block_ids, box.offset[0], row_offset, pieces)
        self.num_chunks += 1
        self.num_bytes += nbytes

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


def _strides(row_shape: tuple[int, ...], itemsize: int) -> list[int]:
    """Byte stride of each dimension of a C-contiguous row."""
    return [math.prod(row_shape[d + 1:]) * itemsize for d in range(len(row_shape))]


def _runs_view(kv_cache: torch.Tensor) -> np.ndarray | None:
    """The cache's bytes as `[L * 2, N, run]`, run = one block's bytes of one layer's K or V
    (block_size * kv_heads * head_dim * itemsize, contiguous in the cache). A block-major row
    is its L * 2 runs in order, so any byte range of the request maps to a few run slices.
    None for a non-contiguous cache (the caller then joins and scatters instead)."""
    if not kv_cache.is_contiguous():
        return None
    layers, two, blocks = kv_cache.shape[:3]
    return kv_cache.view(torch.uint8).reshape(layers * two, blocks, -1).numpy()


def _place(runs: np.ndarray, block_ids: list[int], row: int, offset: int,
           pieces: list[memoryview]) -> None:
    """Copy `pieces` (consecutive bytes of the request's block-major stream, starting at byte
    `offset` of row `row`) into their runs: per piece, a partial run, whole runs as one 2-D
    copy, and a partial run, split at row ends."""
    run = runs.shape[2]
    row_bytes = runs.shape[0] * run
    for piece in pieces:
        src = np.frombuffer(piece, dtype=np.uint8)
        while src.size:
            block, r, o = block_ids[row], offset // run, offset % run
            take = min(src.size, row_bytes - offset)
            seg, src = src[:take], src[take:]
            if o:  # finish a run begun by the previous piece
                k = min(take, run - o)
                runs[r, block, o:o + k] = seg[:k]
                seg, r = seg[k:], r + 1
            full = seg.size // run
            if full:
                runs[r:r + full, block, :] = seg[:full * run].reshape(full, run)
                seg, r = seg[full * run:], r + full
            if seg.size:
                runs[r, block, :seg.size] = seg
            offset += take
            if offset == row_bytes:
                row, offset = row + 1, 0
