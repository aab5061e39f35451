"""A model's generation_config.json sets the defaults of requests that leave fields unset, as
vLLM's `--generation-config auto` does; `--generation-config vllm` ignores the file."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from services.worker.config import WorkerConfig
from services.worker.generation_defaults import (
    GenerationConfigMode,
    sampling_defaults,
    with_defaults,
)
from shared.config import EngineConfig
from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams
from tests.support.worker import WorkerThread, start_workers, stop_all

GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.0,
              "top_p": 0.9, "top_k": None, "max_new_tokens": 5, "pad_token_id": 0}


def test_only_sampling_keys_map_to_request_fields() -> None:
    assert sampling_defaults(GENERATION) == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5}
    assert sampling_defaults({"eos_token_id": 2}) == {}


def test_the_client_wins_and_an_explicit_null_is_the_clients() -> None:
    defaults = {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5}
    body = {"prompt": "x", "temperature": 0.7, "top_p": None}
    assert with_defaults(body, defaults) == {**body, "max_tokens": 5}
    chat = {"messages": [], "max_completion_tokens": 9}
    assert with_defaults(chat, defaults) == {**chat, "temperature": 0.0, "top_p": 0.9}
    assert with_defaults(body, {}) is body


@pytest.fixture(scope="module")
def model_with_defaults(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "tiny"
    shutil.copytree(tiny_dir, out)
    (out / "generation_config.json").write_text(json.dumps(GENERATION))
    return out


@pytest.fixture(scope="module")
def workers(model_with_defaults: Path) -> Iterator[dict[str, WorkerThread]]:
    engine = EngineConfig(model=str(model_with_defaults), dtype="float32", max_model_len=256,
                          kv_cache_memory_bytes=8 << 20)
    configs = {mode.value: WorkerConfig(engine=engine, served_model_names=("tiny",),
                                        generation_config=mode)
               for mode in GenerationConfigMode}
    started = start_workers(configs)
    yield started
    stop_all(started)


async def _complete(url: str, **fields: object) -> dict:
    body = {"model": "tiny", "prompt": "Tell me about the number 7.", "return_token_ids": True,
            **fields}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_auto_serves_unset_fields_with_the_models_defaults(
        workers: dict[str, WorkerThread], model_with_defaults: Path) -> None:
    got = await _complete(workers["auto"].url)  # no temperature, no max_tokens
    llm = LLM(model=str(model_with_defaults), dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=8 << 20)
    ref = llm.generate(["Tell me about the number 7."],
                       SamplingParams(temperature=0.0, top_p=0.9, max_tokens=5))[0]
    assert got["choices"][0]["token_ids"] == ref.token_ids
    assert got["usage"]["completion_tokens"] == 5
    # A request that sets the field keeps its own value.
    assert (await _complete(workers["auto"].url, max_tokens=3))["usage"]["completion_tokens"] == 3


async def test_vllm_mode_ignores_the_file(workers: dict[str, WorkerThread]) -> None:
    got = await _complete(workers["vllm"].url, ignore_eos=True)
    assert got["usage"]["completion_tokens"] == 16  # the OpenAI default, not max_new_tokens


def test_flag_parses_and_refuses_unknown_modes() -> None:
    import argparse

    from services.worker import config as worker_config

    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    assert parser.parse_args([]).generation_config == "auto"
    assert parser.parse_args(["--generation-config", "vllm"]).generation_config == "vllm"
    with pytest.raises(SystemExit):
        parser.parse_args(["--generation-config", "hf"])
