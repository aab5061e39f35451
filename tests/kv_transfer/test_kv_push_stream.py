"""Push streams: blocks written as they are reported, before `finish`; restarts after an
epoch change (a preemption) or when the held blocks are not those written; aborts.

The engine is played by the test (KVProgress reports fed by hand), so every ordering here is
explicit: `await stream.flushed()` returns once the decode acknowledged every reported block,
and the decode's cache is inspected right then.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.errors import ApiError
from services.kv_transfer.store import block_major
from shared.engine.kv_stream import KVProgress
from tests.support.kv import (
    BIG,
    FIRST,
    Node,
    assert_no_leaks,
    blocks_of,
    pair,
    prefill_request,
    same_bits,
)

TOKENS = 45  # 12 blocks of 4 tokens, the last one partial


async def opened(p: Node, d: Node, transfer_id: str = "t"):
    stream = p.service.push.prefill.open(transfer_id, TOKENS)
    receive = asyncio.ensure_future(d.service.push.decode.receive(transfer_id, p.address, TOKENS))
    return stream, receive


async def mid_stream(nodes):
    """A paired prefill and decode with a push stream open and its first 4 blocks delivered:
    (prefill, decode, the prefill's block ids, the stream, the decode's receive future)."""
    p, d = await pair(nodes)
    ids = await prefill_request(p, "req", TOKENS)
    stream, receive = await opened(p, d)
    stream.feed(KVProgress("req", tuple(ids[:4]), 0))
    await stream.flushed()
    return p, d, ids, stream, receive


def decode_rows(d: Node, stream, rows: int) -> torch.Tensor:
    """The decode's copy of the first `rows` blocks (its registered blocks, in order)."""
    assert stream.registration is not None
    return blocks_of(d, list(stream.registration.block_ids[:rows]))


@pytest.mark.parametrize("options", [{}, BIG])
async def test_reported_blocks_land_in_the_decode_before_finish(nodes, options) -> None:
    p, d = await pair(nodes, **options)
    ids = await prefill_request(p, "req", TOKENS)
    stream, receive = await opened(p, d)
    n = len(ids)
    for full in sorted({max(1, n // 4), n // 2, n - 1}):  # "engine steps" of chunked prefill
        stream.feed(KVProgress("req", tuple(ids[:full]), 0))
        await stream.flushed()
        assert same_bits(decode_rows(d, stream, full), blocks_of(p, ids[:full]))
    assert not receive.done()  # nothing completes before the prompt is finished
    nbytes = await p.service.push.prefill.send("t", "req", ids, TOKENS, FIRST, stream=stream)
    kv = await receive
    assert same_bits(blocks_of(d, kv.block_ids), blocks_of(p, ids))
    assert (stream.stats.early_blocks, stream.stats.late_blocks) == (n - 1, 1)
    assert nbytes == kv.num_bytes == len(ids) * p.service.ctx.geometry.block_bytes
    await d.store.free(kv.block_ids)
    await assert_no_leaks(p, d)


@pytest.mark.parametrize("final_report", ["blocks", "empty"])
async def test_new_epoch_rewrites_everything(nodes, final_report: str) -> None:
    """Blocks read before a preemption may hold another request's bytes: the engine reports a
    new epoch and the decode must end with the final bytes, not the early ones (whose
    digests, taken as sent, would otherwise match)."""
    p, d = await pair(nodes)
    ids = await prefill_request(p, "req", TOKENS, seed=1)
    final = blocks_of(p, ids)
    p.store.kv_cache.view(-1)[:] = 0  # what was in those blocks before the recompute
    stream, receive = await opened(p, d)
    stream.feed(KVProgress("req", tuple(ids[:5]), 0))
    await stream.flushed()
    assert stream.stats.early_blocks == 0 and stream.stats.num_writes > 0
    block_major(p.store.kv_cache)[torch.tensor(ids)] = final  # recomputed in the same blocks
    report = tuple(ids[:5]) if final_report == "blocks" else ()
    stream.feed(KVProgress("req", report, 1))
    await stream.flushed()
    await p.service.push.prefill.send("t", "req", ids, TOKENS, FIRST, stream=stream)
    kv = await receive
    assert same_bits(blocks_of(d, kv.block_ids), final)
    assert stream.stats.restarts == 1
    await d.store.free(kv.block_ids)
    await assert_no_leaks(p, d)


async def test_held_blocks_other_than_those_written_are_rewritten(nodes) -> None:
    p, d = await pair(nodes)
    early = await p.store.allocate(TOKENS)  # blocks the request had before a preemption
    ids = await prefill_request(p, "req", TOKENS, seed=2)
    stream, receive = await opened(p, d)
    stream.feed(KVProgress("req", tuple(early[:6]), 0))
    await stream.flushed()
    await p.store.free(early)
    await p.service.push.prefill.send("t", "req", ids, TOKENS, FIRST, stream=stream)
    kv = await receive
    assert same_bits(blocks_of(d, kv.block_ids), blocks_of(p, ids))
    assert stream.stats.restarts == 1
    await d.store.free(kv.block_ids)
    await assert_no_leaks(p, d)


async def test_prefill_abort_mid_stream_frees_both_sides(nodes) -> None:
    p, d, ids, stream, receive = await mid_stream(nodes)
    stream.abort("client went away")
    with pytest.raises(ApiError) as err:
        await receive
    assert err.value.code == "kv_push_aborted"
    with pytest.raises(ApiError):
        await stream.task
    await p.store.release_held("req")  # the engine's abort path releases the held blocks
    await assert_no_leaks(p, d)
    assert p.service.push.prefill.streams == {}


async def test_decode_abort_mid_stream_ends_the_stream_at_once(nodes) -> None:
    p, d, ids, stream, receive = await mid_stream(nodes)
    receive.cancel()  # the decode's client went away: it tells the prefill
    with pytest.raises(asyncio.CancelledError):
        await receive
    with pytest.raises(ApiError) as err:
        await asyncio.wait_for(asyncio.shield(stream.task), 5.0)  # not the push deadline
    assert err.value.code == "kv_push_aborted"
    with pytest.raises(ApiError):  # a late finish fails and still releases the held blocks
        await p.service.push.prefill.send("t", "req", ids, TOKENS, FIRST, stream=stream)
    await assert_no_leaks(p, d)


async def test_prefill_shutdown_aborts_open_streams(nodes) -> None:
    p, d, ids, stream, receive = await mid_stream(nodes)
    await p.runner.cleanup()  # the prefill's KV service stops with a stream open
    assert stream.task.done() and p.service.push.prefill.streams == {}
    with pytest.raises(ApiError) as err:
        await asyncio.wait_for(receive, 5.0)  # told at once, not at the push deadline
    assert err.value.code == "kv_push_aborted"
    await assert_no_leaks(d)


async def test_decode_deadline_restarts_with_every_write(nodes) -> None:
    """A long prompt streams for longer than the push deadline in all: the decode keeps
    waiting while writes arrive, and gives up only once the prefill goes quiet that long."""
    p = await nodes("prefill", "push")
    d = await nodes("decode", "push", push_deadline_seconds=0.4)
    ids = await prefill_request(p, "req", TOKENS)
    stream, receive = await opened(p, d)
    for full in range(1, 6):  # 5 x 0.2 s of "compute" = 1 s, more than the 0.4 s deadline
        stream.feed(KVProgress("req", tuple(ids[:full]), 0))
        await stream.flushed()
        await asyncio.sleep(0.2)
        assert not receive.done()
    await p.service.push.prefill.send("t", "req", ids, TOKENS, FIRST, stream=stream)
    kv = await receive
    assert same_bits(blocks_of(d, kv.block_ids), blocks_of(p, ids))
    await d.store.free(kv.block_ids)
    # A prefill leg that never arrives (so nothing keeps the transfer alive) is silent for
    # longer than the deadline: the decode gives up and frees its blocks.
    with pytest.raises(ApiError) as err:
        await d.service.push.decode.receive("t2", p.address, TOKENS)
    assert err.value.code == "kv_push_deadline"
    # Its registration, offered to nobody, is dropped once older than the prefill's ttl.
    registrations = p.service.push.prefill.registrations
    registrations.ttl_s = 0.0
    assert registrations.reap() == 1
    await assert_no_leaks(p, d)


async def test_queued_prompt_outlives_the_decode_deadline(nodes) -> None:
    """The prefill took the registration but its prompt waits in the engine's queue for
    several of the decode's deadlines (long prompts ahead of it): keepalives hold the
    transfer open, and the KV lands intact once the prompt runs."""
    p = await nodes("prefill", "push")
    d = await nodes("decode", "push", push_deadline_seconds=0.3)
    ids = await prefill_request(p, "req", TOKENS)
    stream, receive = await opened(p, d)
    await asyncio.sleep(1.2)  # 4 deadlines with no block computed
    assert not receive.done(), "the decode gave up on a prefill that was alive"
    assert stream.registration is not None and stream.registration.deadline_seconds == 0.3
    await p.service.push.prefill.send("t", "req", ids, TOKENS, FIRST, stream=stream)
    kv = await receive
    assert same_bits(blocks_of(d, kv.block_ids), blocks_of(p, ids))
    await d.store.free(kv.block_ids)
    await assert_no_leaks(p, d)
