"""PP=2 and PP=3 produce the same tokens as PP=1 (the one-process LLMEngine), token for token:
greedy and seeded sampling, mixed prompt lengths, chunked prefill, late arrivals."""

from __future__ import annotations

import math

import pytest

from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.pipeline.engine import PipelineEngine
from tests.support.engine import random_prompts, run_engine
from tests.support.pipeline import (
    assert_quiescent,
    engine_config,
    greedy,
    pipeline_config,
    reference,
)

LENGTHS = [3, 17, 40, 64, 5, 29, 1, 33]
LATE = {6: 3, 7: 9}  # prompt index -> added before this step
CHUNKED = {"max_num_batched_tokens": 24}  # prompts of 29+ tokens take several steps


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = random_prompts(LENGTHS)
    params = [greedy(n) for n in (12, 7, 10, 5, 16, 9)]
    params += [SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, logprobs=2),
               SamplingParams(temperature=1.1, top_k=50, seed=5, max_tokens=8, ignore_eos=True,
                              repetition_penalty=1.2)]
    return prompts, params


@pytest.fixture(scope="module")
def expected(small_ckpt):
    prompts, params = workload()
    return reference(small_ckpt, prompts, params, LATE, **CHUNKED)


def check_same(got, expected) -> None:
    assert sorted(got) == sorted(expected)
    for i, want in expected.items():
        assert got[i].token_ids == want.token_ids, f"prompt {i}"
        assert got[i].finish_reason == want.finish_reason
        if want.new_logprobs is not None:  # batch composition may move the last float bits
            for a, b in zip(got[i].new_logprobs, want.new_logprobs, strict=True):
                assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob,
                                                                 abs_tol=1e-4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("pp_size", "partition"), [(2, None), (3, (2, 1, 1))])
def test_pipeline_matches_one_process(small_ckpt, expected, pp_size, partition):
    prompts, params = workload()
    config = engine_config(small_ckpt, **CHUNKED)
    with PipelineEngine(config, pipeline_config(pp_size, layer_partition=partition)) as engine:
        got = run_engine(engine, prompts, params, LATE)
        check_same(got, expected)
        assert_quiescent(engine)
        if pp_size == 2:  # the facade carries every attribute a one-process engine has
            assert set(vars(LLMEngine.from_config(config))) <= set(vars(engine))
        # The KV service sees one cache over every layer, as with PP=1.
        assert engine.runner.kv_cache.shape[0] == engine.model_config.num_layers
