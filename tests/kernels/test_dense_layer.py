"""The native fused decoder layer and paged attention (kernels/dense/layer.py) against the
plain-torch model code they replace: RoPE + paged_attention (shared/model), and whole
LlamaForCausalLM steps with and without use_native, over mixed prefill/decode batches of
sequences of different lengths in shuffled cache blocks."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

import kernels.dense as dense
from kernels.dense import LayerGeometry, NativeDecoder, Projection, StepTables
from shared.model.attention import AttentionMetadata, paged_attention
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import load_model
from shared.model.make_model import ModelSpec, write_checkpoint
from shared.model.rope import RopeConfig, RotaryEmbedding

BLOCK, NUM_BLOCKS = 4, 160
# (num_computed, num_scheduled) per sequence: decode rows next to prefill chunks.
BATCHES = {
    "decode": ([9, 30, 1, 63], [1, 1, 1, 1]),
    "mixed": ([0, 7, 30], [5, 1, 3]),
    "prefill": ([0], [200]),
}


@pytest.fixture(scope="module", params=("avx512_bf16", "avx512_fma"))
def native(request: pytest.FixtureRequest) -> NativeDecoder:
    """The ops on one GEMV backend. A failed build fails; only a CPU lacking it skips."""
    info = dense.build_info()
    assert info.state == "ready", f"dense build failed: {info.error}"
    if request.param not in info.available:
        pytest.skip(f"this CPU cannot run {request.param}")
    decoder = dense.decoder(request.param)
    assert decoder is not None
    return decoder


def _meta(computed: list[int], sched: list[int], seed: int) -> AttentionMetadata:
    """Each sequence gets distinct, shuffled blocks (block 0 unused, as the engine pads with it)."""
    perm = (torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed)) + 1)
    tables, used = [], 0
    for c, s in zip(computed, sched, strict=True):
        n = -(-(c + s) // BLOCK)
        tables.append(perm[used:used + n].tolist())
        used += n
    return AttentionMetadata.build(computed, sched, tables, BLOCK)


def _tables(meta: AttentionMetadata) -> StepTables:
    return StepTables(meta.block_tables, meta.context_lens, meta.query_start)


def _positions(computed: list[int], sched: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(c, c + s) for c, s in zip(computed, sched, strict=True)])


@pytest.mark.parametrize("batch", BATCHES)
# 64 and 128: the fast kernels (group 3 and 8); 32 and 80: the generic masked loop.
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 128), (4, 4, 32), (8, 2, 80)])
def test_rope_attention_matches_torch(native: NativeDecoder, batch: str, heads: int,
                                      kv_heads: int, head_dim: int) -> None:
    computed, sched = BATCHES[batch]
    meta = _meta(computed, sched, seed=heads)
    g = torch.Generator().manual_seed(head_dim)
    t = sum(sched)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(torch.bfloat16)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    rotary = RotaryEmbedding(RopeConfig(), head_dim, 2048, torch.bfloat16)
    geometry = LayerGeometry(heads, kv_heads, head_dim, 1e-5, head_dim ** -0.5)

    ref_cache = cache.clone()
    cos, sin = rotary.lookup(_positions(computed, sched))
    qk = RotaryEmbedding.apply(qkv[:, : (heads + kv_heads) * head_dim].view(t, -1, head_dim),
                               cos, sin)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(t, kv_heads, head_dim)
    ref = paged_attention(qk[:, :heads], qk[:, heads:], v, ref_cache, meta, geometry.scale)

    out = native.rope_attention(qkv, cache, rotary.table(max(c + s for c, s in
                                                             zip(computed, sched, strict=True))),
                                _tables(meta), geometry)
    # RoPE rounds to bf16 after every op exactly as torch does: the written K/V are identical.
    assert torch.equal(cache, ref_cache)
    # fp32 attention both sides; only summation order differs before the final bf16 rounding.
    torch.testing.assert_close(out.float(), ref.reshape(t, -1).float(), rtol=2**-7, atol=1e-3)


def test_bad_block_table_raises(native: NativeDecoder) -> None:
    meta = _meta([3], [1], seed=0)
    bad = StepTables(torch.full_like(meta.block_tables, NUM_BLOCKS), meta.context_lens,
                     meta.query_start)
    qkv = torch.zeros(1, 5 * 16, dtype=torch.bfloat16)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK, 1, 16, dtype=torch.bfloat16)
    table = RotaryEmbedding(RopeConfig(), 16, 64, torch.bfloat16).table(64)
    with pytest.raises(RuntimeError, match="block id out of range"):
        native.rope_attention(qkv, cache, table, bad, LayerGeometry(3, 1, 16, 1e-5, 0.25))


# ---- whole model steps ------------------------------------------------------------------------

@cache
def _checkpoint(arch: str, root: Path) -> Path:
    return write_checkpoint(root / f"layer-{arch}", ModelSpec(arch=arch, preset="tiny"), None)


def _run(model: LlamaForCausalLM, steps: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """Logits of the last new token of every sequence at every step, over one fresh cache."""
    cfg = model.config
    kv = torch.zeros(model.num_local_layers, 2, NUM_BLOCKS, BLOCK, cfg.num_kv_heads,
                     cfg.head_dim, dtype=model.dtype)
    out = []
    for computed, sched in steps:
        meta = _meta(computed, sched, seed=1)  # same seed: each sequence keeps its blocks
        ids = torch.arange(sum(sched)) * 37 % cfg.vocab_size
        with torch.no_grad():
            h = model(ids, _positions(computed, sched), meta, kv)
        last = torch.tensor(sched).cumsum(0) - 1
        out.append(model.compute_logits(h[last]))
    return torch.cat(out)


# Three sequences: a 40-token prefill (torch's GEMM + native attention) next to two short
# ones, then decode steps (the fused layer), then a mixed step.
STEPS = [([0, 0, 0], [40, 3, 9]), ([40, 3, 9], [1, 1, 1]), ([41, 4, 10], [1, 1, 1]),
         ([42, 5, 11], [1, 6, 1])]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: qkv bias
def test_native_model_matches_plain_torch(native: NativeDecoder, arch: str,
                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    ckpt = _checkpoint(arch, tmp_path_factory.getbasetemp())
    truth = _run(load_model(ckpt, "float32")[0], STEPS)
    model = load_model(ckpt, "bfloat16")[0]
    plain = _run(model, STEPS)
    dense.accelerate_linears(model, native.path.backend)
    assert model.use_native(native) == model.num_local_layers  # every layer fused
    fused = _run(model, STEPS)
    # As close to the fp32 model as the plain bf16 path, and the same greedy tokens.
    assert (fused - truth).abs().max() <= 1.25 * (plain - truth).abs().max()
    assert (fused - truth).abs().mean() <= 1.25 * (plain - truth).abs().mean()
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


def test_per_layer_calls_equal_the_stacked_call(native: NativeDecoder,
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """decoder_layers (one call per step) is decoder_layer applied layer by layer, exactly."""
    model = load_model(_checkpoint("qwen2", tmp_path_factory.getbasetemp()), "bfloat16")[0]
    dense.accelerate_linears(model, native.path.backend)
    model.use_native(native)
    stacked = _run(model, STEPS)
    model._fused_stack = None  # what a model with only some layers fused runs
    assert torch.equal(_run(model, STEPS), stacked)


def test_use_native_refuses_fp32(native: NativeDecoder, tmp_path_factory: pytest.TempPathFactory
                                 ) -> None:
    model = load_model(_checkpoint("llama", tmp_path_factory.getbasetemp()), "float32")[0]
    with pytest.raises(ValueError, match="bf16"):
        model.use_native(native)


def test_native_mxfp4_model_matches_plain_torch(native: NativeDecoder,
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """MXFP4 layers fuse as well, with kernels.mxfp4's fused GEMV inside the native block."""
    ckpt = _checkpoint("llama", tmp_path_factory.getbasetemp())
    truth = _run(load_model(ckpt, "float32", quantization="mxfp4")[0], STEPS)
    model = load_model(ckpt, "bfloat16", quantization="mxfp4")[0]
    plain = _run(model, STEPS)
    assert model.use_native(native) == model.num_local_layers
    assert all(layer.fused is not None and layer.fused.packed for layer in model.layers)
    fused = _run(model, STEPS)
    assert (fused - truth).abs().max() <= 1.25 * (plain - truth).abs().max()
    assert (fused - truth).abs().mean() <= 1.25 * (plain - truth).abs().mean()
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the fp32 qkv bias of MXFP4Linear
def test_fused_mxfp4_block_equals_the_native_ops(native: NativeDecoder, arch: str,
                                                 tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    """The fused MXFP4 stack runs exactly the kernels of the op-by-op native path (norms,
    MXFP4Linear's fused op, attention, SiLU, adds), so its decode steps are bit-identical. The
    52-row prefill step takes the op-by-op path in both runs (past FUSED_MAX_ROWS)."""
    ckpt = _checkpoint(arch, tmp_path_factory.getbasetemp())
    model = load_model(ckpt, "bfloat16", quantization="mxfp4")[0]
    model.use_native(native)
    stacked = _run(model, STEPS)
    for layer in model.layers:
        layer.fused = None
    model._fused_stack = None
    assert torch.equal(_run(model, STEPS), stacked)


def test_fused_layer_rejects_a_mislabelled_projection() -> None:
    """A packed weight must come with scales, and a dense one must be bf16 2-D."""
    with pytest.raises(ValueError, match="uint8 3-D"):
        Projection(torch.zeros(4, 1, 16, dtype=torch.bfloat16), torch.zeros(4, 1,
                                                                              dtype=torch.uint8))
    with pytest.raises(ValueError, match="bfloat16 2-D"):
        Projection(torch.zeros(4, 1, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="fp32|float32"):
        Projection(torch.zeros(4, 1, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8),
                   torch.zeros(4, dtype=torch.bfloat16))
