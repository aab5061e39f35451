"""PP prefill -> PP=1 decode through the real KV-transfer service, in pull and push mode.

`pdmesh serve --role prefill --pp-size 2 --transfer-mode pull|push` (a process plus its stage
process; one pipeline per process, so they cannot live in the test process) hands its KV to
an in-process PP=1 `--role decode` worker, dispatched as tests/pd does (prefill then decode
in pull, both legs at once with one transfer id in push). The reference is an in-process
`--role mixed` PP=1 worker on the same random-weight checkpoint: greedy output must match
token for token. The prefill chunks long prompts (64-token steps), so its non-final chunks
(steps that sample nothing) are in play, and push streams blocks while the prompt runs.
The prefill's KV service declares each stage's layers, checked by the decode's handshake.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from services.kv_transfer.config import KVTransferConfig
from services.worker.config import WorkerConfig
from shared.config import EngineConfig
from shared.protocol.codec import decode
from shared.protocol.messages import ServiceInfo
from shared.protocol.pd import Role
from tests.support.pd import dispatch_pull, dispatch_push, metadata, post, settle_to_zero
from tests.support.worker import SubprocessWorker, WorkerThread, wait_ready

MODEL = "tiny-pp"
COMPLETIONS = "/v1/completions"
LENGTHS = (1, 15, 16, 17, 200)
pytestmark = pytest.mark.timeout(280)


@dataclass
class PPMesh:
    mixed: WorkerThread
    decode: dict[str, WorkerThread]  # by transfer mode
    prefill: dict[str, SubprocessWorker]  # PP=2, by transfer mode


def local_worker(ckpt: Path, role: str, mode: str = "pull") -> WorkerThread:
    engine = EngineConfig(model=str(ckpt), kv_cache_memory_bytes=16 << 20, num_threads=1)
    kv = None if role == "mixed" else KVTransferConfig(role=role, mode=mode, port=0,
                                                       push_deadline_seconds=20.0)
    return WorkerThread(WorkerConfig(engine=engine, role=Role(role), kv=kv,
                                     served_model_names=(MODEL,)))


def pp_prefill(ckpt: Path, mode: str, log_dir: Path) -> SubprocessWorker:
    return SubprocessWorker(
        ["--model", str(ckpt), "--served-model-name", MODEL, "--role", "prefill",
         "--pp-size", "2", "--transfer-mode", mode, "--kv-port", "0",
         "--kv-push-deadline-seconds", "20", "--kv-cache-memory", "16MiB",
         "--max-num-batched-tokens", "64", "--threads", "1"], log_dir / f"prefill-{mode}.log")


@pytest.fixture(scope="module")
def pp_mesh(small_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PPMesh]:
    logs = tmp_path_factory.mktemp("pp-pd-logs")
    prefill = {mode: pp_prefill(small_ckpt, mode, logs) for mode in ("pull", "push")}
    local = [local_worker(small_ckpt, "mixed"), local_worker(small_ckpt, "decode", "pull"),
             local_worker(small_ckpt, "decode", "push")]

    async def ready() -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(
                *(wait_ready(session, w.url) for w in local),
                *(wait_ready(session, p.url, alive=lambda p=p: p.proc.poll() is None)
                  for p in prefill.values()))

    try:
        for worker in local:
            worker.start()
        try:
            asyncio.run(ready())
        except TimeoutError:
            pytest.fail("a worker never became ready:\n" + "\n".join(
                p.log_path.read_text()[-3000:] for p in prefill.values()))
        yield PPMesh(local[0], {"pull": local[1], "push": local[2]}, prefill)
    finally:
        for worker in local:
            worker.stop()
        for proc in prefill.values():
            proc.stop()


def prompt(length: int, salt: int = 0) -> list[int]:
    rng = random.Random(length * 7919 + salt)
    return [rng.randrange(100, 40000) for _ in range(length)]


async def dispatch(session: aiohttp.ClientSession, mesh: PPMesh, mode: str, body: dict):
    prefill, decode_url = mesh.prefill[mode].url, mesh.decode[mode].url
    if mode == "pull":
        return await dispatch_pull(session, prefill, decode_url, COMPLETIONS, body)
    meta = await metadata(session, prefill)
    return await dispatch_push(session, prefill, decode_url, COMPLETIONS, body, meta)


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_pp_prefill_to_pp1_decode_equals_mixed(pp_mesh: PPMesh, mode: str) -> None:
    async with aiohttp.ClientSession() as s:
        for length in LENGTHS:
            body = {"model": MODEL, "prompt": prompt(length), "max_tokens": 8,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            ref = await post(s, pp_mesh.mixed.url + COMPLETIONS, body)
            assert ref.status == 200, ref.body
            assert len(set(ref.token_ids)) > 2  # output that depends on the KV
            got = await dispatch(s, pp_mesh, mode, body)
            assert got.status == 200, (mode, length, got.body)
            assert got.token_ids == ref.token_ids, (mode, length)
            assert got.phases["kv_recomputed"] is False and got.phases["kv_bytes"] > 0
            assert got.prefill["choices"][0]["token_ids"] == ref.token_ids[:1]
        seeded = {"model": MODEL, "prompt": prompt(17, salt=1), "max_tokens": 8,
                  "temperature": 0.8, "seed": 1234, "ignore_eos": True,
                  "return_token_ids": True}
        ref = await post(s, pp_mesh.mixed.url + COMPLETIONS, seeded)
        got = await dispatch(s, pp_mesh, mode, seeded)
        assert got.status == 200 and got.token_ids == ref.token_ids, (mode, got.body)
        await settle_to_zero(s, pp_mesh.prefill[mode].url, pp_mesh.decode[mode].url)


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_pp_prefill_declares_each_stage_and_pairs_on_the_hash(pp_mesh: PPMesh,
                                                                  mode: str) -> None:
    async with aiohttp.ClientSession() as s:
        pre = await metadata(s, pp_mesh.prefill[mode].url)
        dec = await metadata(s, pp_mesh.decode[mode].url)
        async with s.get(f"http://{pre['kv_host']}:{pre['kv_port']}/kv/v1/info") as resp:
            info = decode(await resp.read(), ServiceInfo)
    # Pipeline size is not hashed: the PP=2 prefill and the PP=1 decode share one hash.
    assert pre["compat_hash"] == dec["compat_hash"] == info.compat_hash
    assert info.node.pp_size == 2 and info.factors["num_layers"] == 4
    assert info.node.stage_ranges == ((0, 2), (2, 4))  # stage 0: layers 0-1, stage 1: 2-3
    assert pre["kv_transfer"]["layer_ranges"] == [[0, 2], [2, 4]]  # what the router sees
    assert dec["kv_transfer"]["layer_ranges"] == [[0, 4]]


async def decode_alongside(session: aiohttp.ClientSession, url: str,
                           started: asyncio.Event) -> None:
    """A plain streamed request on `url` that keeps decoding until cancelled."""
    body = {"model": MODEL, "prompt": prompt(5, salt=3), "max_tokens": 1000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with session.post(url + COMPLETIONS, json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {"):
                started.set()


async def test_push_streams_a_chunked_prompt_while_others_decode(pp_mesh: PPMesh) -> None:
    """Next to a decoding request (whose sampled tokens tell stage 0 that the silent chunks
    before them ran on every stage), a long prompt's blocks leave the PP prefill while it
    still computes, and the decode still gives the mixed worker's tokens."""
    prefill = pp_mesh.prefill["push"].url
    body = {"model": MODEL, "prompt": prompt(1500, salt=2), "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    async with aiohttp.ClientSession() as s:
        ref = await post(s, pp_mesh.mixed.url + COMPLETIONS, body)
        started = asyncio.Event()
        busy = asyncio.ensure_future(decode_alongside(s, prefill, started))
        try:
            await asyncio.wait_for(started.wait(), 30)
            got = await dispatch(s, pp_mesh, "push", body)
            assert not busy.done()  # the decoding really ran alongside the whole prompt
        finally:
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)
        assert got.status == 200, got.body
        assert got.token_ids == ref.token_ids
        overlap = got.prefill["kv_transfer_params"]["push_overlap"]
        assert overlap["early_blocks"] > 0, overlap  # streamed while the prompt computed
        await settle_to_zero(s, prefill, pp_mesh.decode["push"].url)
