"""The decode's reclaim deadline: a request waiting for remote KV outlives the prefill's
lease (and the push rendezvous), so the prefill's own expiry always acts first; past the
deadline the decode gives its slot back with a 504."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from services.common.errors import ApiError
from services.kv_transfer.config import KVTransferConfig
from services.worker.config import WorkerConfig
from services.worker.handoff import Handoff
from shared.protocol.pd import PushDecodeParams, Role


@pytest.mark.parametrize(("lease", "push"), [(30.0, 30.0), (2.0, 5.0), (60.0, 1.0), (0.1, 0.1)])
def test_reclaim_deadline_is_longer_than_lease_and_push_deadline(lease: float,
                                                                 push: float) -> None:
    cfg = KVTransferConfig(role="decode", lease_seconds=lease, push_deadline_seconds=push)
    assert cfg.reclaim_deadline_s > cfg.lease_seconds
    assert cfg.reclaim_deadline_s > cfg.push_deadline_seconds
    # ...and longer than a lease kept alive by one missed heartbeat's extension.
    assert cfg.reclaim_deadline_s > cfg.heartbeat_interval_s + cfg.lease_extension_s


class StalledPush:
    """A push service whose prefill never delivers (and never trips the push deadline)."""

    mode = "push"

    def __init__(self) -> None:
        self.cancelled = False

    async def receive(self, *args: object) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def test_waiting_decode_is_reclaimed_after_the_deadline_not_before() -> None:
    kv = KVTransferConfig(role="decode", mode="push", lease_seconds=0.2,
                          push_deadline_seconds=0.1)
    config = WorkerConfig(role=Role.DECODE, kv=kv)
    push = StalledPush()
    service = SimpleNamespace(transfer=push, push=push)
    engine = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100), kv_connector=None)
    handoff = Handoff(engine, SimpleNamespace(service=service), config)  # type: ignore[arg-type]
    assert handoff.reclaim_s == kv.reclaim_deadline_s
    start = time.monotonic()
    with pytest.raises(ApiError) as err:
        await handoff._transfer(PushDecodeParams("t", "127.0.0.1", 1), 10)
    waited = time.monotonic() - start
    assert (err.value.status, err.value.code) == (504, "kv_reclaim_deadline")
    assert waited >= kv.lease_seconds and push.cancelled  # the transfer is stopped, not leaked
