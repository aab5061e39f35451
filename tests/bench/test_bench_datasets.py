"""Datasets, arrivals and SSE parsing, in process."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from services.bench.client import iter_sse
from services.bench.config import (
    BenchConfig,
    DatasetKind,
    DatasetSpec,
    PromptFormat,
    parse_goodput,
    parse_percentiles,
    parse_rate,
)
from services.bench.datasets import DatasetError, build_prompts, read_jsonl
from services.bench.runner import arrival_offsets
from shared.protocol.pd import ApiKind
from tests.support.fake_openai import FakeOpenAI


class WordCodec:
    """The fake server's word-level tokenizer, without HTTP."""

    source = "test"

    def __init__(self) -> None:
        self.fake = FakeOpenAI()

    async def encode(self, text: str) -> list[int]:
        return self.fake.encode(text)

    async def decode(self, ids: list[int]) -> str:
        return self.fake.decode(ids)


def cfg(**kw: object) -> BenchConfig:
    return BenchConfig(base_url="http://127.0.0.1:1", model="m", **kw)


async def test_random_ids_and_text_have_the_requested_length() -> None:
    codec = WordCodec()
    ids = await build_prompts(cfg(input_len=37, output_len=5, num_prompts=4, seed=3), codec)
    assert [len(p.prompt) for p in ids] == [37] * 4 and all(p.prompt_len == 37 for p in ids)
    assert all(p.output_len == 5 for p in ids)
    again = await build_prompts(cfg(input_len=37, output_len=5, num_prompts=4, seed=3), codec)
    assert [p.prompt for p in again] == [p.prompt for p in ids]  # seeded
    chat = await build_prompts(cfg(input_len=37, num_prompts=3, endpoint=ApiKind.CHAT), codec)
    for p in chat:
        assert isinstance(p.prompt, str)
        assert len(await codec.encode(p.prompt)) == p.prompt_len == 37


async def test_prefix_repetition_groups_share_a_prefix() -> None:
    codec = WordCodec()
    prompts = await build_prompts(cfg(dataset=DatasetSpec(DatasetKind.PREFIX_REPETITION),
                                      input_len=40, prefix_len=30, num_prefixes=3,
                                      num_prompts=12), codec)
    heads = {tuple(p.prompt[:30]) for p in prompts}
    assert len(heads) == 3 and all(len(p.prompt) == 40 for p in prompts)
    tails = {tuple(p.prompt[30:]) for p in prompts}
    assert len(tails) == 12  # suffixes are drawn per prompt


async def test_word_prompts_without_a_tokenizer() -> None:
    prompts = await build_prompts(cfg(input_len=20, num_prompts=2), None)
    assert all(isinstance(p.prompt, str) and len(p.prompt.split()) == 20 for p in prompts)
    assert all(p.prompt_len is None for p in prompts)
    with pytest.raises(DatasetError):
        await build_prompts(cfg(num_prompts=1, prompt_format=PromptFormat.IDS), None)


async def test_jsonl_dataset(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "alpha beta gamma"}, {"prompt": [5, 6], "output_len": 3}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    codec = WordCodec()
    spec = DatasetSpec(DatasetKind.JSONL, path)
    prompts = await build_prompts(cfg(dataset=spec, output_len=9, num_prompts=3), codec)
    assert [(p.prompt, p.prompt_len, p.output_len) for p in prompts] == [
        ("alpha beta gamma", 3, 9), ([5, 6], 2, 3), ("alpha beta gamma", 3, 9)]
    chat = await build_prompts(cfg(dataset=spec, endpoint=ApiKind.CHAT), codec)
    assert all(isinstance(p.prompt, str) for p in chat) and len(chat) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(DatasetError, match="bad.jsonl:2"):
        read_jsonl(bad)


def test_arrivals_follow_the_gamma_process() -> None:
    assert not arrival_offsets(5, math.inf, 1.0, 0).any()
    for burstiness in (1.0, 4.0):
        t = arrival_offsets(4001, 50.0, burstiness, seed=1)
        gaps = np.diff(t)
        assert t[0] == 0.0 and (gaps > 0).all()
        assert statistics.fmean(gaps) == pytest.approx(1 / 50.0, rel=0.06)
        # a gamma with shape k has coefficient of variation 1/sqrt(k): 1 for Poisson
        cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)
    assert (arrival_offsets(10, 5.0, 1.0, 7) == arrival_offsets(10, 5.0, 1.0, 7)).all()


async def test_sse_parsing() -> None:
    async def lines():
        for line in [b": ping\n", b"\n", b"data: {\"a\": 1}\r\n", b"\r\n", b"event: x\n",
                     b"data: first\n", b"data: second\n", b"\n", b"data:[DONE]"]:
            yield line

    events = [data async for _, data in iter_sse(lines())]
    assert events == ['{"a": 1}', "first\nsecond", "[DONE]"]


def test_flag_parsers() -> None:
    assert parse_goodput(["ttft:500", "e2el:2000.5"]) == {"ttft": 500.0, "e2el": 2000.5}
    assert parse_percentiles("50, 90,99.9") == (50.0, 90.0, 99.9)
    assert parse_rate("inf") == math.inf and parse_rate("2.5") == 2.5
    for bad in (lambda: parse_goodput(["itl:5"]), lambda: parse_goodput(["ttft"]),
                lambda: parse_percentiles("0"), lambda: parse_rate("0"),
                lambda: cfg(burstiness=0), lambda: cfg(max_concurrency=0)):
        with pytest.raises(ValueError):
            bad()
