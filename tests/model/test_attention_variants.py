"""paged_attention's soft-cap and sink options against HF transformers' eager attention
functions (gemma2's and gpt_oss's), over a paged cache with scrambled block tables."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

from shared.model.attention import AttentionMetadata, paged_attention

H, KVH, D, BLOCK = 4, 2, 16, 4


def _run(lens: list[int], scale: float, **kw: object) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill sequences of `lens` tokens at once; returns (per-sequence q, k, v) and ours."""
    gen = torch.Generator().manual_seed(0)
    t = sum(lens)
    q, k, v = (torch.randn(t, n, D, generator=gen) * 2 for n in (H, KVH, KVH))
    blocks = torch.randperm(64, generator=gen).tolist()
    tables, start = [], 0
    for n in lens:
        need = -(-n // BLOCK)
        tables.append(blocks[start:start + need])
        start += need
    meta = AttentionMetadata.build([0] * len(lens), lens, tables, BLOCK)
    kv = torch.zeros(2, 64, BLOCK, KVH, D)
    out = paged_attention(q, k, v, kv, meta, scale, **kw)  # type: ignore[arg-type]
    return [q, k, v], out


def _causal(n: int, window: int | None = None) -> torch.Tensor:
    i = torch.arange(n)
    ok = i[None, :] <= i[:, None]
    if window is not None:
        ok &= i[None, :] > i[:, None] - window
    return torch.zeros(n, n).masked_fill(~ok, float("-inf"))[None, None]


def _module(**attrs: object) -> nn.Module:
    m = nn.Module()
    m.num_key_value_groups = H // KVH  # type: ignore[assignment]
    m.training = False
    for name, value in attrs.items():
        setattr(m, name, value)
    return m


@pytest.mark.parametrize("window", [None, 3])
def test_softcap_matches_gemma2_eager(window: int | None) -> None:
    lens, scale, cap = [7, 10], 0.3, 5.0
    (q, k, v), out = _run(lens, scale, softcap=cap, window=window)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        ref, _ = gemma2_eager(_module(head_dim=D), q[sl].transpose(0, 1)[None],
                              k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None],
                              _causal(n, window), scaling=scale, softcap=cap)
        torch.testing.assert_close(out[sl], ref[0], atol=1e-5, rtol=1e-5)
        start += n


def test_sinks_match_gpt_oss_eager() -> None:
    lens, scale = [5, 12], D ** -0.5
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    (q, k, v), out = _run(lens, scale, sinks=sinks, window=4)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        ref, _ = gpt_oss_eager(_module(sinks=sinks), q[sl].transpose(0, 1)[None],
                               k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None],
                               _causal(n, 4), scaling=scale)
        torch.testing.assert_close(out[sl], ref[0], atol=1e-5, rtol=1e-5)
        start += n
    # A sink takes probability mass: the output is no longer a convex mix of the values.
    plain = _run(lens, scale, window=4)[1]
    assert not torch.allclose(plain, out)
