"""Sliding-window models in the engine: blocks outside every layer's window are dropped, so a
long prompt's KV stays bounded by the window; generation still equals HF transformers.

The block bookkeeping is checked against hand-computed ids; generation against HF `generate`
(fp32, greedy, batched) on random Mistral (every layer slides) and Qwen2 (a full layer and a
sliding one, where nothing may be dropped) checkpoints whose window is much shorter than the
prompts, under chunked prefill, prefix-cache hits and forced preemption; the native bf16 path
against HF teacher-forced over the native engine's own tokens; speculative decoding with a
draft model (rejections roll back); and a Gemma 2 sliding every layer (a family whose config
places its own windows) dropping blocks the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shared.config import EngineConfig
from shared.engine.block_manager import DROPPED_BLOCK, KVCacheManager
from shared.engine.engine import LLMEngine
from shared.engine.request import PrefilledKV, Request, RequestStatus
from shared.engine.sampling_params import SamplingParams
from tests.support.dense import DENSE_TIERS, dense_or_skip
from tests.support.engine import assert_all_blocks_free, hf_greedy, random_prompts, run_engine
from tests.support.native_contract import LogitRecorder

BS, WINDOW, CHUNK, NEW = 4, 8, 16, 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
PROMPTS = random_prompts([5, 37, 90], seed=3)
SPECS = {
    "mistral": {"arch": "mistral", "sliding_window": WINDOW, "tie_word_embeddings": False},
    "qwen2_mixed": {"arch": "qwen2", "sliding_window": WINDOW, "max_window_layers": 1,
                    "tie_word_embeddings": False},
}


# ---- block bookkeeping (hand-computed oracle) -------------------------------------------------

def _advance(kv: KVCacheManager, req: Request, n: int) -> None:
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.cache_computed_blocks(req)


def test_blocks_before_the_window_are_dropped_and_freed() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_window=WINDOW)
    req = Request("r", list(range(40)), GREEDY)
    _advance(kv, req, 16)
    assert req.block_table == [0, 1, 2, 3] and kv.num_free_blocks == 12
    # Next chunk starts at 16: its first query reads keys > 16 - 8, so blocks 0 and 1 (keys
    # 0..7) are dead; block 2 (8..11) is still read.
    _advance(kv, req, 16)
    assert req.block_table == [DROPPED_BLOCK, DROPPED_BLOCK, 2, 3, 4, 5, 6, 7]
    assert kv.ref_counts[:2] == [0, 0] and kv.num_free_blocks == 10
    _advance(kv, req, 8)  # from 32: keys > 24 are read, blocks 0..5 are dead
    assert req.block_table[:6] == [DROPPED_BLOCK] * 6 and req.block_table[6:] == [6, 7, 8, 9]
    assert kv.num_free_blocks == 12
    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)
    assert kv.num_free_blocks == 16 and kv.ref_counts == [0] * 16


def test_dropped_blocks_stay_valid_prefix_cache_entries() -> None:
    """A dropped block's KV is final: a later request with the same prefix revives it."""
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_window=WINDOW)
    tokens = list(range(100, 124))
    a = Request("a", tokens, GREEDY)
    _advance(kv, a, 12)
    _advance(kv, a, 12)  # from 12, keys > 4 are read: block 0 (keys 0..3) is dropped
    assert a.block_table[0] == DROPPED_BLOCK and kv.ref_counts[0] == 0
    b = Request("b", tokens[:20] + [7, 7, 7], GREEDY)
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == [0, 1, 2, 3, 4] and hit.num_tokens == 20
    assert kv.allocate_slots(b, 3, hit)
    assert kv.ref_counts[0] == 1 and b.block_table[:5] == [0, 1, 2, 3, 4]
    for r in (a, b):
        r.status = RequestStatus.FINISHED_STOPPED
        kv.free(r)
    assert kv.ref_counts == [0] * 16 and kv.num_free_blocks == 16


def test_held_and_full_attention_requests_keep_every_block() -> None:
    """hold_kv (a P/D prefill) transfers its whole block table, so it drops nothing; neither
    does a manager without a window (a model with a full-attention layer)."""
    for kv, hold in ((KVCacheManager(16, BS, sliding_window=WINDOW), True),
                     (KVCacheManager(16, BS, sliding_window=None), False)):
        req = Request("h", list(range(40)), GREEDY, hold_kv=hold)
        for _ in range(3):
            _advance(kv, req, 12)
        assert DROPPED_BLOCK not in req.block_table and len(req.block_table) == 9
        req.status = RequestStatus.FINISHED_STOPPED
        kv.free(req)
        if hold:
            assert kv.held_block_ids("h") == list(range(9))
            assert kv.release_held("h")
        assert kv.num_free_blocks == 16


# ---- engine against HF ------------------------------------------------------------------------

@pytest.fixture(scope="module", params=list(SPECS))
def case(request: pytest.FixtureRequest, make_checkpoint: Callable[..., Path]):
    from transformers import AutoModelForCausalLM

    ckpt = make_checkpoint(**SPECS[request.param])
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    reference = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    return request.param, ckpt, hf, reference


def _engine(ckpt: Path, **overrides: object) -> LLMEngine:
    fields = {"model": str(ckpt), "block_size": BS, "kv_cache_memory_bytes": 4 << 20,
              "num_threads": 1, "max_num_batched_tokens": CHUNK, **overrides}
    return LLMEngine.from_config(EngineConfig(**fields))  # type: ignore[arg-type]


@pytest.mark.parametrize("overrides", [{}, {"enable_chunked_prefill": False,
                                            "max_num_batched_tokens": 256}],
                         ids=["chunked", "whole-prompts"])
def test_greedy_matches_hf_batched(case, overrides: dict) -> None:
    name, ckpt, _, reference = case
    engine = _engine(ckpt, **overrides)
    assert engine.kv.sliding_window == (WINDOW if name == "mistral" else None)
    outs = run_engine(engine, PROMPTS, [GREEDY] * len(PROMPTS), late={2: 3})
    assert [outs[i].token_ids for i in range(len(PROMPTS))] == reference
    # The same prompts again hit the prefix cache (dropped blocks included) and still agree.
    again = run_engine(engine, PROMPTS, [GREEDY] * len(PROMPTS))
    assert [again[i].token_ids for i in range(len(PROMPTS))] == reference
    assert again[2].num_cached_tokens > WINDOW
    assert_all_blocks_free(engine)


def test_greedy_matches_hf_under_forced_preemption(case) -> None:
    """Short prompts that grow past a block boundary inside their window need new blocks
    (past the window, each new block is paid for by a dropped one): 12 of them in 13 blocks
    preempt, and recompute from scratch with the windowed table gives HF's tokens."""
    _, ckpt, hf, _ = case
    prompts = random_prompts([5, 6, 7] * 4, seed=9)
    engine = _engine(ckpt, kv_cache_memory_bytes=_block_bytes(ckpt) * 13,
                     enable_prefix_caching=False, max_num_batched_tokens=64)
    assert engine.kv.num_blocks == 13
    outs = run_engine(engine, prompts, [GREEDY] * len(prompts))
    assert engine.stats().num_preemptions > 0
    assert [outs[i].token_ids for i in range(len(prompts))] == [
        hf_greedy(hf, p, NEW) for p in prompts]
    assert_all_blocks_free(engine)


def test_kv_in_use_for_a_long_prompt_is_bounded_by_the_window(case) -> None:
    name, ckpt, _, _ = case
    engine = _engine(ckpt)
    prompt = random_prompts([200], seed=5)[0]
    engine.add_request("long", prompt, GREEDY)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv.num_blocks - engine.kv.num_free_blocks)
    total = -(-(len(prompt) + NEW - 1) // BS)  # the last token is never written
    if name == "mistral":  # every layer slides: the window and one chunk, whatever the length
        assert peak <= (WINDOW - 1 + CHUNK) // BS + 2 < total // 4
    else:  # a full-attention layer reads everything: nothing may be dropped
        assert peak == total
    assert_all_blocks_free(engine)


def test_prefill_decode_split_transfers_the_whole_table(case) -> None:
    """P/D: the prefill (hold_kv) keeps every block of its prompt, so the transfer copies the
    whole block table; the decode engine adopts it, drops what lies outside the window at its
    first step and continues with HF's tokens."""
    name, ckpt, _, reference = case
    p_engine, d_engine = _engine(ckpt), _engine(ckpt)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        p_engine.add_request(f"p{i}", prompt, params, hold_kv=True)
        outs = []
        while p_engine.has_unfinished_requests():
            outs += p_engine.step()
        src = p_engine.held_block_ids(f"p{i}")
        assert src is not None and DROPPED_BLOCK not in src and len(src) == -(-len(prompt) // BS)
        dst = d_engine.allocate_blocks(len(prompt))
        assert dst is not None
        d_engine.runner.kv_cache[:, :, dst] = p_engine.runner.kv_cache[:, :, src]
        assert p_engine.release_held(f"p{i}")
        d_engine.add_request(f"req-{i}", prompt, GREEDY,
                             prefilled=PrefilledKV(tuple(dst), len(prompt), outs[-1].token_ids[0]))
    first_step = d_engine.step()  # schedules every adopted request: drops before computing
    long_table = d_engine.scheduler.requests["req-2"].block_table
    assert (DROPPED_BLOCK in long_table) == (name == "mistral")
    tokens: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    for out in first_step + _drain(d_engine):
        tokens[int(out.request_id.split("-")[1])] += out.new_token_ids
    assert [tokens[i] for i in range(len(PROMPTS))] == reference
    assert_all_blocks_free(p_engine)
    assert_all_blocks_free(d_engine)


def _drain(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def _block_bytes(ckpt: Path) -> int:
    from shared.model.loader import read_config

    c = read_config(ckpt)
    return c.num_layers * 2 * BS * c.num_kv_heads * c.head_dim * 4


def test_speculation_with_a_window_matches_hf(case, make_checkpoint) -> None:
    """Speculative decoding over a windowed target: verify steps drop blocks before the
    window as plain steps do (rejected drafts roll back only past that point). A windowed
    draft model of another seed drafts every step and is often rejected (the target trims,
    the draft's shadow rolls back), and the tokens are still HF's greedy ones."""
    name, ckpt, hf, _ = case
    from tests.engine.test_spec_decode import repeating_prompts

    prompts = [p * 4 for p in repeating_prompts(3)]  # past the window
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    other = make_checkpoint(**{**SPECS[name], "seed": 11})
    engine = _engine(ckpt, speculative_config={
        "method": "draft_model", "model": str(other), "num_speculative_tokens": 3,
        "min_acceptance_rate": 0.0})
    outs = run_engine(engine, prompts, [params] * len(prompts))
    assert [outs[i].token_ids for i in range(len(prompts))] == [
        hf_greedy(hf, p, 24) for p in prompts]
    s = engine.stats()
    assert 0 < s.spec_num_draft_tokens and s.spec_num_accepted_tokens < s.spec_num_draft_tokens
    assert_all_blocks_free(engine)


# ---- the native bf16 path ---------------------------------------------------------------------

# Measured (tiny random checkpoints, these prompts): the bf16 engine's logits are within
# 0.052-0.058 of HF fp32 on every path (plain torch, avx2, avx512_bf16: the bf16 LM head's
# rounding dominates); ignoring the window moves them by whole units. 4x margin.
LOGIT_ATOL = 0.25


@pytest.mark.parametrize("tier", DENSE_TIERS)
def test_native_engine_matches_hf_teacher_forced(case, tier: str) -> None:
    """The native bf16 engine (fused sliding-window layers) on each kernel tier: its logits at
    every generated position within LOGIT_ATOL of HF fp32 fed the same tokens, and each greedy
    token HF's argmax unless HF's own top two are within that tolerance (a bf16 near-tie)."""
    _, ckpt, hf, _ = case
    dense_or_skip(tier)
    engine = _engine(ckpt, dtype="bfloat16", kernel_tier=tier)
    assert engine.runner.model.native is not None  # type: ignore[attr-defined]
    recorder = LogitRecorder(engine)
    outs = run_engine(engine, PROMPTS, [GREEDY] * len(PROMPTS))
    for i, prompt in enumerate(PROMPTS):
        tokens = outs[i].token_ids
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        got = recorder.stacked(f"req-{i}")
        assert float((got - ref).abs().max()) <= LOGIT_ATOL, i
        chosen = ref.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (ref.max(-1).values - chosen <= LOGIT_ATOL).all(), i
    assert_all_blocks_free(engine)


# ---- a family that places its own windows (Gemma) ---------------------------------------------

def test_gemma_sliding_every_layer_drops_blocks_and_matches_hf(tmp_path: Path,
                                                                tokenizer_dir: Path) -> None:
    """Gemma's windows are ModelConfig.layer_windows like every family's: a Gemma 2 whose
    layer_types slide everywhere gets a windowed block manager, keeps a long prompt's KV
    within the window, and still gives HF's greedy tokens (soft-caps, sandwich norms)."""
    import json

    from transformers import AutoModelForCausalLM

    from shared.model.make_model import ModelSpec, write_checkpoint

    ckpt = write_checkpoint(tmp_path / "gemma2", ModelSpec(arch="gemma2", seed=4,
                                                           sliding_window=WINDOW), tokenizer_dir)
    config = json.loads((ckpt / "config.json").read_text())
    config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]
    (ckpt / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    engine = _engine(ckpt)
    assert engine.kv.sliding_window == WINDOW
    outs = run_engine(engine, PROMPTS, [GREEDY] * len(PROMPTS), late={2: 3})
    assert [outs[i].token_ids for i in range(len(PROMPTS))] == [
        hf_greedy(hf, p, NEW) for p in PROMPTS]
    assert_all_blocks_free(engine)
    engine = _engine(ckpt)  # a fresh cache: no prefix hit holds the prompt's early blocks
    engine.add_request("long", random_prompts([200], seed=5)[0], GREEDY)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv.num_blocks - engine.kv.num_free_blocks)
    assert peak <= (WINDOW - 1 + CHUNK) // BS + 2
    assert_all_blocks_free(engine)
