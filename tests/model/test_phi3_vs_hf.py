"""Phi-3 (fused qkv/gate_up, longrope) against HF transformers on a small random checkpoint,
rotating whole heads and, like Phi-4-mini (partial_rotary_factor 0.75), only a head prefix.

The prompt runs past original_max_position_embeddings (32), so the long factors are used.
HF switches short/long per forward by its longest position; we switch per position, which is
HF's decode path (see rope.py), so the reference is HF fed token by token after a prefill
shorter than 32 tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

from shared.model.loader import load_model
from tests.support.model import PagedRunner, random_ids

ORIG = 32


def _write(path: Path, partial: float) -> Path:
    torch.manual_seed(0)
    half = int(16 * partial) // 2  # head_dim 16: rotary_dim / 2 frequencies
    cfg = Phi3Config(
        partial_rotary_factor=partial,
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        original_max_position_embeddings=ORIG, rope_theta=10000.0, sliding_window=None,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(half)],
                      "long_factor": [1.5 + 0.7 * i for i in range(half)]},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[1.0, 0.75], ids=["full", "partial"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = _write(tmp_path_factory.mktemp("phi3"), request.param)
    ours, cfg = load_model(path, torch.float32)
    hf = Phi3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf, cfg


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf(torch.tensor([prompt[:ORIG - 1]]), use_cache=True)
        for t in prompt[ORIG - 1:]:
            out = hf(torch.tensor([[t]]), cache=out.cache, use_cache=True)
        tokens: list[int] = []
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return tokens


@pytest.mark.parametrize("length", [12, 40])
def test_phi3_greedy_matches_hf_decode_path(pair, length: int) -> None:
    ours, hf, cfg = pair
    assert cfg.model_type == "phi3" and cfg.rope.attention_factor > 1.0
    assert cfg.rope.partial_rotary_factor == hf.config.rope_parameters["partial_rotary_factor"]
    prompt = random_ids(length, seed=length)
    prompt = [t % 256 for t in prompt]
    tokens, _ = PagedRunner(ours, seed=2).greedy("s", prompt, 8)
    assert tokens == _hf_greedy(hf, prompt, 8)
    assert len(set(tokens)) > 1, "degenerate continuation would not exercise decoding"


def test_phi3_batched_prefill_matches_hf(pair) -> None:
    ours, hf, _ = pair
    prompts = {f"s{n}": [t % 256 for t in random_ids(n, seed=n)] for n in (5, 20, 45)}
    logits = PagedRunner(ours, seed=2).step(list(prompts.items()))
    for seq, prompt in prompts.items():
        assert int(logits[seq][-1].argmax()) == _hf_greedy(hf, prompt, 1)[0]


def test_phi3_sliding_window_applies_to_every_layer() -> None:
    """HF Phi-3 slides every layer by sliding_window (tests/model/test_sliding_window_vs_hf.py runs
    one against HF)."""
    from shared.model.config import ModelConfig
    raw = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 256,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "max_position_embeddings": 128, "sliding_window": 16}
    assert ModelConfig.from_hf(raw).layer_windows == (16, 16)
    assert ModelConfig.from_hf({**raw, "sliding_window": None}).layer_windows == ()
