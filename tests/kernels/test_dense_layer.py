"""The native fused decoder layer and paged attention (kernels/dense/layer.py) against the
plain-torch model code they replace: the elementwise ops, RoPE + paged_attention (shared/model),
and whole LlamaForCausalLM steps with and without use_native, over mixed prefill/decode batches
of sequences of different lengths in shuffled cache blocks. Every compiled tier runs every test
(or skips because this CPU cannot execute it).

What equality means, per op (the same on every tier):
- add_, RoPE and the K/V cache writes: bit-exact against torch (fp32 math, one bf16 rounding
  per op, exactly as torch's bf16 ops round).
- rms_norm, silu_mul: within 2 bf16 ulps (relative 2^-7) of the plain-torch model's ops, and
  nearly all elements bit-equal. They differ from torch only in a reduction order (the sum of
  squares) or the exp approximation (relative error < 2e-7), which can flip a bf16 rounding.
- Across tiers: all elementwise ops and the cache writes are bit-identical (the AVX2 kernels
  compute the AVX-512 ones' operations in the same order); attention agrees within the bound
  below (8- vs 16-lane dot products).
- Attention: fp32 on both sides; within rtol 2^-7, atol 1e-3 of torch's paged_attention.
- Whole models: logits no further from the fp32 model than the plain bf16 path (x 1.25), and
  the same greedy tokens; the stacked call equals the per-layer calls bit for bit; 1 and 2
  threads give identical logits (outputs are split across threads, never a sum).
"""

from __future__ import annotations

import threading
from functools import cache, partial
from pathlib import Path

import pytest
import torch

import kernels.dense as dense
from kernels import mxfp4
from kernels.dense import LayerGeometry, NativeDecoder, Projection, StepTables
from shared.model.attention import AttentionMetadata, paged_attention
from shared.model.llama import LlamaForCausalLM, RMSNorm
from shared.model.loader import load_model
from shared.model.make_model import ModelSpec, write_checkpoint
from shared.model.quant import QuantConfig
from shared.model.rope import RopeConfig, RotaryEmbedding
from tests.support.dense import DENSE_TIERS, dense_or_skip

BLOCK, NUM_BLOCKS = 4, 160
# (num_computed, num_scheduled) per sequence: decode rows next to prefill chunks. Sequences of
# 64+ new rows (16+ on the avx512_bf16 tier) take the blocked (flash) attention: a whole prompt
# (causal), a later chunk over cached context (the offset mask), and two of them around a
# decode row (the per-row kernel runs the rows between); "short_chunk" is blocked on the
# avx512_bf16 tier only.
BATCHES = {
    "decode": ([9, 30, 1, 63], [1, 1, 1, 1]),
    "mixed": ([0, 7, 30], [5, 1, 3]),
    "prefill": ([0], [200]),
    "chunk": ([120], [100]),
    "long_mixed": ([0, 5, 70], [80, 1, 64]),
    "short_chunk": ([3, 90, 40], [1, 40, 20]),
}


@pytest.fixture(scope="module", params=DENSE_TIERS)
def native(request: pytest.FixtureRequest) -> NativeDecoder:
    """The ops of one tier. A failed build fails; only a CPU lacking the tier skips."""
    decoder = dense.decoder(dense_or_skip(request.param).backend)
    assert decoder is not None
    return decoder


def _mxfp4_backend(native: NativeDecoder) -> str:
    """The kernels.mxfp4 backend on the code path native's fused layer calls for MXFP4
    projections (its tier's), so that MXFP4Linear and the fused block run the same kernel."""
    for backend in mxfp4.available_backends():
        b = mxfp4.Backend(backend)
        if b is not mxfp4.Backend.REFERENCE and b.path_id == native.mxfp4_path:
            return backend
    pytest.skip(f"the loaded mxfp4 library does not report code path {native.mxfp4_path} "
                f"({native.path.backend}); available: {mxfp4.available_backends()}")


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
# 64 and 128: the fast kernels (group 3 and 8); 32 and 80: the generic masked loop. Partial
# rotary: Phi-4-mini's 96-wide heads rotating 72 channels (a 36-lane masked tail), and half of 32.
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "partial"), [
    (9, 3, 64, 1.0), (8, 1, 128, 1.0), (4, 4, 32, 1.0), (8, 2, 80, 1.0), (8, 2, 96, 0.75),
    (4, 4, 32, 0.5)])
def test_rope_attention_matches_torch(native: NativeDecoder, batch: str, heads: int,
                                      kv_heads: int, head_dim: int, partial: float) -> None:
    computed, sched = BATCHES[batch]
    meta = _meta(computed, sched, seed=heads)
    g = torch.Generator().manual_seed(head_dim)
    t = sum(sched)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(torch.bfloat16)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    rotary = RotaryEmbedding(RopeConfig(partial_rotary_factor=partial), head_dim, 2048,
                             torch.bfloat16)
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
    assert out.shape == (t, heads * head_dim)
    # RoPE rounds to bf16 after every op exactly as torch does: the written K/V are identical.
    assert torch.equal(cache, ref_cache)
    # fp32 attention both sides; only summation order differs before the final bf16 rounding.
    # Blocked rows (a sequence of 64+ new rows, 16+ on the avx512_bf16 tier): both flash
    # kernels round the softmax probabilities to bf16 before P @ V, as HF's sdpa attention does
    # in bf16 (|error| < 2^-8).
    atol = 2**-8 if max(sched) >= 16 else 1e-3
    torch.testing.assert_close(out.float(), ref.reshape(t, -1).float(), rtol=2**-7, atol=atol)


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _within_bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> None:
    """got within 2 bf16 ulps (relative 2^-7) of want everywhere, and bit-equal almost everywhere
    (a flipped rounding is rare)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    err = (got.double() - want.double()).abs()
    assert (err <= 2.0**-7 * want.double().abs()).all()
    assert torch.eq(got, want).double().mean() >= 0.98


# (rows, width): one row, a partial 8/16-lane tail, SmolLM2's hidden and intermediate sizes.
ELEMENTWISE_SHAPES = [(1, 576), (3, 37), (7, 1536), (20, 200)]


@pytest.mark.parametrize(("rows", "n"), ELEMENTWISE_SHAPES)
def test_elementwise_ops_match_torch(native: NativeDecoder, rows: int, n: int) -> None:
    h, y = _bf16(rows, n, seed=n), _bf16(rows, n, seed=n + 1, scale=0.3)
    norm = RMSNorm(n, 1e-5, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(_bf16(n, seed=n + 2) + 1)
    w = norm.weight.detach()

    summed = h.clone()
    native.add_(summed, y)
    assert torch.equal(summed, h + y)  # bit-exact: one fp32 add, one RNE rounding
    with torch.no_grad():
        _within_bf16_ulps(native.rms_norm(h, w, 1e-5), norm(h))
        fused = h.clone()
        _within_bf16_ulps(native.add_rms_norm(fused, y, w, 1e-5), norm(h + y))
    assert torch.equal(fused, h + y)
    gu = _bf16(rows, 2 * n, seed=n + 3, scale=3.0)
    gate, up = gu[:, :n], gu[:, n:]
    _within_bf16_ulps(native.silu_mul(gu), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("other", [t for t in DENSE_TIERS if t != "avx2"])
def test_tiers_agree(other: str) -> None:
    """Elementwise ops and the cache writes: bit-identical across tiers. Attention: both within
    fp32 summation error of each other (8- vs 16-lane dot products)."""
    low, high = (dense.decoder(dense_or_skip(t).backend) for t in ("avx2", other))
    rows, n = 7, 1536
    h, y, gu = _bf16(rows, n, seed=1), _bf16(rows, n, seed=2), _bf16(rows, 2 * n, seed=3)
    w = _bf16(n, seed=4)
    assert torch.equal(low.rms_norm(h, w, 1e-5), high.rms_norm(h, w, 1e-5))
    assert torch.equal(low.silu_mul(gu), high.silu_mul(gu))
    a, b = h.clone(), h.clone()
    assert torch.equal(low.add_rms_norm(a, y, w, 1e-5), high.add_rms_norm(b, y, w, 1e-5))
    assert torch.equal(a, b)
    for heads, kv_heads, head_dim in [(9, 3, 64), (8, 2, 80), (8, 1, 128)]:
        computed, sched = BATCHES["mixed"]
        meta = _meta(computed, sched, seed=heads)
        t = sum(sched)
        qkv = _bf16(t, (heads + 2 * kv_heads) * head_dim, seed=heads)
        caches = [_bf16(2, NUM_BLOCKS, BLOCK, kv_heads, head_dim, seed=5) for _ in range(2)]
        table = RotaryEmbedding(RopeConfig(), head_dim, 2048, torch.bfloat16).table(64)
        geometry = LayerGeometry(heads, kv_heads, head_dim, 1e-5, head_dim ** -0.5)
        outs = [d.rope_attention(qkv, c, table, _tables(meta), geometry)
                for d, c in zip((low, high), caches, strict=True)]
        assert torch.equal(caches[0], caches[1])
        torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=2**-7, atol=1e-3)


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


# Decode-sized steps only (every projection on the dense GEMV; torch's prefill GEMM is not ours
# to vouch for): a 24-row first step, then decode and a mixed step.
SMALL_STEPS = [([0, 0, 0], [12, 3, 9]), ([12, 3, 9], [1, 1, 1]), ([13, 4, 10], [1, 6, 1])]


def _small_model(native: NativeDecoder, arch: str, packed: bool, base: Path) -> LlamaForCausalLM:
    """The bf16 checkpoint with the tier's dense GEMV, or (packed) its MXFP4 linears on the
    code path the tier's fused layer calls."""
    if packed:
        quant = QuantConfig(backend=_mxfp4_backend(native))
        return load_model(_checkpoint(arch, base), "bfloat16", quantization=quant)[0]
    model = load_model(_checkpoint(arch, base), "bfloat16")[0]
    dense.accelerate_linears(model, native.path.backend)
    return model


@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "mxfp4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_threads_do_not_change_results(native: NativeDecoder, arch: str, packed: bool,
                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    """The fused stack splits outputs (GEMV columns, norm rows, attention items) across
    threads, never a sum: 1 and 2 threads give the same logits bit for bit."""
    model = _small_model(native, arch, packed, tmp_path_factory.getbasetemp())
    assert model.use_native(native) == model.num_local_layers
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(model, SMALL_STEPS)
        torch.set_num_threads(2)
        two = _run(model, SMALL_STEPS)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "mxfp4"])
def test_the_team_in_a_serving_thread_equals_the_main_thread(
        native: NativeDecoder, packed: bool, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A server decodes on its engine thread while other threads (the loader, KV transfer)
    have run parallel torch ops and left OpenMP pools behind. libgomp then barely spins at its
    own barriers, so the team synchronises with its own (csrc/decode_team.cpp, TeamBarrier):
    with two OpenMP pools alive, a team on a second thread gives the main thread's logits."""
    model = _small_model(native, "llama", packed, tmp_path_factory.getbasetemp())
    assert model.use_native(native) == model.num_local_layers
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        main = _run(model, SMALL_STEPS)
        results: dict[str, torch.Tensor] = {}

        def other_pool() -> None:  # a parallel op here gives this thread a pool of its own
            torch.randn(1 << 20).exp_()
            results["other"] = _run(model, SMALL_STEPS)

        worker = threading.Thread(target=other_pool)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results["other"], main)


@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "mxfp4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_team_equals_the_per_op_driver(native: NativeDecoder, arch: str, threads: int,
                                              packed: bool,
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """Decode-sized steps run every layer in one parallel region (csrc/decode_team.cpp); the
    per-op driver (a region per projection, norm and attention) is its oracle: bit for bit,
    on decode rows, a 24-row first step (the blocked GEMV tiles) and a mixed step. MXFP4
    projections in the team run kernels.mxfp4's kernel on each thread's column slice; the
    per-op driver calls its op (its own column split), so this also checks that a column's
    bits do not depend on the split."""
    model = _small_model(native, arch, packed, tmp_path_factory.getbasetemp())
    assert model.use_native(native) == model.num_local_layers
    per_op = native.decoder_layers
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        team = _run(model, SMALL_STEPS)
        native.decoder_layers = partial(per_op, team=False)  # type: ignore[method-assign]
        oracle = _run(model, SMALL_STEPS)
    finally:
        native.decoder_layers = per_op  # type: ignore[method-assign]
        torch.set_num_threads(saved)
    assert torch.equal(team, oracle)


def test_int8_activations_fuse_and_match_their_oracle(
        native: NativeDecoder, tmp_path_factory: pytest.TempPathFactory) -> None:
    """quant_activations int8 (W4A8): every layer still fuses, the team on 2 threads equals the
    per-op driver on 1, bit for bit. The oracle is the plain-torch bf16 model whose MXFP4
    linears run reference.linear_a8: the fused logits stay within 2 bf16 ulps of its largest
    logit, with the same greedy tokens, and their mean distance is under a quarter of what
    int8 activations change (the same oracle with float activations), so the kernel computes
    the int8 function, not the float one."""
    base = tmp_path_factory.getbasetemp()
    ckpt = _checkpoint("llama", base)
    int8 = mxfp4.Activations.INT8
    a8 = dense.decoder(native.path.backend, mxfp4_int8=True)
    assert a8 is not None and a8.mxfp4_path == native.mxfp4_path | 16
    quant = QuantConfig(backend=_mxfp4_backend(native), activations=int8)
    model = load_model(ckpt, "bfloat16", quantization=quant)[0]
    assert model.use_native(a8) == model.num_local_layers
    per_op = a8.decoder_layers
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        team = _run(model, SMALL_STEPS)
        a8.decoder_layers = partial(per_op, team=False)  # type: ignore[method-assign]
        torch.set_num_threads(1)
        single = _run(model, SMALL_STEPS)
    finally:
        a8.decoder_layers = per_op  # type: ignore[method-assign]
        torch.set_num_threads(saved)
    assert torch.equal(team, single)

    def oracle(activations: mxfp4.Activations) -> torch.Tensor:
        quant = QuantConfig(backend="reference", activations=activations)
        return _run(load_model(ckpt, "bfloat16", quantization=quant)[0], SMALL_STEPS)

    oracle_a8, oracle_float = oracle(int8), oracle(mxfp4.Activations.FLOAT)
    err = (team - oracle_a8).abs()
    assert err.max() <= 2 * 2.0**-8 * oracle_a8.abs().max()
    assert err.mean() < 0.25 * (oracle_a8 - oracle_float).abs().mean()
    assert torch.equal(team.argmax(-1), oracle_a8.argmax(-1))


def test_use_native_refuses_fp32(native: NativeDecoder, tmp_path_factory: pytest.TempPathFactory
                                 ) -> None:
    model = load_model(_checkpoint("llama", tmp_path_factory.getbasetemp()), "float32")[0]
    with pytest.raises(ValueError, match="bf16"):
        model.use_native(native)


def test_native_partial_rotary_model_matches_plain_torch(
        native: NativeDecoder, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A Phi-4-mini-style model (partial_rotary_factor 0.75) fuses every layer; its logits are
    no further from the fp32 model than the plain bf16 path's, with the same greedy tokens."""
    spec = ModelSpec(arch="phi3", preset="tiny", partial_rotary_factor=0.75)
    ckpt = write_checkpoint(tmp_path_factory.getbasetemp() / "layer-phi3-partial", spec, None)
    truth = _run(load_model(ckpt, "float32")[0], STEPS)
    model = load_model(ckpt, "bfloat16")[0]
    assert model.rotary.rotary_dim < model.config.head_dim
    plain = _run(model, STEPS)
    dense.accelerate_linears(model, native.path.backend)
    assert model.use_native(native) == model.num_local_layers
    fused = _run(model, STEPS)
    assert (fused - truth).abs().max() <= 1.25 * (plain - truth).abs().max()
    assert (fused - truth).abs().mean() <= 1.25 * (plain - truth).abs().mean()
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


def test_native_mxfp4_model_matches_plain_torch(native: NativeDecoder,
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """MXFP4 layers fuse as well, with kernels.mxfp4's fused GEMV (on the code path of the
    dense tier's own tier) inside the native block."""
    quant = QuantConfig(backend=_mxfp4_backend(native))
    ckpt = _checkpoint("llama", tmp_path_factory.getbasetemp())
    truth = _run(load_model(ckpt, "float32", quantization=quant)[0], STEPS)
    model = load_model(ckpt, "bfloat16", quantization=quant)[0]
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
    quant = QuantConfig(backend=_mxfp4_backend(native))
    ckpt = _checkpoint(arch, tmp_path_factory.getbasetemp())
    model = load_model(ckpt, "bfloat16", quantization=quant)[0]
    assert model.use_native(native) == model.num_local_layers
    stacked = _run(model, STEPS)
    for layer in model.layers:
        layer.fused = None
    model._fused_stack = None
    assert torch.equal(_run(model, STEPS), stacked)


def test_mxfp4_on_another_code_path_runs_the_native_ops_unfused(
        native: NativeDecoder, tmp_path_factory: pytest.TempPathFactory) -> None:
    """MXFP4 linears on a code path other than the one the fused block would call (here the
    scalar one) are not fused: the layers run the native norms, attention, SiLU and adds around
    MXFP4Linear, as close to the fp32 model as plain torch and with its greedy tokens."""
    quant = QuantConfig(backend="scalar")
    ckpt = _checkpoint("llama", tmp_path_factory.getbasetemp())
    truth = _run(load_model(ckpt, "float32", quantization=quant)[0], STEPS)
    model = load_model(ckpt, "bfloat16", quantization=quant)[0]
    plain = _run(model, STEPS)
    assert model.use_native(native) == 0 and model.native is native
    unfused = _run(model, STEPS)
    assert (unfused - truth).abs().max() <= 1.25 * (plain - truth).abs().max()
    assert (unfused - truth).abs().mean() <= 1.25 * (plain - truth).abs().mean()
    assert torch.equal(unfused.argmax(-1), plain.argmax(-1))


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
