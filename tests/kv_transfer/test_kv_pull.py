"""Pull mode between two in-process KV services: bit-identical blocks, and the fault matrix.

Every test ends with the leak detector: held/allocated blocks back to zero on both sides.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest

from services.common.errors import ApiError
from services.kv_transfer import codec
from services.kv_transfer.codec import BlockSink
from shared.protocol.codec import FrameReader
from shared.protocol.pd import KVTransferParams
from tests.support.clock import FakeClock
from tests.support.kv import (
    FIRST,
    Node,
    assert_no_leaks,
    blocks_of,
    prefill_request,
    same_bits,
    small_spec,
)


async def offered(p: Node, request_id: str = "r1", num_tokens: int = 37
                  ) -> tuple[KVTransferParams, list[int]]:
    ids = await prefill_request(p, request_id, num_tokens, seed=hash(request_id) % 1000)
    return await p.service.pull.prefill.offer(request_id, ids, num_tokens, FIRST), ids


async def failing_fetch(d: Node, params: KVTransferParams, status: int, code: str) -> ApiError:
    with pytest.raises(ApiError) as err:
        await d.service.pull.decode.fetch(params)
    assert (err.value.status, err.value.code) == (status, code), err.value.message
    return err.value


@pytest.mark.parametrize("geometry", [
    {},  # small blocks, many per chunk
    {"spec": small_spec(num_layers=4, num_kv_heads=4, head_dim=64), "block_size": 16,
     "max_chunk_bytes": 4096},  # 64 KiB blocks cut into 4 KiB pieces inside each block
    {"spec": small_spec(num_layers=30, num_kv_heads=3, head_dim=64), "block_size": 16},  # SmolLM2
])
async def test_pull_is_bit_identical_and_releases_both_sides(nodes, geometry) -> None:
    p, d = await nodes("prefill", **geometry), await nodes("decode", **geometry)
    num_tokens = 300 if "spec" in geometry else 37
    params, ids = await offered(p, num_tokens=num_tokens)
    assert p.metric("pdmesh:kv_held_blocks") == len(ids)
    kv = await d.service.pull.decode.fetch(params)
    assert same_bits(blocks_of(p, ids), blocks_of(d, kv.block_ids))
    assert (kv.num_tokens, kv.first_token) == (num_tokens, FIRST)
    assert kv.num_bytes == len(ids) * p.service.ctx.geometry.block_bytes
    labels = {"mode": "pull", "side": "receive"}
    assert d.metric("pdmesh:kv_transfer_bytes_sum", labels) == kv.num_bytes
    assert d.metric("pdmesh:kv_transfer_seconds_count", labels) == 1
    await d.store.free(kv.block_ids)  # what the engine does when the request finishes
    await assert_no_leaks(p, d)


async def test_concurrent_pulls_share_one_handshake(nodes) -> None:
    p, d = await nodes("prefill"), await nodes("decode")
    offers = [await offered(p, f"r{i}", 10 + 7 * i) for i in range(4)]
    kvs = await asyncio.gather(*(d.service.pull.decode.fetch(params) for params, _ in offers))
    for (_, ids), kv in zip(offers, kvs, strict=True):
        assert same_bits(blocks_of(p, ids), blocks_of(d, kv.block_ids))
        await d.store.free(kv.block_ids)
    assert len(p.service.ctx.registry) == 1
    await assert_no_leaks(p, d)


async def test_unknown_request_id_is_404(nodes) -> None:
    p, d = await nodes("prefill"), await nodes("decode")
    params, _ = await offered(p)
    await failing_fetch(d, dataclasses.replace(params, remote_request_id="ghost"), 404,
                        "kv_lease_unknown")
    assert d.metric("pdmesh:kv_failed_transfers_total",
                    {"mode": "pull", "reason": "kv_lease_unknown"}) == 1
    p.service.pull.prefill.abort("r1")
    await assert_no_leaks(p, d)


async def test_out_of_range_block_ids_rejected_before_allocation(nodes) -> None:
    p, d = await nodes("prefill"), await nodes("decode")
    params, ids = await offered(p)
    bad = dataclasses.replace(params, block_ids=[10_000] + ids[1:])
    await failing_fetch(d, bad, 400, "kv_bad_params")
    # The decode rejected before admission and told the prefill: its lease is gone at once.
    await assert_no_leaks(p, d)


async def test_block_ids_not_matching_the_lease_rejected_by_the_prefill(nodes) -> None:
    p, d = await nodes("prefill"), await nodes("decode")
    params, ids = await offered(p)
    other = [b for b in range(p.store.geometry.num_blocks) if b not in ids][: len(ids)]
    bad = dataclasses.replace(params, block_ids=other)
    await failing_fetch(d, bad, 400, "kv_block_ids_mismatch")
    p.service.pull.prefill.abort("r1")  # the decode's release named blocks of no lease: still held
    await assert_no_leaks(p, d)


async def test_stale_params_after_release_are_410(nodes) -> None:
    p, d = await nodes("prefill"), await nodes("decode")
    params, _ = await offered(p)
    kv = await d.service.pull.decode.fetch(params)
    await d.service.ctx.drain()  # the release goes out in the background
    await failing_fetch(d, params, 410, "kv_lease_released")
    assert p.service.pull.prefill.abort("r1") is False  # abort after a finished transfer: harmless
    await d.store.free(kv.block_ids)
    await assert_no_leaks(p, d)


async def test_lease_expired_before_the_pull_is_410(nodes) -> None:
    clock = FakeClock()  # the prefill's lease table reads it: time moves, nobody sleeps
    p, d = await nodes("prefill", lease_seconds=30.0, clock=clock), await nodes("decode")
    params, _ = await offered(p)
    clock.advance(30.0)  # the lease ran out (expires <= now)
    await failing_fetch(d, params, 410, "kv_lease_expired")
    await assert_no_leaks(p, d)
    assert p.metric("pdmesh:kv_expired_leases_total") == 1


async def test_heartbeats_keep_a_waiting_lease_alive(nodes) -> None:
    p = await nodes("prefill", lease_seconds=1.2)
    d = await nodes("decode", lease_seconds=1.2)  # heartbeat every 0.2 s, extending by 0.8 s
    tracked, _ = await offered(p, "tracked")
    untracked, _ = await offered(p, "untracked")
    d.service.pull.decode.track(tracked)  # the decode accepted it; it waits in its queue
    await asyncio.sleep(2.0)
    kv = await d.service.pull.decode.fetch(tracked)
    d.service.pull.decode.untrack(tracked)
    await failing_fetch(d, untracked, 410, "kv_lease_expired")
    await d.store.free(kv.block_ids)
    await assert_no_leaks(p, d)


async def test_peer_unreachable_is_502(nodes) -> None:
    p, d = await nodes("prefill"), await nodes("decode")
    params, _ = await offered(p)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # closed when the block ends: nobody listens
    await failing_fetch(d, dataclasses.replace(params, remote_port=dead_port), 502,
                        "kv_peer_unreachable")
    p.service.pull.prefill.abort("r1")
    await assert_no_leaks(p, d)


async def test_digest_mismatch_fails_closed(nodes) -> None:
    p, d = await nodes("prefill"), await nodes("decode")
    params, ids = await offered(p)
    # The prefill's block changed after it was leased (the freed-and-reused race upstream).
    p.store.kv_cache[:, :, ids[3]] += 1
    err = await failing_fetch(d, params, 502, "kv_digest_mismatch")
    assert "1 block(s)" in err.message
    await assert_no_leaks(p, d)
    tampered, _ = await offered(p, "r2")
    tampered = dataclasses.replace(tampered, digests=["0" * 32] + tampered.digests[1:])
    await failing_fetch(d, tampered, 502, "kv_digest_mismatch")
    await assert_no_leaks(p, d)


async def test_lease_ending_mid_stream_sends_410_not_bytes(nodes, monkeypatch) -> None:
    p = await nodes("prefill", max_chunk_bytes=4096)
    d = await nodes("decode", max_chunk_bytes=4096)
    params, _ = await offered(p, num_tokens=64)  # 16 KiB: four chunks
    gathers, accepted = [], []
    real_gather, real_accept = codec.gather, BlockSink.accept

    def gather_then_abort(*args):
        gathers.append(1)
        out = real_gather(*args)
        if len(gathers) == 2:  # e.g. the client disconnected from the prefill leg
            p.service.pull.prefill.abort("r1")
        return out

    def counting_accept(self, chunk, payload):
        accepted.append(chunk)
        real_accept(self, chunk, payload)

    monkeypatch.setattr(codec, "gather", gather_then_abort)
    monkeypatch.setattr(BlockSink, "accept", counting_accept)
    await failing_fetch(d, params, 410, "kv_lease_released")
    assert len(gathers) == len(accepted) == 2  # no block was read after the lease ended
    await assert_no_leaks(p, d)


async def test_decode_cancelled_mid_pull_frees_and_releases(nodes, monkeypatch) -> None:
    p = await nodes("prefill", max_chunk_bytes=4096)
    d = await nodes("decode", max_chunk_bytes=4096)
    params, _ = await offered(p, num_tokens=64)  # four chunks
    real, frames, stalled = FrameReader.next_pieces, [], asyncio.Event()

    async def read_then_stall(self):
        frames.append(await real(self))
        if len(frames) == 2:  # one chunk written into local blocks, more to come
            stalled.set()
            await asyncio.Event().wait()
        return frames[-1]

    monkeypatch.setattr(FrameReader, "next_pieces", read_then_stall)
    task = asyncio.ensure_future(d.service.pull.decode.fetch(params))
    await stalled.wait()
    assert d.store.blocks_in_use == 16
    task.cancel()  # the decode request is aborted mid-transfer
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_no_leaks(p, d)
