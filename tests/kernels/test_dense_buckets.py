"""Prefill GEMM row buckets: torch's bf16 GEMM (oneDNN) builds and caches a primitive per
shape, about 0.6 MB each, so a worker that saw every prompt length grew without a visible
bound (the soak's decode worker, +10% after warm-up). Prefill rows are padded to one of eight
buckets per power of two, and the engine builds every bucket's GEMMs at start-up.

Checked here: the bucket rule's bounds, the padded product against an fp64 oracle, and, on an
engine of every tier this CPU runs, that prompts of lengths never seen before create no new
bf16 GEMM primitive (oneDNN's own creation log is the witness).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kernels.dense as dense
from kernels.dense.backend import BF16_GEMM_TIERS, onednn_bf16_gemm
from shared.config import EngineConfig
from shared.engine.accelerate import prebuild_gemm_shapes
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.kernel_tiers import backend_tier, cpu_tier, read_cpu_flags


def test_rows_up_to_max_rows_are_not_padded() -> None:
    assert [dense.padded_rows(r) for r in range(dense.MAX_ROWS + 1)] == list(
        range(dense.MAX_ROWS + 1))


def test_a_bucket_adds_at_most_an_eighth_and_is_its_own_bucket() -> None:
    for rows in range(dense.MAX_ROWS + 1, 20_000):
        padded = dense.padded_rows(rows)
        assert rows <= padded <= rows + rows // 8, rows
        assert dense.padded_rows(padded) == padded, rows


def test_eight_buckets_per_doubling() -> None:
    buckets = dense.row_buckets(16_384)
    assert buckets == sorted({dense.padded_rows(r) for r in range(dense.MAX_ROWS + 1, 16_385)})
    for low in (32, 64, 128, 1024, 8192):
        assert len([b for b in buckets if low < b <= 2 * low]) == 8, low
    assert dense.row_buckets(dense.MAX_ROWS) == []
    assert dense.row_buckets(2000)[-1] == 2048  # the budget's own bucket is included


@pytest.mark.parametrize("rows", [33, 100, 257, 1000])
def test_the_padded_product_is_the_product(rows: int) -> None:
    """Zero rows added then sliced off: each row within the bf16 bound of the fp64 product."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    w = (torch.randn(40, 96, generator=g) / 10).bfloat16()
    b = torch.randn(40, generator=g).bfloat16()
    got = dense.bucketed_linear(x, w, b)
    exact = x.double() @ w.double().T + b.double()
    assert got.shape == (rows, 40) and got.dtype == torch.bfloat16 and got.is_contiguous()
    bound = 2 ** -8 * exact.abs() + 96 * 2 ** -24 * (x.double().abs() @ w.double().abs().T)
    assert ((got.double() - exact).abs() <= bound + 1e-6).all()


TIERS = ["avx512_bf16", "avx512", "avx2", "reference"]


def _onednn_bf16_cpu() -> bool:
    """From /proc/cpuinfo, the rule torch states for its bf16 oneDNN path: AVX-512 BW/VL/DQ,
    or AVX2 with the VNNI-2 bf16 conversions (AVX-NE-CONVERT)."""
    flags = read_cpu_flags()
    assert flags is not None, "no /proc/cpuinfo"
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


@pytest.mark.parametrize("tier", TIERS)
def test_new_prompt_lengths_build_no_new_gemm(make_checkpoint: Callable[..., Path], tier: str,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    if backend_tier(tier) > cpu_tier():
        pytest.skip(f"this CPU cannot run {tier}")
    engine = LLMEngine.from_config(EngineConfig(
        model=str(make_checkpoint(preset="tiny", seed=0)), dtype="bfloat16",
        kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=512, kernel_tier=tier))
    linears = [m for m in engine.runner.model.modules() if isinstance(m, dense.DenseLinear)]
    assert linears and {str(m.path.backend) for m in linears} == {tier}
    assert onednn_bf16_gemm() == _onednn_bf16_cpu()
    gemm_in_bf16 = backend_tier(tier) in BF16_GEMM_TIERS and onednn_bf16_gemm()
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
        for i, length in enumerate((37, 211, 333, 509)):  # lengths the warm-up never ran
            engine.add_request(f"r{i}", [100 + (j * 7919) % 30_000 for j in range(length)],
                               SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    log = capfd.readouterr().out.splitlines()
    bf16_gemms = [line for line in log if ",matmul," in line and "src:bf16" in line]
    assert [line for line in bf16_gemms if "cache_miss" in line] == []
    if gemm_in_bf16:  # the prompts did run through oneDNN's bf16 GEMM, from its cache
        assert any("cache_hit" in line for line in bf16_gemms)
    else:  # widened to fp32, or torch's own bf16 GEMM (no AVX-512): oneDNN ran none in bf16
        assert bf16_gemms == []
    # from_config built them: running the pre-build again builds the same shapes (none where
    # bf16 products are widened to fp32: no bf16 GEMM to cache).
    assert (prebuild_gemm_shapes(engine.runner.model, engine.config) > 0) == gemm_in_bf16
