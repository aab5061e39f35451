"""A PP=2 prefill worker's KV feeds a PP=1 decode worker: the prefill keeps (hold_kv) the
prompt's blocks, every stage has written its own layers into the one shared cache, and stage
0 reads all of them from `runner.kv_cache` exactly as the KV-transfer service does with PP=1.
The decode continues from the copied blocks and the first token, and matches a mixed run."""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import LLMEngine
from shared.engine.request import PrefilledKV
from shared.pipeline.engine import PipelineEngine
from tests.support.engine import random_prompts, run_engine
from tests.support.pipeline import engine_config, greedy, pipeline_config, reference


@pytest.mark.timeout(50)
def test_pp_prefill_kv_decodes_on_a_single_process_worker(small_ckpt):
    prompts = random_prompts([37, 12], seed=9)
    want = reference(small_ckpt, prompts, [greedy(10)] * 2)
    # PP=1 prefill of the same prompts: the KV a single-process prefill worker would hold.
    single = LLMEngine.from_config(engine_config(small_ckpt))
    firsts_single = run_engine(single, prompts, [greedy(1)] * 2)
    with PipelineEngine(engine_config(small_ckpt), pipeline_config(2)) as prefill:
        for i, p in enumerate(prompts):
            prefill.add_request(f"req-{i}", p, greedy(1), hold_kv=True)
        firsts = {}
        while prefill.has_unfinished_requests():
            firsts.update({o.request_id: o for o in prefill.step() if o.finished})
        decode = LLMEngine.from_config(engine_config(small_ckpt))
        for i, p in enumerate(prompts):
            held = prefill.held_block_ids(f"req-{i}")
            assert held is not None and prefill.stats().num_held_blocks > 0
            kv = prefill.runner.kv_cache[:, :, held]  # every layer, from stage 0
            assert kv.shape[0] == prefill.model_config.num_layers
            assert kv.abs().sum(dim=(1, 2, 3, 4, 5)).gt(0).all()  # each stage wrote its layers
            blocks = decode.allocate_blocks(len(p))
            decode.runner.kv_cache[:, :, blocks] = kv
            first = firsts[f"req-{i}"].token_ids[0]
            assert first == firsts_single[i].token_ids[0] == want[i].token_ids[0]
            decode.add_request(f"req-{i}", p, greedy(10), prefilled=PrefilledKV(
                tuple(blocks), len(p), first_token_id=first))
            assert prefill.release_held(f"req-{i}")
        got = {}
        while decode.has_unfinished_requests():
            got.update({o.request_id: o for o in decode.step() if o.finished})
        stats = prefill.stats()
        assert stats.num_free_blocks == stats.num_total_blocks and stats.num_held_blocks == 0
    assert {i: o.token_ids for i, o in want.items()} == {
        int(rid.split("-")[1]): o.token_ids for rid, o in got.items()}


def test_shared_cache_layout_matches_a_single_process_engine(small_ckpt):
    from shared.pipeline.engine import allocate_shared_cache
    config = engine_config(small_ckpt)
    single = LLMEngine.from_config(config)
    shared = allocate_shared_cache(config, single.model_config)
    assert shared.shape == single.runner.kv_cache.shape
    assert shared.dtype == single.runner.kv_cache.dtype and shared.is_shared()
    assert torch.count_nonzero(shared) == 0
