"""TokenHandoff (awaited exactly once, never blocking the event loop, bounded by a timeout)
and the channel's role checks, with fake Work objects: no processes."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

import pytest
import torch

from shared.pipeline.channel import Counter, StageChannel, new_counters
from shared.pipeline.handoff import HandoffLedger, HandoffState, PipelineError, TokenHandoff
from shared.pipeline.wire import MessageKind, TokenSpec


class FakeWork:
    """Completes when `done` is set; `fail` makes the wait raise like a dead peer."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.fail = False
        self.waits = 0

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self.waits += 1
        if not self.done.wait(timeout.total_seconds()):
            raise RuntimeError("Timed out waiting for recv operation to complete")
        if self.fail:
            raise RuntimeError("Connection closed by peer")
        return True


def make_handoff(timeout_s: float = 5.0) -> tuple[TokenHandoff, FakeWork, HandoffLedger]:
    work, ledger = FakeWork(), HandoffLedger()
    spec = TokenSpec(2, (None, None))
    handoff = TokenHandoff(work, spec.pack([4, 2], None), spec, lane=0, step=7,
                           timeout_s=timeout_s, ledger=ledger)
    return handoff, work, ledger


def test_wait_delivers_once_and_clears_the_ledger():
    handoff, work, ledger = make_handoff()
    assert len(ledger) == 1 and not handoff.done()
    work.done.set()
    assert handoff.done()
    assert handoff.wait() == ([4, 2], [None, None])
    assert handoff.state is HandoffState.CONSUMED and len(ledger) == 0
    with pytest.raises(RuntimeError, match="exactly once"):
        handoff.wait()
    assert work.waits == 1


async def test_await_does_not_block_the_event_loop():
    handoff, work, ledger = make_handoff()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while not work.done.is_set():
            ticks += 1
            await asyncio.sleep(0.005)

    async def release_later() -> None:
        while ticks < 5:  # the loop keeps running while the handoff is pending
            await asyncio.sleep(0.005)
        threading.Timer(0.01, work.done.set).start()

    result, _, _ = await asyncio.wait_for(asyncio.gather(handoff, ticker(), release_later()), 10)
    assert result == ([4, 2], [None, None])
    assert ticks >= 5 and len(ledger) == 0 and work.waits == 1


def test_a_late_reply_fails_the_handoff_instead_of_hanging():
    handoff, work, ledger = make_handoff(timeout_s=0.05)
    with pytest.raises(PipelineError, match="did not arrive"):
        handoff.wait()
    assert handoff.state is HandoffState.FAILED and len(ledger) == 0


def test_a_dead_peer_fails_the_handoff():
    handoff, work, _ = make_handoff()
    work.fail = True
    work.done.set()
    with pytest.raises(PipelineError, match="Connection closed"):
        handoff.wait()


def test_abandon_all_empties_the_ledger():
    handoffs = [make_handoff()[0] for _ in range(2)]
    ledger = HandoffLedger()
    for h in handoffs:
        h._ledger = ledger
        ledger.add(h)
    ledger.abandon_all()
    assert len(ledger) == 0
    assert all(h.state is HandoffState.ABANDONED for h in handoffs)


def channel(rank: int, world: int = 2) -> StageChannel:
    return StageChannel(rank, world, hidden_size=8, dtype=torch.float32, timeout_s=1.0,
                        counters=new_counters(world))


def test_the_last_rank_never_enters_the_token_receive_path():
    """Upstream deadlock: the last rank posted the receive of its own broadcast and hung.
    Here it fails at once, before any communication is posted."""
    last = channel(1)
    with pytest.raises(PipelineError, match="cannot receive sampled tokens"):
        last.post_tokens(TokenSpec(1, (None,)), lane=0, step=0, ledger=HandoffLedger())
    assert last.counters[1, Counter.TOKEN_RECVS_ON_LAST] == 1
    assert last.counters[1, Counter.TOKEN_RECVS_POSTED] == 0


@pytest.mark.parametrize(("rank", "call", "message"), [
    (0, lambda c: c.send_tokens(0, torch.zeros(1, dtype=torch.int64)), "send sampled tokens"),
    (0, lambda c: c.recv_forward(), "receive forward"),
    (2, lambda c: c.send_forward(MessageKind.SHUTDOWN), "send forward"),
    (1, lambda c: c.post_tokens(TokenSpec(1, (None,)), lane=0, step=0, ledger=HandoffLedger()),
     "receive sampled tokens"),
])
def test_each_role_is_checked_before_posting(rank, call, message):
    with pytest.raises(PipelineError, match=message):
        call(channel(rank, world=3))
