"""The P/D invariant on the real SmolLM2-135M-Instruct (fp32): pull and push legs give the
mixed worker's tokens for a chat and a long completion prompt."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest

from services.kv_transfer.config import KVTransferConfig
from services.worker.config import WorkerConfig
from shared.config import EngineConfig
from shared.protocol.pd import Role
from tests.support.pd import (
    SMOLLM2,
    SMOLLM2_REQUESTS,
    dispatch_pull,
    dispatch_push,
    metadata,
    post,
    settle_to_zero,
)
from tests.support.worker import WorkerThread, start_workers, stop_all

MODEL, REQUESTS = SMOLLM2, SMOLLM2_REQUESTS


def config(role: str, mode: str = "pull") -> WorkerConfig:
    engine = EngineConfig(model=MODEL, dtype="float32", max_model_len=1024,
                          kv_cache_memory_bytes=64 << 20, num_threads=1)
    kv = None if role == "mixed" else KVTransferConfig(role=role, mode=mode, port=0)
    return WorkerConfig(engine=engine, role=Role(role), kv=kv)


@pytest.fixture(scope="module")
def smol() -> Iterator[dict[str, WorkerThread]]:
    parts = {"mixed": ("mixed", "pull"), "prefill": ("prefill", "pull"),
             "decode": ("decode", "pull"), "push_prefill": ("prefill", "push"),
             "push_decode": ("decode", "push")}
    workers = start_workers({name: config(*part) for name, part in parts.items()}, timeout=300)
    try:
        yield workers
    finally:
        stop_all(workers)


@pytest.mark.slow
async def test_smollm2_pd_equals_mixed(smol: dict[str, WorkerThread]) -> None:
    async with aiohttp.ClientSession() as s:
        push_meta = await metadata(s, smol["push_prefill"].url)
        texts = []
        for path, extra in REQUESTS:
            body = {"model": MODEL, "max_tokens": 12, "temperature": 0,
                    "return_token_ids": True, **extra}
            ref = await post(s, smol["mixed"].url + path, body)
            assert ref.status == 200, ref.body
            texts.append(ref.text)
            pulled = await dispatch_pull(s, smol["prefill"].url, smol["decode"].url, path, body)
            pushed = await dispatch_push(s, smol["push_prefill"].url, smol["push_decode"].url,
                                         path, body, push_meta)
            for got in (pulled, pushed):
                assert got.status == 200, got.body
                assert got.token_ids == ref.token_ids and got.text == ref.text
        assert "Paris" in texts[0]  # a real model, really answering
        await settle_to_zero(s, *(smol[k].url for k in ("prefill", "decode", "push_prefill",
                                                        "push_decode")))
