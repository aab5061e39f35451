"""Engine generation vs HF transformers `generate` (fp32, random-weight checkpoint): greedy
tokens equal with 8 prompts running together and requests added mid-run, and identical
with prefix caching, chunked prefill and forced preemption switched on or off."""

from __future__ import annotations

import pytest

from shared.engine.sampling_params import SamplingParams
from tests.support.engine import assert_all_blocks_free, hf_greedy, random_prompts, run_engine

NEW = 40
LENGTHS = [1, 3, 7, 16, 17, 33, 50, 90]
PROMPTS = random_prompts(LENGTHS)
# Prompts sharing prefixes (2 and 3 full blocks), so the prefix cache really hits.
SHARED = random_prompts([40], seed=7)[0]
PREFIXED = [SHARED[:n] + tail for n, tail in zip([32, 40, 48, 33], random_prompts([5, 9, 1, 20], 8),
                                                   strict=True)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(hf_model) -> list[list[int]]:
    return [hf_greedy(hf_model, p, NEW) for p in PROMPTS]


@pytest.fixture(scope="module")
def prefixed_reference(hf_model) -> list[list[int]]:
    return [hf_greedy(hf_model, p, NEW) for p in PREFIXED]


def test_greedy_matches_hf_batched_with_late_arrivals(make_engine, reference):
    engine = make_engine()
    outs = run_engine(engine, PROMPTS, [GREEDY] * 8, late={2: 3, 5: 10, 7: 25})
    for i, ref in enumerate(reference):
        assert outs[i].token_ids == ref, f"prompt {i} (len {LENGTHS[i]})"
        assert outs[i].finish_reason.value == "length"
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("overrides", [
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 24},  # chunked prefill: long prompts split over steps
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 256},
    {"max_num_seqs": 3},
], ids=["no-prefix-cache", "chunked-24", "no-chunking", "max-seqs-3"])
def test_greedy_matches_hf_under_scheduler_variants(make_engine, reference, overrides):
    engine = make_engine(**overrides)
    outs = run_engine(engine, PROMPTS, [GREEDY] * 8, late={4: 5})
    assert [outs[i].token_ids for i in range(8)] == reference
    assert_all_blocks_free(engine)


def test_greedy_identical_under_forced_preemption(make_engine, reference):
    # 12 blocks of 16 tokens: far less than the 8 sequences need together.
    engine = make_engine(kv_blocks=12)
    assert engine.kv.num_blocks == 12
    outs = run_engine(engine, PROMPTS, [GREEDY] * 8)
    assert engine.stats().num_preemptions > 0
    assert [outs[i].token_ids for i in range(8)] == reference
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_identical_with_prefix_cache_hits(make_engine, prefixed_reference, caching):
    engine = make_engine(enable_prefix_caching=caching)
    params = [GREEDY] * len(PREFIXED)
    first = run_engine(engine, PREFIXED, params, late={1: 2, 2: 4, 3: 6})
    second = run_engine(engine, PREFIXED, params)  # everything cached now
    for outs in (first, second):
        assert [outs[i].token_ids for i in range(len(PREFIXED))] == prefixed_reference
    stats = engine.stats()
    if caching:
        # first run: request 1 reuses request 0's two full blocks; second run: its own three
        assert first[1].num_cached_tokens == 32 and second[1].num_cached_tokens == 48
        assert stats.prefix_cache_hits >= 32 * 3
    else:
        assert stats.prefix_cache_hits == 0
    assert stats.prefix_cache_queries == (2 * sum(map(len, PREFIXED)) if caching else 0)
    assert_all_blocks_free(engine)


def test_chunked_prefill_with_prefix_hits_and_preemption_together(make_engine, prefixed_reference):
    engine = make_engine(max_num_batched_tokens=20, kv_blocks=9)
    outs = run_engine(engine, PREFIXED * 2, [GREEDY] * 8, late={5: 8, 6: 30})
    assert [outs[i].token_ids for i in range(8)] == prefixed_reference * 2
    assert engine.stats().num_preemptions > 0
    assert_all_blocks_free(engine)


def test_logit_bias_matches_hf_sequence_bias(make_engine, hf_model, reference):
    """logit_bias against HF's own SequenceBiasLogitsProcessor: each prompt bans its first
    unbiased token (-100) and favours two others (+4, +2.5), in one batch with an unbiased
    request that must keep its tokens."""
    biases = [{ref[0]: -100.0, (ref[0] + 7) % 256: 4.0, (ref[1] + 3) % 256: 2.5}
              for ref in reference[:4]]
    expected = [hf_greedy(hf_model, PROMPTS[i], NEW, bias) for i, bias in enumerate(biases)]
    params = [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logit_bias=b)
              for b in biases] + [GREEDY]
    engine = make_engine()
    outs = run_engine(engine, [*PROMPTS[:4], PROMPTS[5]], params)
    assert [outs[i].token_ids for i in range(4)] == expected
    assert all(outs[i].token_ids[0] != reference[i][0] for i in range(4))
    assert outs[4].token_ids == reference[5]
    assert_all_blocks_free(engine)
