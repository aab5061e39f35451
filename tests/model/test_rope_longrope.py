"""LongRoPE (Phi-3) and partial rotary tables against HF's Phi3RotaryEmbedding, token by token."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from shared.engine.kv_spec import ModelKVSpec
from shared.model.config import ModelConfig
from shared.model.rope import RopeConfig, RopeType, RotaryEmbedding

HEAD_DIM, ORIG, MAX_POS = 16, 32, 128


def _phi3(partial: float) -> dict[str, object]:
    half = int(HEAD_DIM * partial) // 2
    return dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=partial,
        max_position_embeddings=MAX_POS, original_max_position_embeddings=ORIG, rope_theta=10000.0,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                      "long_factor": [2.0 + 0.5 * i for i in range(half)]})


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_tables_match_hf_decode_path(partial: float) -> None:
    raw = _phi3(partial)
    hf = Phi3RotaryEmbedding(Phi3Config(**raw))
    rope = RopeConfig.from_hf(raw, MAX_POS)
    assert rope.type is RopeType.LONGROPE and rope.partial_rotary_factor == partial
    ours = RotaryEmbedding(rope, HEAD_DIM, MAX_POS, torch.float32)
    x = torch.randn(1, 1, HEAD_DIM)
    for p in (0, 5, ORIG - 1, ORIG, ORIG + 7, MAX_POS - 1):  # both sides of the long switch
        # HF decode path: one token per forward, seq_len = p + 1.
        cos_hf, sin_hf = hf(x, torch.tensor([[p]]))
        cos, sin = ours.lookup(torch.tensor([p]))
        half = ours.rotary_dim // 2
        torch.testing.assert_close(cos[0, 0], cos_hf[0, 0, :half], rtol=0, atol=0)
        torch.testing.assert_close(sin[0, 0], sin_hf[0, 0, :half], rtol=0, atol=0)
        # Rotation, partial included: HF rotates the first rotary_dim channels of q and k.
        q = torch.randn(1, 2, 1, HEAD_DIM)
        q_hf, _ = apply_rotary_pos_emb(q, q, cos_hf, sin_hf)
        got = RotaryEmbedding.apply(q[0].transpose(0, 1), cos, sin)  # [T=1, N=2, D]
        torch.testing.assert_close(got, q_hf[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_longrope_attention_factor_follows_hf_default() -> None:
    rope = RopeConfig.from_hf(_phi3(1.0), MAX_POS)
    hf = Phi3RotaryEmbedding(Phi3Config(**_phi3(1.0)))
    assert rope.attention_factor == pytest.approx(hf.attention_scaling, rel=0, abs=0)
    assert rope.attention_factor > 1.0


@pytest.mark.parametrize("change, message", [
    ({"short_factor": [1.0] * 3, "long_factor": [1.0] * 3}, "short_factor has 3 entries"),
    ({"short_factor": [1.0] * 3}, "short_factor and long_factor differ in length"),
    ({"long_factor": None}, "long_factor"),
    ({"type": "su"}, "unsupported rope scaling type 'su'"),
])
def test_longrope_refusals_name_the_key(change: dict[str, object], message: str) -> None:
    raw = _phi3(1.0)
    raw["rope_scaling"] = {**raw["rope_scaling"], **change}  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=message):
        rope = RopeConfig.from_hf(raw, MAX_POS)
        rope.check_head_dim(HEAD_DIM)


def test_top_level_and_block_partial_factor_must_agree() -> None:
    raw = _phi3(0.75)
    raw["rope_scaling"] = {**raw["rope_scaling"], "partial_rotary_factor": 0.5}  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="partial_rotary_factor disagrees"):
        RopeConfig.from_hf(raw, MAX_POS)


def test_partial_rotary_is_phi3_only() -> None:
    """HF rotates a head prefix in Phi3's attention only; elsewhere the factor is refused."""
    base = {"vocab_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, **_phi3(0.75)}
    with pytest.raises(ValueError, match="partial_rotary_factor=0.75 is only supported for Phi3"):
        ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], **base})
    phi3 = ModelConfig.from_hf({"architectures": ["Phi3ForCausalLM"], **base})
    assert phi3.rope.rotary_dim(phi3.head_dim) == int(HEAD_DIM * 0.75)


def test_compat_rope_items_cover_the_rotary_dim() -> None:
    """Two checkpoints that differ only in partial_rotary_factor never exchange KV."""
    full, partial = (ModelKVSpec.rope_items(dataclasses.asdict(RopeConfig.from_hf(_phi3(f),
                                                                                 MAX_POS)))
                     for f in (1.0, 0.75))
    assert full != partial


def test_compat_rope_items_differ_when_factors_differ() -> None:
    a = RopeConfig.from_hf(_phi3(1.0), MAX_POS)
    raw = _phi3(1.0)
    raw["rope_scaling"] = {**raw["rope_scaling"], "long_factor": [3.0] * (HEAD_DIM // 2)}  # type: ignore[dict-item]
    b = RopeConfig.from_hf(raw, MAX_POS)
    items_a = ModelKVSpec.rope_items(dataclasses.asdict(a))
    items_b = ModelKVSpec.rope_items(dataclasses.asdict(b))
    assert items_a != items_b
