"""Push mode: the rendezvous in both arrival orders, deadlines, aborts in both directions."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.errors import ApiError
from services.kv_transfer.push import Rendezvous
from tests.support.kv import (
    BIG,
    FIRST,
    assert_no_leaks,
    blocks_of,
    pair,
    prefill_request,
    same_bits,
)


async def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("options", [{}, BIG])
@pytest.mark.parametrize("decode_first", [True, False])
async def test_push_in_either_arrival_order(nodes, options, decode_first: bool) -> None:
    p, d = await pair(nodes, **options)
    ids = await prefill_request(p, "req", 45)
    expected = blocks_of(p, ids)
    send = lambda: p.service.push.prefill.send("t1", "req", ids, 45, FIRST)  # noqa: E731
    receive = lambda: d.service.push.decode.receive("t1", p.address, 45)  # noqa: E731
    first = asyncio.ensure_future(receive() if decode_first else send())
    # The first leg is at the prefill's rendezvous: a registration, or a sender waiting.
    await wait_until(lambda: len(p.service.push.prefill.registrations) == 1)
    assert not first.done()
    second = await (send() if decode_first else receive())
    kv = await first if decode_first else second
    if not decode_first:
        assert await first == kv.num_bytes  # the send ends (blocks released) after the ack
    assert same_bits(expected, blocks_of(d, kv.block_ids))
    assert (kv.num_tokens, kv.first_token) == (45, FIRST)
    await d.store.free(kv.block_ids)
    await assert_no_leaks(p, d)


async def test_deadline_frees_decode_blocks_when_prefill_never_reports(nodes) -> None:
    p = await nodes("prefill", "push", push_deadline_seconds=30.0)
    d = await nodes("decode", "push", push_deadline_seconds=0.3)
    start = time.monotonic()
    with pytest.raises(ApiError) as err:
        await d.service.push.decode.receive("lost", p.address, 45)
    assert (err.value.status, err.value.code) == (504, "kv_push_deadline")
    assert time.monotonic() - start < 2.0
    await assert_no_leaks(p, d)
    # The decode told the prefill: a late prefill fails at once instead of waiting it out.
    ids = await prefill_request(p, "late", 45)
    start = time.monotonic()
    with pytest.raises(ApiError) as err:
        await p.service.push.prefill.send("lost", "late", ids, 45, FIRST)
    assert err.value.code == "kv_push_aborted" and time.monotonic() - start < 5.0
    await assert_no_leaks(p, d)


async def test_prefill_without_registration_releases_its_blocks(nodes) -> None:
    p, d = await pair(nodes, push_deadline_seconds=0.3)
    ids = await prefill_request(p, "req", 45)
    with pytest.raises(ApiError) as err:
        await p.service.push.prefill.send("nobody", "req", ids, 45, FIRST)
    assert (err.value.status, err.value.code) == (504, "kv_push_deadline")
    await assert_no_leaks(p, d)


async def test_decode_cancelled_while_waiting_frees_and_tells_prefill(nodes) -> None:
    p, d = await pair(nodes)
    task = asyncio.ensure_future(d.service.push.decode.receive("t", p.address, 45))
    await wait_until(lambda: len(p.service.push.prefill.registrations) == 1)  # registered
    assert d.store.blocks_in_use == 12 and d.service.transfer.held_blocks == 12
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_no_leaks(p, d)
    ids = await prefill_request(p, "req", 45)
    with pytest.raises(ApiError) as err:
        await p.service.push.prefill.send("t", "req", ids, 45, FIRST)
    assert err.value.code == "kv_push_aborted"
    await assert_no_leaks(p, d)


async def test_shape_mismatch_fails_both_legs(nodes) -> None:
    p, d = await pair(nodes)
    ids = await prefill_request(p, "req", 45)
    receive = asyncio.ensure_future(d.service.push.decode.receive("t", p.address, 30))
    with pytest.raises(ApiError) as err:
        await p.service.push.prefill.send("t", "req", ids, 45, FIRST)
    assert err.value.code == "kv_push_shape_mismatch"
    with pytest.raises(ApiError) as err:
        await receive
    assert err.value.code == "kv_push_aborted"
    await assert_no_leaks(p, d)


async def test_push_decode_cannot_pair_with_pull_prefill(nodes) -> None:
    p, d = await nodes("prefill", "pull"), await nodes("decode", "push")
    with pytest.raises(ApiError) as err:
        await d.service.push.decode.receive("t", p.address, 45)
    assert err.value.status == 409 and "transfer_mode" in err.value.message
    await assert_no_leaks(p, d)


async def test_rendezvous_reaps_untaken_offers() -> None:
    now = [0.0]
    rv: Rendezvous[str] = Rendezvous(1.0, lambda: now[0])
    rv.offer("a", "x")
    assert await rv.take("a", 0.1) == "x" and len(rv) == 0
    rv.offer("b", "y")
    now[0] = 2.0
    assert rv.reap() == 1 and len(rv) == 0
    with pytest.raises(ApiError) as err:
        await rv.take("c", 0.05)
    assert err.value.status == 504 and len(rv) == 0
