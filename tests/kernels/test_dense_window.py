"""Sliding-window attention in the native kernels (kernels/dense) against the plain-torch path.

Every compiled tier runs paged attention with a window (HF semantics: the query at position p
reads keys p - W < k <= p) on the fast (head_dim 64) and generic (head_dim 80) AVX-512 kernels
and the AVX2 one. The block-table entries wholly before a sequence's window point at a block
full of NaN, as the engine's dropped blocks point at block 0: one read of it would poison the
output, so equality also proves the kernels never read before the window. Whole windowed
models (every layer sliding, a Qwen2 mix of full and sliding layers, and a partially rotated
Phi-3 sliding every layer) run natively as close to the fp32 model as the plain bf16 path,
with the decode team bit-identical to the per-op driver.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

import kernels.dense as dense
from kernels.dense import LayerGeometry, NativeDecoder, StepTables
from shared.model.attention import AttentionMetadata, paged_attention
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import load_model
from shared.model.make_model import ModelSpec, write_checkpoint
from shared.model.rope import RopeConfig, RotaryEmbedding
from tests.support.dense import DENSE_TIERS, dense_or_skip

BLOCK, NUM_BLOCKS, POISON = 4, 160, 0
BATCHES = {
    "decode": ([9, 30, 1, 63], [1, 1, 1, 1]),
    "mixed": ([0, 7, 30], [5, 1, 3]),
    "prefill": ([0, 21], [40, 9]),
}


@pytest.fixture(scope="module", params=DENSE_TIERS)
def native(request: pytest.FixtureRequest) -> NativeDecoder:
    decoder = dense.decoder(dense_or_skip(request.param).backend)
    assert decoder is not None
    return decoder


def _tables(computed: list[int], sched: list[int]) -> list[list[int]]:
    """Distinct shuffled blocks per sequence, never block POISON."""
    perm = torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(3)) + 1
    tables, used = [], 0
    for c, s in zip(computed, sched, strict=True):
        n = -(-(c + s) // BLOCK)
        tables.append(perm[used:used + n].tolist())
        used += n
    return tables


def _drop_outside(tables: list[list[int]], computed: list[int], window: int) -> list[list[int]]:
    """Each table with the blocks no query of this step can read replaced by POISON."""
    out = []
    for table, c in zip(tables, computed, strict=True):
        first = max(0, c - window + 1)  # first key of the step's earliest query
        out.append([POISON if (i + 1) * BLOCK <= first else b for i, b in enumerate(table)])
    return out


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 80)])
@pytest.mark.parametrize("window", [1, 6, 17])
def test_windowed_attention_matches_torch_and_skips_dropped_blocks(
        native: NativeDecoder, batch: str, heads: int, kv_heads: int, head_dim: int,
        window: int) -> None:
    computed, sched = BATCHES[batch]
    tables = _tables(computed, sched)
    g = torch.Generator().manual_seed(head_dim + window)
    t = sum(sched)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(torch.bfloat16)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    rotary = RotaryEmbedding(RopeConfig(), head_dim, 2048, torch.bfloat16)
    geometry = LayerGeometry(heads, kv_heads, head_dim, 1e-5, head_dim ** -0.5)

    ref_cache = cache.clone()
    meta = AttentionMetadata.build(computed, sched, tables, BLOCK)
    positions = torch.cat([torch.arange(c, c + s) for c, s in zip(computed, sched, strict=True)])
    cos, sin = rotary.lookup(positions)
    qk = RotaryEmbedding.apply(qkv[:, : (heads + kv_heads) * head_dim].view(t, -1, head_dim),
                               cos, sin)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(t, kv_heads, head_dim)
    ref = paged_attention(qk[:, :heads], qk[:, heads:], v, ref_cache, meta, geometry.scale,
                          window)
    full = paged_attention(qk[:, :heads], qk[:, heads:], v, ref_cache.clone(), meta,
                           geometry.scale)

    cache[:, POISON] = float("nan")
    dropped = AttentionMetadata.build(computed, sched, _drop_outside(tables, computed, window),
                                      BLOCK)
    out = native.rope_attention(
        qkv, cache, rotary.table(max(c + s for c, s in zip(computed, sched, strict=True))),
        StepTables(dropped.block_tables, dropped.context_lens, dropped.query_start), geometry,
        window)
    assert torch.equal(cache[:, 1:], ref_cache[:, 1:])  # the same K/V written
    torch.testing.assert_close(out.float(), ref.reshape(t, -1).float(), rtol=2**-7, atol=1e-3)
    if window < max(c + s for c, s in zip(computed, sched, strict=True)):
        assert not torch.allclose(ref, full, atol=1e-2), "the window must change the result"


def test_native_rejects_a_negative_window(native: NativeDecoder) -> None:
    meta = AttentionMetadata.build([0], [3], [[1]], BLOCK)
    qkv = torch.zeros(3, 3 * 16, dtype=torch.bfloat16)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK, 1, 16, dtype=torch.bfloat16)
    table = RotaryEmbedding(RopeConfig(), 16, 64, torch.bfloat16).table(64)
    with pytest.raises(RuntimeError, match="window"):
        native.rope_attention(qkv, cache, table,
                              StepTables(meta.block_tables, meta.context_lens, meta.query_start),
                              LayerGeometry(1, 1, 16, 1e-5, 0.25), -1)


# ---- whole windowed models -------------------------------------------------------------------

# A 40-token prefill (past every window) next to short ones, then decode and a mixed step.
STEPS = [([0, 0, 0], [40, 3, 9]), ([40, 3, 9], [1, 1, 1]), ([41, 4, 10], [1, 1, 1]),
         ([42, 5, 11], [1, 6, 1])]
SPECS = {
    "mistral_all_sliding": ModelSpec(arch="mistral", sliding_window=7,
                                     tie_word_embeddings=False),
    "qwen2_mixed": ModelSpec(arch="qwen2", sliding_window=5, max_window_layers=1),
    # Both of the kernels' attention options at once: a window and Phi-4-mini's partial rotary.
    "phi3_partial_sliding": ModelSpec(arch="phi3", sliding_window=6, partial_rotary_factor=0.75,
                                      tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=list(SPECS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp(request.param), SPECS[request.param], None)


def _run(model: LlamaForCausalLM, steps: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """Logits of the last new token of every sequence at every step, over one fresh cache;
    blocks before every layer's window are dropped (POISON, zeros) as the engine does."""
    cfg = model.config
    kv = torch.zeros(model.num_local_layers, 2, NUM_BLOCKS, BLOCK, cfg.num_kv_heads,
                     cfg.head_dim, dtype=model.dtype)
    out = []
    for computed, sched in steps:
        tables = _tables(computed, sched)
        if cfg.kv_window is not None:
            tables = _drop_outside(tables, computed, cfg.kv_window)
        meta = AttentionMetadata.build(computed, sched, tables, BLOCK)
        ids = torch.arange(sum(sched)) * 37 % cfg.vocab_size
        positions = torch.cat([torch.arange(c, c + s)
                               for c, s in zip(computed, sched, strict=True)])
        with torch.no_grad():
            h = model(ids, positions, meta, kv)
        out.append(model.compute_logits(h[torch.tensor(sched).cumsum(0) - 1]))
    return torch.cat(out)


def test_windowed_native_model_matches_plain_torch(native: NativeDecoder,
                                                   checkpoint: Path) -> None:
    truth = _run(load_model(checkpoint, "float32")[0], STEPS)
    model = load_model(checkpoint, "bfloat16")[0]
    assert model.config.layer_windows
    plain = _run(model, STEPS)
    dense.accelerate_linears(model, native.path.backend)
    assert model.use_native(native) == model.num_local_layers
    fused = _run(model, STEPS)
    assert (fused - truth).abs().max() <= 1.25 * (plain - truth).abs().max()
    assert (fused - truth).abs().mean() <= 1.25 * (plain - truth).abs().mean()
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))
    # The per-op driver, and the per-layer calls, are the decode team's oracles, bit for bit.
    per_op = native.decoder_layers
    try:
        native.decoder_layers = partial(per_op, team=False)  # type: ignore[method-assign]
        assert torch.equal(_run(model, STEPS), fused)
    finally:
        native.decoder_layers = per_op  # type: ignore[method-assign]
    model._fused_stack = None
    assert torch.equal(_run(model, STEPS), fused)
