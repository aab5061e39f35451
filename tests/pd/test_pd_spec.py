"""Speculative decoding on the decode side of P/D: a prefill without speculation hands its KV
to a speculating decode (n-gram, or a draft model prefilled on the decode worker), and the
greedy tokens equal the mixed worker's without speculation. The compat hash matches across
(speculation is not a factor: the KV that moves is the target's either way)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.support.pd import dispatch_pull, post, settle_to_zero
from tests.support.pd_mesh import MODEL, make_model, worker_config
from tests.support.worker import WorkerThread, start_workers, stop_all

COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def spec_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerThread]]:
    ckpt: Path = make_model(tmp_path_factory.mktemp("pd-spec") / "m", seed=3)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3, "min_acceptance_rate": 0.0}
    draft = {"method": "draft_model", "model": str(ckpt), "num_speculative_tokens": 3}
    workers = start_workers({
        "mixed": worker_config(ckpt, "mixed"), "prefill": worker_config(ckpt, "prefill"),
        "ngram_decode": worker_config(ckpt, "decode", speculative_config=ngram),
        "draft_decode": worker_config(ckpt, "decode", speculative_config=draft),
    })
    try:
        yield workers
    finally:
        stop_all(workers)


async def drafted(s: aiohttp.ClientSession, url: str) -> float:
    async with s.get(url + "/metrics") as resp:
        text = await resp.text()
    line = next(x for x in text.splitlines()
                if x.startswith("pdmesh:spec_decode_num_draft_tokens_total"))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("decode", ["ngram_decode", "draft_decode"])
async def test_speculating_decode_equals_mixed(spec_mesh: dict[str, WorkerThread],
                                               decode: str) -> None:
    w = spec_mesh
    async with aiohttp.ClientSession() as s:
        for length in (5, 40):
            phrase = [(97 * i + length) % 40000 + 100 for i in range(5)]
            prompt = (phrase * (length // 5 + 1))[:length]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            ref = await post(s, w["mixed"].url + COMPLETIONS, body)
            assert ref.status == 200, ref.body
            got = await dispatch_pull(s, w["prefill"].url, w[decode].url, COMPLETIONS, body)
            assert got.status == 200, got.body
            assert got.token_ids == ref.token_ids, (decode, length)
            assert got.phases["kv_recomputed"] is False and got.phases["kv_bytes"] > 0
        assert await drafted(s, w[decode].url) > 0
        await settle_to_zero(s, w["prefill"].url, w[decode].url)
