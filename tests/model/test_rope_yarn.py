"""YaRN RoPE (gpt-oss, long-context Qwen) against HF transformers' own parameter function."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from shared.model.rope import RopeConfig, RopeType, RotaryEmbedding, scaled_inv_freq

HEAD_DIM, MAX_POS = 64, 8192
GPT_OSS = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
           "truncate": False, "original_max_position_embeddings": 256}


def _hf(scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    cfg = LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, head_dim=HEAD_DIM,
                      max_position_embeddings=MAX_POS, rope_theta=150000.0,
                      rope_scaling=dict(scaling))
    return ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")


@pytest.mark.parametrize("scaling", [
    GPT_OSS,
    {**GPT_OSS, "truncate": True},  # HF's default
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},  # betas default
    {**GPT_OSS, "attention_factor": 1.25},
    {**GPT_OSS, "mscale": 1.0, "mscale_all_dim": 0.5},
])
def test_yarn_frequencies_and_attention_factor_equal_hf(scaling: dict[str, Any]) -> None:
    ours = RopeConfig.from_hf({"rope_theta": 150000.0, "rope_scaling": scaling}, MAX_POS)
    assert ours.type is RopeType.YARN
    inv, attn = _hf(scaling)
    assert torch.equal(scaled_inv_freq(ours, HEAD_DIM), inv.float())
    assert ours.attention_factor == pytest.approx(attn, rel=1e-12)


def test_yarn_tables_scale_cos_and_sin_by_the_attention_factor() -> None:
    rope = RopeConfig.from_hf({"rope_theta": 150000.0, "rope_scaling": GPT_OSS}, MAX_POS)
    cos, sin = RotaryEmbedding(rope, HEAD_DIM, MAX_POS, torch.float32).lookup(torch.tensor([0, 5]))
    assert torch.allclose(cos[0], torch.full_like(cos[0], rope.attention_factor))
    inv, attn = _hf(GPT_OSS)
    assert torch.allclose(sin[1, 0], (5.0 * inv).sin() * attn)


def test_yarn_knobs_enter_the_canonical_form() -> None:
    a = RopeConfig.from_hf({"rope_scaling": GPT_OSS}, MAX_POS)
    b = RopeConfig.from_hf({"rope_scaling": {**GPT_OSS, "truncate": True}}, MAX_POS)
    assert a.as_dict() != b.as_dict() and a.as_dict()["truncate"] is False
