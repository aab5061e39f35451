"""Fewer copies: gather slots reused but never overwritten while a transport still holds them,
chunks bit-identical to a plain-torch gather, received pieces placed straight into the cache,
envelopes parsed from reused receive buffers."""

from __future__ import annotations

import asyncio

import torch
import uvloop

from services.kv_transfer.codec import (
    BlockSink,
    BufferPool,
    StagingRing,
    compute_digests,
    iter_chunks,
)
from services.kv_transfer.store import CacheBlocks, block_major
from shared.protocol.codec import EnvelopeReader, FrameReader, frame_header, seal
from shared.protocol.messages import ReleaseRequest, StreamEnd, TensorChunk
from shared.protocol.tensors import row_digests
from tests.support.kv import (
    FIRST,
    SECRET,
    assert_no_leaks,
    prefill_request,
    same_bits,
    small_spec,
    start_node,
)

KIB = 1024


def random_cache(layers: int = 3, blocks: int = 12, bs: int = 4, kvh: int = 2,
                 hd: int = 16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(layers, 2, blocks, bs, kvh, hd, generator=gen).bfloat16()


def test_ring_reuses_a_slot_only_after_done() -> None:
    ring = StagingRing(4 * KIB, torch.bfloat16, slots=2)
    a = ring.take((4, 8))
    b = ring.take((4, 8))  # `a` is not done: another slot
    assert a.data_ptr() != b.data_ptr()
    c = ring.take((4, 8))  # both slots busy: a fresh tensor, never a busy slot
    assert ring.misses == 1 and c.data_ptr() not in (a.data_ptr(), b.data_ptr())
    ring.done()  # the fresh tensor: nothing to free
    ring2 = StagingRing(4 * KIB, torch.bfloat16, slots=2)
    first = ring2.take((16,))
    ring2.done()
    assert ring2.take((16,)).data_ptr() != first.data_ptr()  # round robin: the other slot
    ring2.done()
    assert ring2.take((16,)).data_ptr() == first.data_ptr()  # then back, no allocation
    assert ring2.misses == 0


def test_ring_waits_for_the_transport_to_send_a_slot_bytes() -> None:
    queued = [0]  # what the fake transport still holds, FIFO

    def write(n: int) -> None:
        ring.wrote(n)
        queued[0] += n

    ring = StagingRing(1000, torch.uint8, slots=1, in_transport=lambda: queued[0])
    write(10)  # headers before the first chunk do not matter
    first = ring.take((1000,))
    write(5)  # frame header
    write(1000)  # payload in the transport
    ring.done()
    write(5)  # the next frame header
    queued[0] = 1005  # 10 header bytes left: the payload is still queued entirely
    assert ring.take((1000,)).data_ptr() != first.data_ptr() and ring.misses == 1
    ring.done()  # (the miss)
    queued[0] = 6  # one payload byte and the next header still queued
    assert ring.take((1000,)).data_ptr() != first.data_ptr() and ring.misses == 2
    queued[0] = 5  # every payload byte sent
    assert ring.take((1000,)).data_ptr() == first.data_ptr() and ring.misses == 2


def test_pool_hands_a_slot_to_the_next_transfer_only_once_sent() -> None:
    pool, queued = BufferPool(), [0]
    ring = StagingRing(1000, torch.uint8, slots=1, in_transport=lambda: queued[0], pool=pool)
    slot = ring.take((1000,))
    ring.wrote(1000)
    queued[0] = 1000  # all of it still in the transport when the stream ends
    ring.done()
    ring.close()
    assert pool.get(1000).data_ptr() != slot.data_ptr()  # not ready: a fresh buffer instead
    queued[0] = 0
    again = pool.get(1000)
    assert again.data_ptr() == slot.data_ptr()  # sent: reused, no new allocation
    pool.put(again)  # a receive staging buffer: ready at once
    nxt = StagingRing(1000, torch.uint8, slots=1, pool=pool)
    assert nxt.take((10,)).data_ptr() == slot.data_ptr()
    assert pool.get(999).data_ptr() != slot.data_ptr()  # sizes never mix


def plain_rows(kv: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The oracle: plain advanced indexing of the block-major view."""
    return block_major(kv)[torch.tensor(ids)].contiguous()


def test_chunks_through_a_ring_match_a_plain_gather() -> None:
    kv = random_cache()
    geo = CacheBlocks.of(kv)
    ids = [9, 2, 5, 11, 0, 7, 3]
    block = geo.block_bytes  # 1.5 KiB: half-block chunks split every block in two
    for max_bytes in (block // 2, 2 * block + 100, 64 * KIB):
        ring = StagingRing(max_bytes, kv.dtype, slots=2)
        got = bytearray()
        for out in iter_chunks(kv, ids, geo, max_bytes, ring=ring):
            assert len(out.payload) <= max_bytes
            got += out.payload
            ring.done()
        assert bytes(got) == plain_rows(kv, ids).view(torch.uint8).numpy().tobytes()
        assert ring.misses == 0


def test_digests_through_a_ring_match_row_digests() -> None:
    kv = random_cache()
    geo = CacheBlocks.of(kv)
    ids = [4, 1, 10, 6]
    want = row_digests(plain_rows(kv, ids))
    for max_bytes in (geo.block_bytes // 3, geo.block_bytes * 3):
        assert compute_digests(kv, ids, geo, max_bytes) == want


def test_envelope_reads_from_a_reused_buffer_without_the_bytes_type() -> None:
    msg = ReleaseRequest("engine-1", "req-1", "lease-1")
    envelope = seal("hash", {"f": 1}, msg)
    trailing = bytes(range(256)) * 3
    buf = bytearray(len(envelope) + len(trailing) + 50)  # a pooled buffer, larger than needed
    buf[:len(envelope) + len(trailing)] = envelope + trailing
    for body in (envelope + trailing, memoryview(buf)[:len(envelope) + len(trailing)]):
        reader = EnvelopeReader(body)
        assert reader.compat_hash == "hash"
        assert reader.message(ReleaseRequest) == msg
        assert bytes(reader.trailing()) == trailing


async def transfer_big(mode: str, secret: bytes | None) -> None:
    """Multi-chunk pull or push on uvloop (its transports queue our buffers, not copies)."""
    options = {"spec": small_spec(num_layers=8, num_kv_heads=4, head_dim=64), "block_size": 16,
               "num_blocks": 72, "max_chunk_bytes": 512 * KIB, "secret": secret}
    p = await start_node("prefill", mode, **options)
    d = await start_node("decode", mode, **options)
    try:
        tokens = 64 * 16  # 64 blocks of 128 KiB: 8 MiB in 16 chunks
        ids = await prefill_request(p, "req", tokens, seed=3)
        expected = plain_rows(p.store.kv_cache, ids)
        if mode == "pull":
            params = await p.service.pull.prefill.offer("req", ids, tokens, FIRST)
            kv = await d.service.pull.decode.fetch(params)
        else:
            kv, _ = await asyncio.gather(d.service.push.decode.receive("t1", p.address, tokens),
                                         p.service.push.prefill.send("t1", "req", ids, tokens, FIRST))
        assert same_bits(expected, plain_rows(d.store.kv_cache, kv.block_ids))
        await d.store.free(kv.block_ids)
        await assert_no_leaks(p, d)
    finally:
        await p.runner.cleanup()
        await d.runner.cleanup()


def test_big_pull_on_uvloop_is_bit_exact() -> None:
    uvloop.run(transfer_big("pull", None))


def test_big_push_on_uvloop_is_bit_exact_with_and_without_hmac() -> None:
    uvloop.run(transfer_big("push", None))
    uvloop.run(transfer_big("push", SECRET))  # the HMAC middleware reads the body first


def test_sink_places_odd_pieces_like_a_whole_payload() -> None:
    """Chunks arriving in pieces of any size (run and row boundaries inside pieces) land in
    the cache and digest exactly as the same chunks given whole."""
    src = random_cache()
    geo = CacheBlocks.of(src)
    ids, local = [9, 2, 5, 11, 0], [1, 4, 6, 8, 10]
    want = row_digests(plain_rows(src, ids))
    for max_bytes in (geo.block_bytes // 3, 2 * geo.block_bytes + 100, 64 * KIB):
        for piece in (1, 7, 500, 4096):
            dst = torch.zeros_like(src)
            sink = BlockSink(dst, local, geo)
            for out in iter_chunks(src, ids, geo, max_bytes):
                data = out.payload
                sink.accept(out.header, [data[i:i + piece] for i in range(0, len(data), piece)])
            sink.verify(want)  # fails closed on any misplaced byte
            assert same_bits(plain_rows(dst, local), plain_rows(src, ids))
            others = [b for b in range(geo.num_blocks) if b not in local]
            assert not block_major(dst)[torch.tensor(others)].any()  # nothing else written


async def test_frame_pieces_are_the_payload_without_copies() -> None:
    chunk = TensorChunk("uint8", [64], [0])
    stream = asyncio.StreamReader()
    payload = bytes(range(64))
    stream.feed_data(frame_header(chunk) + payload + frame_header(StreamEnd(1, 64)))
    stream.feed_eof()
    frames = FrameReader(lambda: stream.read(5))
    header, pieces = await frames.next_pieces()
    assert header == chunk and b"".join(pieces) == payload and len(pieces) > 1
    assert (await frames.next_pieces()) == (StreamEnd(1, 64), [])
