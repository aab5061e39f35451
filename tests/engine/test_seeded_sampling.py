"""Seeded sampling through the engine: the same seed gives the same tokens alone, in a
batch of 8 with other (seeded and unseeded) requests, under chunked prefill and preemption."""

from __future__ import annotations

import dataclasses

from shared.engine.sampling_params import SamplingParams
from tests.support.engine import assert_all_blocks_free, random_prompts, run_engine

PROMPTS = random_prompts([5, 12, 30, 2, 19, 44, 8, 27], seed=3)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=24,
                        ignore_eos=True)
OTHERS = [
    SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.7, min_p=0.05, seed=9, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.2, top_k=5, repetition_penalty=1.2, max_tokens=30, ignore_eos=True),
]


def test_same_seed_same_tokens_alone_and_in_a_batch_of_8(make_engine):
    alone = {}
    engine = make_engine()
    for i in (0, 3, 5):
        params = dataclasses.replace(SEEDED, seed=1000 + i)
        alone[i] = run_engine(engine, [PROMPTS[i]], [params])[0].token_ids
    params = [OTHERS[i % len(OTHERS)] for i in range(8)]
    for i in alone:
        params[i] = dataclasses.replace(SEEDED, seed=1000 + i)
    for overrides in ({}, {"max_num_batched_tokens": 16}, {"kv_blocks": 8}):
        batch_engine = make_engine(**overrides)
        outs = run_engine(batch_engine, PROMPTS, params, late={5: 4})
        for i, tokens in alone.items():
            assert outs[i].token_ids == tokens, (overrides, i)
        assert_all_blocks_free(batch_engine)
    assert len({tuple(t) for t in alone.values()}) == 3


def test_different_seeds_differ_and_unseeded_runs_vary(make_engine):
    engine = make_engine()
    a = run_engine(engine, [PROMPTS[1]], [SEEDED])[0].token_ids
    b = run_engine(engine, [PROMPTS[1]], [dataclasses.replace(SEEDED, seed=4321)])[0].token_ids
    assert a != b
    free = dataclasses.replace(SEEDED, seed=None)
    runs = {tuple(run_engine(engine, [PROMPTS[1]], [free])[0].token_ids) for _ in range(3)}
    assert len(runs) > 1
