"""The draft-model proposer: lossless against speculation off, the draft's own config (RoPE)
honoured, its KV rolled back after rejections, a foreign tokenizer refused, its LM head cut to
draft_vocab_size ids.

References: the same engine with speculation off, an engine running the draft checkpoint
alone (what the draft must propose: its own greedy continuation), and HF transformers' logits
of the draft checkpoint (what a draft cut to N ids must propose: the argmax over ids < N).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams
from shared.engine.spec.draft_model import build_draft_proposer
from tests.engine.conftest import SMALL
from tests.engine.test_spec_decode import repeating_prompts
from tests.support.engine import assert_all_blocks_free, run_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def draft_spec(model: Path, k: int = 4, **extra: object) -> dict[str, object]:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k,
            "disable_by_batch_size": 8, **extra}


def greedy(engine: LLMEngine, prompts: list[list[int]], n: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = run_engine(engine, prompts, [params] * len(prompts))
    return [outs[i].token_ids for i in range(len(prompts))]


def test_the_target_as_its_own_draft_is_always_accepted(make_engine, small_ckpt):
    """fp32: the draft computes what the target computes, so every draft token is accepted;
    that fails if the draft's KV were not rolled back or caught up exactly."""
    prompts = repeating_prompts(4)
    want = greedy(make_engine(), prompts)
    engine = make_engine(speculative_config=draft_spec(small_ckpt))
    assert greedy(engine, prompts) == want
    s = engine.stats()
    assert 0 < s.spec_num_draft_tokens == s.spec_num_accepted_tokens
    assert_all_blocks_free(engine)
    proposer = engine.scheduler.drafter.proposer
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks  # released on finish


def _draft_rows(engine: LLMEngine) -> list[int]:
    """Rows of every pass the engine's draft model runs from now on (the runner's test hook)."""
    rows: list[int] = []
    runner = engine.scheduler.drafter.proposer.runner
    runner.fault_hook = lambda batch: rows.append(sum(batch.num_scheduled_tokens))
    return rows


def test_the_self_draft_starts_from_the_targets_kv(make_engine, small_ckpt, make_checkpoint):
    """The target's own checkpoint as the draft: a new request's draft starts from a copy of
    the target's computed KV blocks, so no draft pass prefills the ~100-token prompt (a pass is
    at most the 2-row catch-up after a fully accepted draft), and every draft is still
    accepted (fp32: the copied KV is what the draft would have computed). Another checkpoint
    prefills its draft from the prompt."""
    prompt = repeating_prompts(3)[2] * 4
    want = greedy(make_engine(), [prompt])
    engine = make_engine(speculative_config=draft_spec(small_ckpt, k=3))
    rows = _draft_rows(engine)
    assert greedy(engine, [prompt]) == want
    assert rows and max(rows) <= 2
    s = engine.stats()
    assert 0 < s.spec_num_draft_tokens == s.spec_num_accepted_tokens
    assert_all_blocks_free(engine)
    other = make_engine(speculative_config=draft_spec(make_checkpoint(**{**SMALL, "seed": 1}),
                                                      min_acceptance_rate=0.0))
    other_rows = _draft_rows(other)
    assert greedy(other, [prompt]) == want
    assert max(other_rows) >= len(prompt)


def test_another_draft_is_lossless(make_engine, make_checkpoint):
    other = make_checkpoint(**{**SMALL, "seed": 1})
    prompts = repeating_prompts(4)
    want = greedy(make_engine(), prompts)
    engine = make_engine(speculative_config=draft_spec(other, min_acceptance_rate=0.0))
    assert greedy(engine, prompts) == want
    assert engine.stats().spec_num_draft_tokens > 0
    assert_all_blocks_free(engine)


def test_a_request_that_could_not_speculate_at_first_never_starts(make_engine, small_ckpt):
    """disable_by_batch_size 1: while two requests run nobody drafts; once the short one ends,
    the long one (many outputs in) does not start drafting, as the draft would have to
    prefill its whole context. A request alone from its first decode step does draft."""
    prompts = repeating_prompts(2)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 24)]
    want = run_engine(make_engine(), prompts, params)
    engine = make_engine(speculative_config=draft_spec(small_ckpt, disable_by_batch_size=1))
    got = run_engine(engine, prompts, params)
    assert [got[i].token_ids for i in range(2)] == [want[i].token_ids for i in range(2)]
    assert engine.stats().spec_num_draft_tokens == 0
    assert greedy(engine, prompts[1:]) == [want[1].token_ids]
    assert engine.stats().spec_num_draft_tokens > 0
    assert_all_blocks_free(engine)


def test_the_draft_runs_its_own_rope_and_rolls_back(small_ckpt, make_checkpoint):
    """Same weights, another rope_theta: the draft proposes its own greedy continuation (an
    engine on the draft checkpoint alone), which the target's RoPE would not give."""
    draft_dir = make_checkpoint(**{**SMALL, "rope_theta": 2.0})
    config = EngineConfig(model=str(small_ckpt), kv_cache_memory_bytes=8 << 20,
                          speculative_config=draft_spec(draft_dir, k=6))  # type: ignore[arg-type]
    target = LLMEngine.from_config(EngineConfig(model=str(small_ckpt),
                                                kv_cache_memory_bytes=8 << 20))
    proposer = build_draft_proposer(config, target.tokenizer)
    alone = LLMEngine.from_config(EngineConfig(model=str(draft_dir),
                                               kv_cache_memory_bytes=8 << 20))
    prompt = repeating_prompts(3)[2] * 3
    want = greedy(alone, [prompt], 6)[0]
    req = Request("r", prompt, GREEDY)
    assert proposer.propose(req, 6) == want
    assert greedy(target, [prompt], 6)[0] != want  # the target's RoPE gives other tokens
    # A "rejection": the request continues with other tokens than the draft's; the draft's
    # KV past the common prefix is dropped and the next draft continues the new context.
    for t in (want[0], (want[1] + 1) % 1000):
        req.append_output_token(t)
    assert proposer.propose(req, 4) == greedy(alone, [req.all_token_ids], 4)[0]
    proposer.release("r")
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks


def test_a_draft_with_another_tokenizer_is_refused(small_ckpt, tmp_path):
    foreign = tmp_path / "foreign"
    shutil.copytree(small_ckpt, foreign)
    tok = json.loads((foreign / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: another token -> id map
    (foreign / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer differs"):
        LLMEngine.from_config(EngineConfig(  # type: ignore[arg-type]
            model=str(small_ckpt), kv_cache_memory_bytes=8 << 20,
            speculative_config=draft_spec(foreign)))


def hf_greedy_below(path: Path, prompt: list[int], n: int, vocab: int) -> list[int]:
    """HF transformers' greedy continuation of prompt, each token the argmax over ids < vocab."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1, :vocab].argmax()))
    return ids[len(prompt):]


def test_a_cut_draft_head_proposes_the_argmax_over_its_ids(small_ckpt):
    """draft_vocab_size N: the draft proposes HF's argmax over ids < N, which (a random model
    scores all 49152 ids alike) differs from its argmax over the whole vocabulary."""
    cut = 2000
    config = EngineConfig(model=str(small_ckpt), kv_cache_memory_bytes=8 << 20,
                          speculative_config=draft_spec(  # type: ignore[arg-type]
                              small_ckpt, k=5, draft_vocab_size=cut))
    target = LLMEngine.from_config(EngineConfig(model=str(small_ckpt),
                                                kv_cache_memory_bytes=8 << 20))
    proposer = build_draft_proposer(config, target.tokenizer)
    assert proposer.runner.vocab_size == cut
    for prompt in repeating_prompts(3):
        want = hf_greedy_below(small_ckpt, prompt, 5, cut)
        assert proposer.propose(Request("r", prompt, GREEDY), 5) == want
        assert max(want) < cut
        assert want != hf_greedy_below(small_ckpt, prompt, 5, 49152)
        proposer.release("r")


def test_a_cut_draft_head_stays_lossless(make_engine, small_ckpt):
    """The self-draft cut to half the vocabulary: the target's greedy tokens (about half of
    them >= the cut, which the draft can never propose) come out exactly as without it."""
    prompts = repeating_prompts(4)
    want = greedy(make_engine(), prompts)
    engine = make_engine(speculative_config=draft_spec(
        small_ckpt, min_acceptance_rate=0.0, draft_vocab_size=24576))
    assert greedy(engine, prompts) == want
    s = engine.stats()
    assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens
    assert_all_blocks_free(engine)


def test_a_draft_vocab_size_past_the_vocabulary_is_refused(small_ckpt):
    with pytest.raises(ValueError, match="draft_vocab_size 49153 exceeds"):
        LLMEngine.from_config(EngineConfig(  # type: ignore[arg-type]
            model=str(small_ckpt), kv_cache_memory_bytes=8 << 20,
            speculative_config=draft_spec(small_ckpt, draft_vocab_size=49153)))
