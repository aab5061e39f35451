"""RoPE tables and config parsing against HF transformers' own rotary embedding."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from shared.model.rope import RopeConfig, RopeType, RotaryEmbedding, rope_angles

HEAD_DIM, MAX_POS = 16, 16
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
}


def hf_config(scaling: dict | None, theta: float = 500000.0) -> dict:
    return {"hidden_size": HEAD_DIM * 2, "num_attention_heads": 2, "head_dim": HEAD_DIM,
            "max_position_embeddings": MAX_POS, "rope_theta": theta, "rope_scaling": scaling}


def hf_cos_sin_decode(cfg: dict, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos/sin as its decode path sees them: one position per call, in order."""
    rot = LlamaRotaryEmbedding(LlamaConfig(**cfg))
    x = torch.zeros(1, 1, HEAD_DIM)
    cos, sin = zip(*(rot(x, torch.tensor([[p]])) for p in range(num_positions)), strict=True)
    return torch.cat(cos, dim=1)[0], torch.cat(sin, dim=1)[0]  # [P, D]


@pytest.mark.parametrize("name", list(SCALINGS))
def test_tables_match_hf_decode_path(name: str) -> None:
    cfg = hf_config(SCALINGS[name])
    rope = RopeConfig.from_hf(cfg, MAX_POS)
    assert rope.type is RopeType(name)
    n = 3 * MAX_POS  # well past max_position_embeddings: dynamic NTK engages
    emb = RotaryEmbedding(rope, HEAD_DIM, MAX_POS, torch.float32, initial_positions=4)
    cos, sin = emb.lookup(torch.arange(n))
    ref_cos, ref_sin = hf_cos_sin_decode(cfg, n)
    half = HEAD_DIM // 2  # HF repeats the half-table: cat(freqs, freqs)
    torch.testing.assert_close(cos[:, 0], ref_cos[:, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0], ref_sin[:, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(ref_cos[:, :half], ref_cos[:, half:], atol=0, rtol=0)


@pytest.mark.parametrize("name", ["linear", "dynamic", "llama3"])
def test_scaling_changes_angles(name: str) -> None:
    """Each scaling really differs from the default where it should (tests above can fail)."""
    cfg = hf_config(SCALINGS[name])
    scaled = rope_angles(RopeConfig.from_hf(cfg, MAX_POS), HEAD_DIM, MAX_POS, 2 * MAX_POS)
    plain = rope_angles(RopeConfig.from_hf(hf_config(None), MAX_POS), HEAD_DIM, MAX_POS, 2 * MAX_POS)
    if name == "dynamic":  # identical inside the original context, different past it
        torch.testing.assert_close(scaled[:MAX_POS], plain[:MAX_POS], atol=0, rtol=0)
        assert not torch.allclose(scaled[MAX_POS:], plain[MAX_POS:])
    else:
        assert not torch.allclose(scaled[1:], plain[1:])


def test_rotation_matches_hf_apply() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = hf_config(SCALINGS["llama3"])
    emb = RotaryEmbedding(RopeConfig.from_hf(cfg, MAX_POS), HEAD_DIM, MAX_POS, torch.float32)
    pos = torch.tensor([0, 3, 7, 30, 2])
    q = torch.randn(5, 3, HEAD_DIM, generator=torch.Generator().manual_seed(0))  # [T, H, D]
    cos, sin = emb.lookup(pos)
    ours = RotaryEmbedding.apply(q, cos, sin)
    hf_cos, hf_sin = LlamaRotaryEmbedding(LlamaConfig(**cfg))(q, pos[None])
    ref, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(ours, ref[0].transpose(0, 1), atol=1e-6, rtol=0)


def test_lookup_extends_table_lazily() -> None:
    emb = RotaryEmbedding(RopeConfig(), HEAD_DIM, 1 << 20, torch.float32, initial_positions=8)
    assert emb.num_positions == 8  # a 1M-position config allocates nothing up front
    cos, _ = emb.lookup(torch.tensor([100]))
    assert emb.num_positions >= 101
    full = rope_angles(RopeConfig(), HEAD_DIM, 1 << 20, 101)
    torch.testing.assert_close(cos[0, 0], full[100].cos(), atol=0, rtol=0)


def test_bf16_tables_are_cast_from_fp32() -> None:
    emb = RotaryEmbedding(RopeConfig(), HEAD_DIM, MAX_POS, torch.bfloat16)
    cos, sin = emb.lookup(torch.arange(MAX_POS))
    angles = rope_angles(RopeConfig(), HEAD_DIM, MAX_POS, MAX_POS)
    assert cos.dtype == torch.bfloat16
    torch.testing.assert_close(sin[:, 0], angles.sin().to(torch.bfloat16), atol=0, rtol=0)
