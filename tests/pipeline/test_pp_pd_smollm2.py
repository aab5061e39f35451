"""PP=2 prefill -> PP=1 decode on the real SmolLM2-135M-Instruct (fp32, pull mode): the
prefill's stages declare layers [0, 15) and [15, 30), and the decode's output is the mixed
worker's, token for token, for a chat and a long (chunked) completion prompt."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from services.kv_transfer.config import KVTransferConfig
from services.worker.config import WorkerConfig
from shared.config import EngineConfig
from shared.protocol.codec import decode
from shared.protocol.messages import ServiceInfo
from shared.protocol.pd import Role
from tests.support.pd import (
    SMOLLM2,
    SMOLLM2_REQUESTS,
    dispatch_pull,
    metadata,
    post,
    settle_to_zero,
)
from tests.support.worker import SubprocessWorker, WorkerThread, wait_ready

MODEL, REQUESTS = SMOLLM2, SMOLLM2_REQUESTS
pytestmark = [pytest.mark.slow, pytest.mark.timeout(280)]


def local(role: str) -> WorkerThread:
    engine = EngineConfig(model=MODEL, max_model_len=1024, kv_cache_memory_bytes=64 << 20,
                          num_threads=1)
    kv = None if role == "mixed" else KVTransferConfig(role=role, mode="pull", port=0)
    return WorkerThread(WorkerConfig(engine=engine, role=Role(role), kv=kv))


@pytest.fixture(scope="module")
def smol_pp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    prefill = SubprocessWorker(
        ["--model", MODEL, "--role", "prefill", "--pp-size", "2", "--transfer-mode", "pull",
         "--kv-port", "0", "--max-model-len", "1024", "--kv-cache-memory", "64MiB",
         "--max-num-batched-tokens", "128", "--threads", "1"],
        tmp_path_factory.mktemp("pp-smol") / "prefill.log")
    workers = {"mixed": local("mixed"), "decode": local("decode")}

    async def ready() -> None:
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(
                *(wait_ready(s, w.url, timeout=240) for w in workers.values()),
                wait_ready(s, prefill.url, timeout=240, alive=lambda: prefill.proc.poll() is None))

    try:
        for worker in workers.values():
            worker.start()
        asyncio.run(ready())
        yield {**workers, "prefill": prefill}
    finally:
        for worker in workers.values():
            worker.stop()
        prefill.stop()


async def test_smollm2_pp_prefill_to_pp1_decode_equals_mixed(smol_pp: dict) -> None:
    prefill, decode_url = smol_pp["prefill"].url, smol_pp["decode"].url
    async with aiohttp.ClientSession() as s:
        meta = await metadata(s, prefill)
        async with s.get(f"http://{meta['kv_host']}:{meta['kv_port']}/kv/v1/info") as resp:
            info = decode(await resp.read(), ServiceInfo)
        assert info.node.stage_ranges == ((0, 15), (15, 30))
        texts = []
        for path, extra in REQUESTS:
            body = {"model": MODEL, "max_tokens": 12, "temperature": 0,
                    "return_token_ids": True, **extra}
            ref = await post(s, smol_pp["mixed"].url + path, body)
            assert ref.status == 200, ref.body
            texts.append(ref.text)
            got = await dispatch_pull(s, prefill, decode_url, path, body)
            assert got.status == 200, got.body
            assert got.token_ids == ref.token_ids and got.text == ref.text
        assert "Paris" in texts[0]  # a real model, really answering
        await settle_to_zero(s, prefill, decode_url)
