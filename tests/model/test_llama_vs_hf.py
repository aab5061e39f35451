"""Our paged model against HF transformers (fp32) on random-weight checkpoints of each case.

Each case runs chunked prefill, single-token decode and mixed batches through a paged cache
with block_size 4 and scrambled block tables, and must reproduce HF's logits and HF
`generate`'s greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from shared.model.loader import load_model
from shared.model.rope import RopeType
from tests.support.model import PagedRunner, random_ids

# fp32 throughout; logits reach |50|, so allow a few ulps of relative error on top.
ATOL, RTOL = 1e-4, 1e-5

CASES: dict[str, dict[str, object]] = {
    "llama_gqa_tied": {"arch": "llama", "num_kv_heads": 2},
    "qwen2_bias": {"arch": "qwen2", "tie_word_embeddings": False},
    "mqa_explicit_head_dim": {"num_kv_heads": 1, "head_dim": 32},
    "untied_small": {"preset": "small", "tie_word_embeddings": False},
    "llama_attention_bias": {"attention_bias": True, "tie_word_embeddings": False},
    "mistral": {"arch": "mistral", "tie_word_embeddings": False},
    # QK-norm, and a head_dim (24) that is not hidden / heads (16).
    "qwen3_qk_norm": {"arch": "qwen3", "tie_word_embeddings": False, "head_dim": 24},
    "qwen3_bias_mqa": {"arch": "qwen3", "attention_bias": True, "num_kv_heads": 1,
                       "tie_word_embeddings": False, "seed": 4},
    # Routed experts (top-2 of 8, renormalised) on layer 1, a dense MLP on layer 0.
    "qwen3_moe": {"arch": "qwen3_moe", "tie_word_embeddings": False, "head_dim": 24,
                  "mlp_only_layers": (0,)},
    # Sparse every other layer (decoder_sparse_step 2), top-3 without renormalising.
    "qwen3_moe_sparse_step": {"arch": "qwen3_moe", "preset": "small", "seed": 2,
                              "tie_word_embeddings": False, "decoder_sparse_step": 2,
                              "num_experts_per_tok": 3, "norm_topk_prob": False},
    "rope_llama3": {"rope_type": "llama3", "rope_factor": 8.0, "rope_keys": "v5"},
    "rope_linear": {"rope_type": "linear", "rope_factor": 4.0},
    # max_position_embeddings 16: the generate test decodes far past it, where NTK kicks in.
    "rope_dynamic": {"rope_type": "dynamic", "rope_factor": 2.0, "max_position_embeddings": 16},
    # Gemma (shared.model.gemma): layer 0 slides over 8 positions, past which every prompt
    # here runs; soft-capped scores and logits (Gemma 2), QK-norm and a local RoPE base for
    # sliding layers (Gemma 3, both config generations).
    "gemma2": {"arch": "gemma2"},
    "gemma3": {"arch": "gemma3_text", "tie_word_embeddings": False},
    "gemma3_v5_keys": {"arch": "gemma3_text", "rope_keys": "v5", "sliding_window": 5,
                       "num_kv_heads": 1, "tie_word_embeddings": False, "seed": 3},
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, make_checkpoint):
    path = make_checkpoint(**CASES[request.param])
    ours, cfg = load_model(path, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf, cfg


def hf_logits(hf, cfg, ids: list[int]) -> torch.Tensor:
    """HF's logits for every position of `ids`.

    Dynamic NTK past max_position_embeddings: HF scales a whole forward by its longest
    position, so a single forward would scale early tokens too; we match HF's decode path
    (each token scaled by its own position, see rope.py). So there the reference is HF fed
    token by token with its KV cache, after a prefill short enough (< max_position_embeddings)
    to also reset HF's stateful rotary cache.
    """
    with torch.no_grad():
        if cfg.rope.type is not RopeType.DYNAMIC or len(ids) <= cfg.max_position_embeddings:
            return hf(torch.tensor([ids])).logits[0].float()
        n = cfg.max_position_embeddings - 1
        out = hf(torch.tensor([ids[:n]]), use_cache=True)
        logits = [out.logits[0]]
        for t in ids[n:]:
            out = hf(torch.tensor([[t]]), cache=out.cache, use_cache=True)
            logits.append(out.logits[0])
        return torch.cat(logits).float()


def test_chunked_prefill_then_decode_matches_hf(pair) -> None:
    ours, hf, cfg = pair
    ids = random_ids(26, seed=1)
    runner = PagedRunner(ours)
    got = torch.cat([
        runner.step([("a", ids[:11])])["a"],  # first prefill chunk
        runner.step([("a", ids[11:20])])["a"],  # second chunk, crossing block boundaries
        *(runner.step([("a", [t])])["a"] for t in ids[20:]),  # six decode steps
    ])
    torch.testing.assert_close(got, hf_logits(hf, cfg, ids), atol=ATOL, rtol=RTOL)


def test_mixed_batch_matches_hf(pair) -> None:
    """Prefill of one sequence batched with decode of another, then joint decode."""
    ours, hf, cfg = pair
    a, b = random_ids(9, seed=2), random_ids(8, seed=3)
    runner = PagedRunner(ours, seed=1)
    got_a = [runner.step([("a", a[:7])])["a"]]
    out = runner.step([("b", b[:6]), ("a", a[7:8])])
    got_a.append(out["a"])
    got_b = [out["b"]]
    out = runner.step([("a", a[8:]), ("b", b[6:7])])
    got_a.append(out["a"])
    got_b.append(out["b"])
    got_b.append(runner.step([("b", b[7:])])["b"])
    for got, ids in ((got_a, a), (got_b, b)):
        torch.testing.assert_close(torch.cat(got), hf_logits(hf, cfg, ids), atol=ATOL, rtol=RTOL)


def test_greedy_32_tokens_match_hf_generate(pair) -> None:
    ours, hf, cfg = pair
    prompt = random_ids(12, seed=4)
    tokens, step_logits = PagedRunner(ours, seed=2).greedy("s", prompt, 32)
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=32, min_new_tokens=32,
                               eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), generation_config=gen_cfg,
                          return_dict_in_generate=True, output_logits=True)
    assert tokens == out.sequences[0, len(prompt):].tolist()
    torch.testing.assert_close(torch.stack(step_logits), torch.cat(out.logits).float(),
                               atol=ATOL, rtol=RTOL)
    assert len(set(tokens)) > 1, "degenerate continuation would not exercise decoding"
