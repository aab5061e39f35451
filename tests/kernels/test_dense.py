"""Dense decode linear: the C++ kernels of every compiled tier against float64 on the same
bf16-rounded values, dispatch to torch, the tier ladder's choice, and accelerate_linears on a
real (tiny, random) model against the same model before the swap and in fp32.

What equality means here, per tier (each tier runs every test below, or skips because this CPU
cannot execute it):
- GEMV (all tiers): not bit-exact against anything. Each output is within (K + 2) eps32
  sum|x w| of the float64 product (the fp32 accumulation bound that torch's fp32 F.linear
  meets too), plus the final bf16 rounding for bf16 x. The tiers sum in different orders
  (AVX-512: 16 lanes per vector; AVX2: 8 lanes in four fixed chains), so they agree only to
  within that bound.
- Within a tier: bit-identical for 1 and 2 threads (outputs are split across threads, never a
  sum), and a row gets the same bits whatever batch of up to 32 it comes in (each tier's
  summation order is fixed per output: speculative decoding's verify rows rely on it).
- What the kernels do not take (prefill rows, fp32 weights): exactly torch's F.linear.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from torch import nn

import kernels.dense as dense
from kernels import tier
from kernels.dense import Backend, DenseLinear, KernelPath, reference_linear
from kernels.dense.build import peek
from shared.model.attention import AttentionMetadata
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import load_model
from shared.model.make_model import ModelSpec, write_checkpoint
from tests.support.dense import DENSE_TIERS, dense_or_skip

SMOLLM2_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]  # (in, out)
BATCHES = [1, 2, 7, 16, 32]
DTYPES = [torch.float32, torch.bfloat16]
EPS32 = 2.0**-24


@pytest.fixture(scope="module", params=DENSE_TIERS)
def dense_kernel(request: pytest.FixtureRequest) -> KernelPath:
    """One compiled dense tier; a failed build fails, only a CPU lacking the tier skips."""
    return dense_or_skip(request.param)


@cache
def _weight(in_f: int, out_f: int) -> torch.Tensor:
    """Random bf16 W [out_f, in_f] with 1/sqrt(fan_in) scale, shared per shape."""
    g = torch.Generator().manual_seed(in_f * 7 + out_f)
    return (torch.randn(out_f, in_f, generator=g) * in_f**-0.5).to(torch.bfloat16)


def _inputs(m: int, in_f: int, out_f: int, dtype: torch.dtype, bias: bool, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed + 1000 * m + in_f)
    x = torch.randn(m, in_f, generator=g).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype) if bias else None
    return x, b


def _assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
                  ) -> None:
    """y within (K + 2) eps32 sum|x w| of the float64 product (the fp32 accumulation bound,
    which torch's fp32 F.linear on the same values must meet too); bf16 y adds its rounding."""
    x64, w64 = x.double().reshape(-1, x.shape[-1]), w.double()
    b64 = torch.zeros(w.shape[0], dtype=torch.float64) if b is None else b.double()
    exact = x64 @ w64.T + b64
    bound = (x.shape[-1] + 2) * EPS32 * (x64.abs() @ w64.abs().T + b64.abs()) + 1e-30
    oracle = reference_linear(x.float(), w, None if b is None else b.float())
    assert ((oracle.double().reshape(exact.shape) - exact).abs() <= bound).all()
    if y.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2.0**-8
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    err = (y.double().reshape(exact.shape) - exact).abs()
    assert (err <= bound).all(), f"error {(err / bound).max().item():.3g}x the fp32 bound"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32x", "bf16x"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m", BATCHES)
@pytest.mark.parametrize(("in_f", "out_f"), SMOLLM2_SHAPES)
def test_smollm2_shapes(dense_kernel: KernelPath, in_f: int, out_f: int, m: int, bias: bool,
                        dtype: torch.dtype) -> None:
    w = _weight(in_f, out_f)
    x, b = _inputs(m, in_f, out_f, dtype, bias)
    y = dense_kernel.linear(x, w, b)
    assert y.shape == (m, out_f)
    cols = _checked_columns(out_f)
    _assert_close(y[:, cols], x, w[cols], None if b is None else b[cols])


def _checked_columns(out_f: int, limit: int = 4096) -> torch.Tensor:
    """All columns, or (for the vocab-sized lm_head) the first and last 512 and 3072 random
    others: the float64 oracle over all 49152 would dominate the test time."""
    if out_f <= limit:
        return torch.arange(out_f)
    middle = torch.randperm(out_f - 1024, generator=torch.Generator().manual_seed(out_f))[:3072]
    return torch.cat([torch.arange(512), 512 + middle.sort().values, torch.arange(out_f - 512, out_f)])


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32x", "bf16x"])
@pytest.mark.parametrize("m", [1, 3, 7, 32])
@pytest.mark.parametrize(("in_f", "out_f"),
                         [(1, 9), (31, 8), (33, 17), (100, 37), (129, 1), (333, 37)])
def test_k_and_n_tails(dense_kernel: KernelPath, in_f: int, out_f: int, m: int, dtype: torch.dtype) -> None:
    """Every tile shape: m = 32 at K = 333 takes the blocked tiles (x > 20 KiB) and their
    one-column remainder (N % 4 == 1), smaller x the streaming ones."""
    w = _weight(in_f, out_f)
    x, b = _inputs(m, in_f, out_f, dtype, bias=True)
    _assert_close(dense_kernel.linear(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32x", "bf16x"])
def test_strided_rows_read_nothing_past_k(dense_kernel: KernelPath, dtype: torch.dtype) -> None:
    """A weight view with row stride > K (a slice of a wider matrix) whose neighbours are Inf."""
    wide = torch.full((37, 140), float("inf"), dtype=torch.bfloat16)
    wide[:, :100] = _weight(100, 37)
    w = wide[:, :100]
    x, b = _inputs(5, 100, 37, dtype, bias=True)
    y = dense_kernel.linear(x, w, b)
    assert torch.isfinite(y).all()
    _assert_close(y, x, w, b)


def test_leading_dims_and_empty_batch(dense_kernel: KernelPath) -> None:
    w = _weight(100, 37)
    x = torch.randn(2, 3, 100)
    _assert_close(dense_kernel.linear(x, w), x, w, None)
    assert dense_kernel.linear(torch.empty(0, 100), w).shape == (0, 37)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32x", "bf16x"])
@pytest.mark.parametrize("m", [1, 7, 32])  # 32 rows at K = 1536: the blocked tiles
@pytest.mark.parametrize(("in_f", "out_f"), [(576, 1536), (1536, 576)])
def test_threads_split_rows_not_sums(dense_kernel: KernelPath, in_f: int, out_f: int, m: int,
                                     dtype: torch.dtype) -> None:
    """Each output is summed by one thread: 1 and 2 threads agree bit for bit."""
    w = _weight(in_f, out_f)
    x, b = _inputs(m, in_f, out_f, dtype, bias=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dense_kernel.linear(x, w, b)
        torch.set_num_threads(2)
        two = dense_kernel.linear(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("backend", [*DENSE_TIERS, "reference"])
def test_torch_runs_what_the_kernels_do_not_take(backend: str) -> None:
    """Over MAX_ROWS rows (prefill), fp32 weights: exactly torch's F.linear (bf16: on rows
    padded to their bucket); bf16 prefill on a
    tier without bf16 dot products: torch's fp32 F.linear rounded to bf16 once (prefill_linear,
    which torch's bf16 GEMM matches up to the order of its fp32 sums)."""
    if backend not in dense.available_backends():
        pytest.skip(f"this CPU cannot run {backend}")
    w = _weight(100, 37)
    x, b = _inputs(dense.MAX_ROWS + 1, 100, 37, torch.bfloat16, bias=True)
    got = dense.linear(x, w, b, backend)
    if backend in ("avx2", "avx512"):
        want = torch.nn.functional.linear(x.float(), w.float(), b.float()).bfloat16()
        assert torch.equal(got, want)
        bf16_gemm = torch.nn.functional.linear(x, w, b)  # one bf16 rounding apart at most
        assert torch.allclose(got.float(), bf16_gemm.float(), rtol=2 ** -7, atol=2 ** -7)
    else:  # torch's bf16 GEMM, on the rows padded to their bucket (test_dense_buckets.py)
        padded = torch.cat([x, x.new_zeros(dense.padded_rows(x.shape[0]) - x.shape[0], 100)])
        assert torch.equal(got, torch.nn.functional.linear(padded, w, b)[:x.shape[0]])
    x32 = x[:4].float()
    assert torch.equal(dense.linear(x32, w.float(), None, backend),
                       torch.nn.functional.linear(x32, w.float()))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32x", "bf16x"])
def test_rows_do_not_depend_on_the_batch(dense_kernel: KernelPath, dtype: torch.dtype) -> None:
    """Every tier sums each output in one fixed order: a row alone, or at any place in a batch
    of up to 32 (every tile shape: streaming, blocked and, on AVX2, paired from 12 rows, or 16
    for a weight slice over 8 MiB as 576 x 16384 is), gets the same bits. K = 333 and 50 end
    in a tail chunk of even and odd index."""
    path = dense_kernel
    for in_f, out_f in [(576, 192), (1536, 576), (333, 37), (50, 24), (576, 16384)]:
        w = _weight(in_f, out_f)
        x, b = _inputs(32, in_f, out_f, dtype, bias=True)
        batch = path.linear(x, w, b)
        for m in (1, 2, 3, 4, 5, 7, 8, 11, 12, 13, 15, 16, 17, 32):
            assert torch.equal(path.linear(x[:m], w, b), batch[:m])
        for r in (0, 7, 31):
            assert torch.equal(path.linear(x[r:r + 1], w, b), batch[r:r + 1])


def test_autograd_runs_torch(dense_kernel: KernelPath) -> None:
    """A call autograd must record goes to F.linear (the C++ op has no backward)."""
    layer = DenseLinear(nn.Parameter(_weight(100, 37).clone()), None, dense_kernel)
    x = torch.randn(3, 100, dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    torch.testing.assert_close(x.grad, layer.weight.detach().sum(0).expand(3, -1))


def test_bad_input_raises() -> None:
    w = _weight(100, 37)
    with pytest.raises(ValueError, match="does not match"):
        dense.linear(torch.randn(2, 99), w)
    with pytest.raises(ValueError, match="bias"):
        dense.linear(torch.randn(2, 100), w, torch.randn(36))
    with pytest.raises(ValueError, match="unknown backend"):
        dense.linear(torch.randn(2, 100), w, backend="avx9000")


# ---- the ladder: which backend None picks, and what each tier refuses ---------------------------

def test_backends_are_the_tiers() -> None:
    """Each backend names its kernels.tier rung; the C++ path ids are kernels.mxfp4's."""
    assert [b.tier for b in Backend] == [tier.Tier.REFERENCE, tier.Tier.AVX2, tier.Tier.AVX512,
                                         tier.Tier.AVX512_BF16]
    assert all(str(b) == b.tier.label for b in Backend)
    assert {b: b.path_id for b in Backend if b is not Backend.REFERENCE} == {
        Backend.AVX512: 1, Backend.AVX2: 2, Backend.AVX512_BF16: 3}


@pytest.mark.parametrize("cap", list(tier.Tier))
def test_default_backend_follows_the_cap(cap: tier.Tier) -> None:
    """backend=None: the fastest runnable backend whose tier <= the cap, re-resolved after every
    set_max_tier; build_info reports the CPU's tier, the cap and that choice."""
    available = dense.available_backends()
    before = tier.max_tier()
    try:
        dense.kernel_path()  # resolved (and cached) under the old cap first
        tier.set_max_tier(cap)
        want = next(b for b in available if Backend(b).tier <= cap)
        assert dense.kernel_path().backend == want
        info = dense.build_info()
        assert (info.active, info.max_tier, info.cpu_tier) == (want, cap.label, available[0])
        # The reference runs anything: under a cap the decoder may be None, never a higher tier.
        native = dense.decoder()
        assert (native is None) == (want == "reference")
        assert native is None or native.path.backend == want
    finally:
        tier.set_max_tier(before)


def test_ops_refuse_a_tier_this_cpu_cannot_run() -> None:
    """Every C++ op checks its path: an unknown id, and each tier this CPU lacks, raise."""
    info = dense.build_info()
    result = peek()
    assert result is not None and result.library is not None, f"build failed: {info.error}"
    ops = result.library.ops
    x, w = torch.zeros(1, 64, dtype=torch.bfloat16), _weight(64, 8)
    refused = [0, 99] + [b.path_id for b in Backend
                         if b is not Backend.REFERENCE and str(b) not in info.available]
    for path in refused:
        with pytest.raises(RuntimeError, match="cannot run"):
            ops.linear(x, w, None, path)
        with pytest.raises(RuntimeError, match="cannot run"):
            ops.rms_norm(x, x[0], 1e-5, path)
        with pytest.raises(RuntimeError, match="cannot run"):
            ops.silu_mul(x, path)
        with pytest.raises(RuntimeError, match="cannot run"):
            ops.add_(x.clone(), x, path)
    for backend in Backend:
        if str(backend) not in info.available:
            with pytest.raises(dense.BackendUnavailableError, match="this CPU cannot run the .* tier"):
                dense.kernel_path(backend)


# ---- accelerate_linears on a real model -------------------------------------------------------

def _logits(model: LlamaForCausalLM, chunks: list[list[int]]) -> torch.Tensor:
    """Prefill chunks[0], then one step per further chunk, over a fresh paged cache."""
    cfg = model.config
    kv = torch.zeros(model.num_local_layers, 2, 32, 4, cfg.num_kv_heads, cfg.head_dim,
                     dtype=model.dtype)
    out, done = [], 0
    for chunk in chunks:
        meta = AttentionMetadata.build([done], [len(chunk)], [list(range(1, 32))], 4)
        with torch.no_grad():
            h = model(torch.tensor(chunk), torch.arange(done, done + len(chunk)), meta, kv)
            out.append(model.compute_logits(h))
        done += len(chunk)
    return torch.cat(out)


@cache
def _checkpoint(arch: str, root: Path) -> Path:
    return write_checkpoint(root / arch, ModelSpec(arch=arch, preset="tiny"), None)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: qkv bias
def test_accelerate_linears_keeps_outputs(arch: str, dense_kernel: KernelPath,
                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    ckpt = _checkpoint(arch, tmp_path_factory.getbasetemp())
    decode = [[20, 300, 4000, 5000, 77], [123], [456], [789]]
    truth = _logits(load_model(ckpt, "float32")[0], decode)
    model = load_model(ckpt, "bfloat16")[0]
    before, prefill_before = _logits(model, decode), _logits(model, [list(range(40, 80))])
    linears = sum(type(mod) is nn.Linear for mod in model.modules())
    # The tier is named, so a lower cap (PDMESH_KERNEL_TIER) does not turn the swap off.
    assert dense.accelerate_linears(model, dense_kernel.backend) == linears == 2 * 4 + 1
    assert not any(type(mod) is nn.Linear for mod in model.modules())
    assert isinstance(model.lm_head, DenseLinear)
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: still one Parameter
    after = _logits(model, decode)
    # As close to the fp32 model as torch's bf16 matmul got, and the same greedy tokens.
    assert (after - truth).abs().max() <= 1.25 * (before - truth).abs().max()
    assert (after - truth).abs().mean() <= 1.25 * (before - truth).abs().mean()
    assert torch.equal(after.argmax(-1), before.argmax(-1))
    # 40 prefill tokens exceed MAX_ROWS: torch's matmul, unchanged bit for bit; on a tier
    # without bf16 dot products its fp32 matmul (prefill_linear), as close to fp32 as bf16's.
    prefill_after = _logits(model, [list(range(40, 80))])
    if model.lm_head.path.backend in (Backend.AVX2, Backend.AVX512):
        prefill_truth = _logits(load_model(ckpt, "float32")[0], [list(range(40, 80))])
        err_after = (prefill_after - prefill_truth).abs()
        err_before = (prefill_before - prefill_truth).abs()
        assert err_after.max() <= 1.25 * err_before.max()
        assert err_after.mean() <= 1.25 * err_before.mean()
    else:
        assert torch.equal(prefill_after, prefill_before)


def test_accelerate_linears_leaves_fp32_models_alone(tmp_path_factory: pytest.TempPathFactory
                                                     ) -> None:
    model = load_model(_checkpoint("llama", tmp_path_factory.getbasetemp()), "float32")[0]
    assert dense.accelerate_linears(model) == 0
    assert isinstance(model.lm_head, nn.Linear)
