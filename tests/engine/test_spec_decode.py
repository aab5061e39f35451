"""Speculative decoding (n-gram proposer) inside the engine: lossless against speculation off.

The reference is the same engine with speculation off (itself checked against HF transformers
in test_engine_vs_hf.py). Prompts repeat a random phrase, so that the n-gram proposer drafts
and a random model both accepts and rejects drafts.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from shared.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.speculative_config import MAX_SPECULATIVE_TOKENS
from tests.support.engine import assert_all_blocks_free, run_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def ngram(k: int = 4, batch: int = 64, lo: int = 1, hi: int = 3) -> dict[str, object]:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
            "prompt_lookup_max": hi, "disable_by_batch_size": batch}


def repeating_prompts(n: int, seed: int = 3) -> list[list[int]]:
    """Prompts made of a short random phrase repeated (with some noise in between)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        phrase = [rng.randrange(3, 49152) for _ in range(3 + i % 4)]
        noise = [rng.randrange(3, 49152) for _ in range(i % 3)]
        prompts.append(phrase * (2 + i % 3) + noise + phrase[:2])
    return prompts


@pytest.fixture(scope="module")
def reference(make_engine):
    engine = make_engine()
    outs = run_engine(engine, repeating_prompts(6), [GREEDY] * 6)
    return [outs[i].token_ids for i in range(6)]


def test_greedy_batched_identical_with_accepts_and_rejects(make_engine, reference):
    engine = make_engine(speculative_config=ngram())
    start = engine.stats().num_free_blocks
    outs = run_engine(engine, repeating_prompts(6), [GREEDY] * 6)
    assert [outs[i].token_ids for i in range(6)] == reference
    s = engine.stats()
    assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens
    per_pos = s.spec_accepted_per_position  # an accept at i implies accepts before it
    assert sum(per_pos) == s.spec_num_accepted_tokens and list(per_pos) == sorted(per_pos)[::-1]
    assert s.num_free_blocks == start
    assert_all_blocks_free(engine)


def run_pair(make_engine, prompts, params, spec: dict[str, object], **overrides):
    """(speculation off outputs, speculation on outputs, the speculating engine)."""
    off = run_engine(make_engine(**overrides), prompts, params)
    engine = make_engine(speculative_config=spec, **overrides)
    on = run_engine(engine, prompts, params)
    assert_all_blocks_free(engine)
    return off, on, engine


def same(a, b) -> None:
    for i in a:
        assert (a[i].token_ids, a[i].text, a[i].finish_reason, a[i].stop_reason) == (
            b[i].token_ids, b[i].text, b[i].finish_reason, b[i].stop_reason), i


def test_stop_ids_stop_strings_and_max_tokens_exact(make_engine, reference):
    # Stops placed inside the reference outputs, at points a multi-token accept can jump over.
    prompts = repeating_prompts(6)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (1, 2, 7, 13, 23, 40)]
    params[1] = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                               stop_token_ids=(reference[1][9],))
    params[3] = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                               stop_token_ids=(reference[3][17],), include_stop_str_in_output=True)
    off = run_engine(make_engine(), prompts[4:5], [GREEDY])
    text = off[0].text
    params[4] = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                               stop=(text[len(text) // 2:len(text) // 2 + 3],))
    off, on, engine = run_pair(make_engine, prompts, params, ngram(k=8))
    same(off, on)
    assert engine.stats().spec_num_accepted_tokens > 0
    assert off[4].finish_reason == on[4].finish_reason and on[4].stop_reason is not None


def record_steps(engine) -> list[tuple[int, bool]]:
    """Spy on the scheduler: (total scheduled tokens, any draft) of every step, appended."""
    steps: list[tuple[int, bool]] = []
    schedule = engine.scheduler.schedule

    def spy():
        batch = schedule()
        steps.append((batch.total_num_scheduled_tokens, bool(batch.draft_token_ids)))
        return batch

    engine.scheduler.schedule = spy
    return steps


def test_full_batch_at_the_largest_k(make_engine, monkeypatch):
    # max_num_seqs requests, each drafting MAX_SPECULATIVE_TOKENS: 8 x 17 tokens a step once
    # the step row cap (MAX_STEP_ROWS, for bf16 exactness; fp32 here) is lifted. Full-length
    # drafts every step: a proposer that always drafts K tokens (token 0, never accepted).
    import shared.engine.spec.drafter as drafter_module

    width = 8 * (1 + MAX_SPECULATIVE_TOKENS)
    prompts = repeating_prompts(8, seed=5)
    params = [GREEDY] * 8
    off = run_engine(make_engine(max_num_seqs=8), prompts, params)
    monkeypatch.setattr(drafter_module, "propose_ngram", lambda tokens, lo, hi, k: [0] * k)
    spec = {**ngram(k=MAX_SPECULATIVE_TOKENS, batch=8), "min_acceptance_rate": 0.0}
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=width, speculative_config=spec)
    engine.scheduler.drafter.max_step_rows = width
    steps = record_steps(engine)
    same(off, run_engine(engine, prompts, params))
    assert max(n for n, drafted in steps if drafted) == width
    assert_all_blocks_free(engine)


def test_a_step_holds_at_most_max_step_rows(make_engine):
    """By default a speculating step's decode rows plus drafts stay within the dense GEMV's
    row limit (so bf16 verify rows are computed as one-row decode computes them)."""
    from kernels.dense.backend import MAX_ROWS
    from shared.engine.spec.drafter import MAX_STEP_ROWS

    assert MAX_STEP_ROWS == MAX_ROWS
    prompts = repeating_prompts(8, seed=5)
    engine = make_engine(max_num_seqs=8, speculative_config=ngram(
        k=MAX_SPECULATIVE_TOKENS, batch=8, lo=1, hi=4))
    steps = record_steps(engine)
    run_engine(engine, prompts, [GREEDY] * 8)
    drafted = [n for n, d in steps if d]
    assert drafted and max(drafted) <= MAX_STEP_ROWS


def test_preemption_and_chunked_prefill_still_lossless(make_engine):
    # 10 blocks of 16 tokens for 6 growing sequences: preemption by recompute happens.
    prompts = repeating_prompts(6, seed=7)
    off, on, engine = run_pair(make_engine, prompts, [GREEDY] * 6, ngram(k=6),
                               kv_blocks=10, max_num_batched_tokens=24)
    same(off, on)
    assert engine.stats().num_preemptions > 0 and engine.stats().spec_num_drafts > 0


def test_prefix_cache_after_rejections_serves_the_same_output(make_engine, reference):
    # Rejected drafts must leave no cached block behind: a second run hits the cache.
    engine = make_engine(speculative_config=ngram())
    prompts = repeating_prompts(6)
    first = run_engine(engine, prompts, [GREEDY] * 6)
    resend = [p + first[i].token_ids for i, p in enumerate(prompts)]
    second = run_engine(engine, resend, [SamplingParams(temperature=0.0, max_tokens=8,
                                                        ignore_eos=True)] * 6)
    assert engine.stats().prefix_cache_hits > 0
    plain = run_engine(make_engine(enable_prefix_caching=False), resend,
                       [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 6)
    assert [first[i].token_ids for i in range(6)] == reference
    same(plain, second)
    assert_all_blocks_free(engine)


@pytest.fixture(scope="module")
def make_tied_engine(make_checkpoint):
    """Engines on a tied-embedding random model: it tends to repeat its last token, which at
    a high temperature gives sampled drafts that are both accepted and rejected."""
    ckpt = make_checkpoint(preset="small", tie_word_embeddings=True, seed=0)

    def build(**overrides: Any) -> LLMEngine:
        return LLMEngine.from_config(EngineConfig(
            model=str(ckpt), kv_cache_memory_bytes=8 << 20, num_threads=1, **overrides))

    return build


def test_seeded_sampling_reproducible_alone_in_a_batch_and_without_speculation(
        make_tied_engine):
    make_engine = make_tied_engine
    prompts = repeating_prompts(5, seed=11)
    seeded = SamplingParams(temperature=6.0, top_p=0.99, top_k=200, seed=1234, max_tokens=30,
                            ignore_eos=True)
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 5, 8, 30)]
    solo = make_engine(speculative_config=ngram(batch=1))
    alone = run_engine(solo, prompts[:1], [seeded])
    # batch=2: the 5-request batch does not speculate while it is large, then does.
    engine = make_engine(speculative_config=ngram(batch=2))
    batched = run_engine(engine, prompts, [seeded] + others)
    off = run_engine(make_engine(), prompts[:1], [seeded])
    assert alone[0].token_ids == batched[0].token_ids == off[0].token_ids
    s = solo.stats()
    assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens
    assert engine.stats().spec_num_drafts > 0


def test_disable_by_batch_size_switches_speculation_off_for_big_batches(make_tied_engine):
    # Four requests that run together from start to end: above the limit none drafts.
    prompts = [p[:8] for p in repeating_prompts(6)[2:6]]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 4
    over = make_tied_engine(speculative_config=ngram(batch=3))
    run_engine(over, prompts, params)
    at = make_tied_engine(speculative_config=ngram(batch=4))
    run_engine(at, prompts, params)
    assert over.stats().spec_num_drafts == 0 < at.stats().spec_num_drafts


def test_requests_with_penalties_logprobs_or_min_tokens_do_not_speculate(make_tied_engine):
    # On the tied model every plain greedy request drafts (the control); these must not.
    prompts = repeating_prompts(3)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                             repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, min_tokens=20)]
    off, on, engine = run_pair(make_tied_engine, prompts, params, ngram())
    same(off, on)
    assert engine.stats().spec_num_drafts == 0
    control = make_tied_engine(speculative_config=ngram())
    run_engine(control, prompts, [GREEDY] * 3)
    assert control.stats().spec_num_drafts > 0


def test_offline_llm_takes_the_speculative_config(small_ckpt, reference):
    from shared.engine.llm import LLM

    llm = LLM(model=str(small_ckpt), kv_cache_memory_bytes=8 << 20, num_threads=1,
              speculative_config=ngram())
    outs = llm.generate(repeating_prompts(6), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.engine.stats().spec_num_accepted_tokens > 0


def test_requests_that_never_accept_stop_speculating(make_engine, reference, monkeypatch):
    """The per-request off switch inside the engine: drafts the model never accepts (token 0,
    which the reference outputs never hold) stop after acceptance_window draft tokens, and
    the outputs are unchanged."""
    import shared.engine.spec.drafter as drafter_module

    assert not any(0 in r for r in reference)
    monkeypatch.setattr(drafter_module, "propose_ngram", lambda tokens, lo, hi, k: [0] * k)
    k, window = 4, 8
    spec = {**ngram(k=k), "acceptance_window": window, "min_acceptance_rate": 0.2}
    engine = make_engine(speculative_config=spec)
    outs = run_engine(engine, repeating_prompts(6), [GREEDY] * 6)
    assert [outs[i].token_ids for i in range(6)] == reference
    s = engine.stats()
    assert s.spec_num_accepted_tokens == 0
    # Each request drafts until it has proposed `window` tokens, then never again; without
    # the switch every one of its 39 decode steps would have drafted.
    assert 0 < s.spec_num_draft_tokens <= 6 * (window + k - 1)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("quantization", [None, "mxfp4"])
def test_bf16_native_kernels_greedy_identical(make_engine, quantization):
    """bf16 on the native kernels (dense, or MXFP4 projections): verify rows are computed as
    one-row decode computes them, so greedy tokens equal speculation off exactly."""
    prompts = repeating_prompts(6)
    off, on, engine = run_pair(make_engine, prompts, [GREEDY] * 6, ngram(k=7),
                               dtype="bfloat16", quantization=quantization)
    same(off, on)
    s = engine.stats()
    assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens
