"""Prefill/decode hooks: a prefill engine holds a finished request's KV, its blocks are
copied into blocks pre-allocated on a decode engine, and the decode engine continues from
`PrefilledKV`. The split must reproduce a single engine's tokens (greedy and seeded), and
every block must come back."""

from __future__ import annotations

import dataclasses

import pytest

from shared.engine.outputs import FinishReason
from shared.engine.request import PrefilledKV
from shared.engine.sampling_params import SamplingParams
from tests.support.engine import assert_all_blocks_free, random_prompts, run_engine

PROMPTS = random_prompts([1, 16, 37, 70], seed=5)
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=20, ignore_eos=True),
]


def prefill(engine, rid: str, prompt: list[int], params: SamplingParams):
    engine.add_request(rid, prompt, dataclasses.replace(params, max_tokens=1), hold_kv=True)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].token_ids) == 1
    return outs[-1].token_ids[0]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_prefill_decode_split_reproduces_single_engine(make_engine, params):
    single = make_engine()
    expected = run_engine(single, PROMPTS, [params] * len(PROMPTS))
    p_engine, d_engine = make_engine(), make_engine(max_num_batched_tokens=32)
    for i, prompt in enumerate(PROMPTS):
        first = prefill(p_engine, f"r{i}", prompt, params)
        src = p_engine.held_block_ids(f"r{i}")
        assert p_engine.stats().num_held_blocks == len(src) == -(-len(prompt) // 16)
        dst = d_engine.allocate_blocks(len(prompt))
        d_engine.runner.kv_cache[:, :, dst] = p_engine.runner.kv_cache[:, :, src]
        assert p_engine.release_held(f"r{i}")
        d_engine.add_request(f"req-{i}", prompt, params,
                             prefilled=PrefilledKV(tuple(dst), len(prompt), first))
    streamed = {i: [] for i in range(len(PROMPTS))}
    while d_engine.has_unfinished_requests():
        for out in d_engine.step():
            streamed[int(out.request_id.split("-")[1])] += out.new_token_ids
    for i in range(len(PROMPTS)):
        assert streamed[i] == expected[i].token_ids, i
    assert_all_blocks_free(p_engine)
    assert_all_blocks_free(d_engine)


def test_prefilled_request_registers_prefix_hashes_and_emits_first_token(make_engine):
    engine = make_engine()
    prompt = PROMPTS[2]  # 37 tokens: two full blocks
    dst = engine.allocate_blocks(len(prompt))
    source = make_engine()
    first = prefill(source, "src", prompt, PARAMS[0])
    engine.runner.kv_cache[:, :, dst] = source.runner.kv_cache[:, :, source.held_block_ids("src")]
    req = engine.add_request("d", prompt, dataclasses.replace(PARAMS[0], max_tokens=3),
                             prefilled=PrefilledKV(tuple(dst), len(prompt), first))
    assert req.num_computed_tokens == len(prompt) and req.output_token_ids == [first]
    outs = engine.step()
    assert outs[0].new_token_ids == [first]  # emitted first, before any computed token
    while engine.has_unfinished_requests():
        engine.step()
    other = engine.add_request("o", prompt + [5], dataclasses.replace(PARAMS[0], max_tokens=1))
    engine.step()
    assert other.num_cached_tokens == 32
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


def test_prefilled_first_token_can_finish_the_request(make_engine):
    engine = make_engine()
    dst = engine.allocate_blocks(4)
    engine.add_request("x", [7, 8, 9, 10], SamplingParams(max_tokens=1),
                       prefilled=PrefilledKV(tuple(dst), 4, 42))
    outs = engine.step()
    assert outs[0].finished and outs[0].token_ids == [42]
    assert outs[0].finish_reason == FinishReason.LENGTH
    assert_all_blocks_free(engine)


def test_allocate_and_free_receiving_blocks(make_engine):
    engine = make_engine(kv_blocks=4)
    assert engine.allocate_blocks(5 * 16) is None
    blocks = engine.allocate_blocks(3 * 16)
    assert len(blocks) == 3 and engine.stats().num_free_blocks == 1
    engine.free_blocks(blocks)
    with pytest.raises(ValueError):
        engine.free_blocks(blocks)
    assert_all_blocks_free(engine)


def test_aborted_or_released_hold_requests_leave_no_blocks(make_engine):
    engine = make_engine()
    engine.add_request("a", PROMPTS[3], PARAMS[0], hold_kv=True)
    engine.step()
    engine.abort_request("a")  # aborted mid-run: nothing is held
    prefill(engine, "b", PROMPTS[2], PARAMS[0])
    assert engine.held_block_ids("b") and engine.held_block_ids("a") is None
    assert not engine.release_held("a") and engine.release_held("b")
    engine.step()
    assert_all_blocks_free(engine)


def test_bad_prefilled_kv_is_refused(make_engine):
    engine = make_engine()
    dst = engine.allocate_blocks(10)
    with pytest.raises(ValueError):  # a first token needs the whole prompt's KV
        engine.add_request("x", list(range(3, 13)), PARAMS[0], prefilled=PrefilledKV(tuple(dst), 9, 5))
    with pytest.raises(ValueError):  # blocks not allocated
        engine.add_request("y", list(range(3, 13)), PARAMS[0], prefilled=PrefilledKV((99,), 10, 5))
    engine.free_blocks(dst)
    assert_all_blocks_free(engine)


def test_waiting_for_remote_kv_then_ready(make_engine):
    source, engine = make_engine(), make_engine()
    prompt = PROMPTS[1]
    expected = run_engine(make_engine(), [prompt], [PARAMS[1]])[0].token_ids
    engine.add_request("w", prompt, PARAMS[1], wait_for_remote_kv=True)
    dst = engine.allocate_blocks(len(prompt))  # pre-allocated before the KV arrives
    assert engine.step() == [] and engine.stats().num_waiting == 1
    first = prefill(source, "w", prompt, PARAMS[1])
    engine.runner.kv_cache[:, :, dst] = source.runner.kv_cache[:, :, source.held_block_ids("w")]
    source.release_held("w")
    engine.remote_kv_ready("w", PrefilledKV(tuple(dst), len(prompt), first))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == expected
    with pytest.raises(ValueError):
        engine.remote_kv_ready("w", PrefilledKV(tuple(dst), len(prompt), first))
    assert_all_blocks_free(engine)
    assert_all_blocks_free(source)


def test_abort_while_waiting_for_remote_kv_and_held_id_reuse(make_engine):
    engine = make_engine()
    engine.add_request("w", PROMPTS[0], PARAMS[0], wait_for_remote_kv=True)
    assert engine.abort_request("w")
    assert engine.step()[0].finish_reason == FinishReason.ABORT
    prefill(engine, "h", PROMPTS[1], PARAMS[0])
    with pytest.raises(ValueError):  # would orphan the held blocks
        engine.add_request("h", PROMPTS[1], PARAMS[0], hold_kv=True)
    engine.release_held("h")
    assert_all_blocks_free(engine)
