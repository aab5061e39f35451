"""MXFP4Linear and the load-time swap: packed weights equal the reference quantisation bit for
bit, and every forward path computes what the kernels define."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels import mxfp4
from kernels.tier import Tier
from shared.model.loader import iter_weights, load_model, open_checkpoint
from shared.model.quant import DequantScratch, MXFP4Linear, QuantConfig, quantize_linears
from tests.support.quant import quantized_modules, reference_dequantised

DECODER_LINEARS = {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}


def make_linear(n: int, k: int, bias: bool, scratch_bytes: int = 1 << 20,
                backend: str | None = None) -> tuple[MXFP4Linear, torch.Tensor]:
    """An MXFP4Linear loaded from a random W [n, k]; returns it and W's reference round trip."""
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen)
    module = MXFP4Linear(k, n, bias, mxfp4.kernel_path(backend), DequantScratch(scratch_bytes))
    module.load("weight", w, 0, n, "w")
    if bias:
        module.bias.copy_(torch.randn(n, generator=gen))
    return module, reference_dequantised(w)


@pytest.mark.parametrize("quantize_lm_head", [False, True])
def test_swap_covers_every_decoder_linear(tiny_untied, quantize_lm_head):
    model, _ = load_model(tiny_untied, "float32",
                          quantization=QuantConfig(quantize_lm_head=quantize_lm_head))
    names = set(quantized_modules(model))
    expected = {f"layers.{i}.{n}" for i in range(2) for n in DECODER_LINEARS}
    assert names == expected | ({"lm_head"} if quantize_lm_head else set())
    assert not any(type(m) is nn.Linear for n, m in model.named_modules() if n != "lm_head")


@pytest.mark.parametrize("encoder", list(mxfp4.Encoder))
def test_loaded_packing_equals_reference_quantize(tiny_untied, encoder):
    """Each HF tensor (q, k, v...) is quantised into its slice of the fused module."""
    model, config = load_model(tiny_untied, "bfloat16",
                               quantization=QuantConfig(quantize_lm_head=True, encoder=encoder))
    stored = dict(iter_weights(open_checkpoint(tiny_untied).weight_files))
    qkv = model.layers[1].self_attn.qkv_proj
    fused = torch.cat([stored[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    blocks, scales = mxfp4.quantize(fused, backend="reference", encoder=encoder)  # stored fp32
    assert torch.equal(qkv.weight_blocks, blocks) and torch.equal(qkv.weight_scales, scales)
    head_blocks, head_scales = mxfp4.quantize(stored["lm_head.weight"], backend="reference",
                                              encoder=encoder)
    assert torch.equal(model.lm_head.weight_blocks, head_blocks)
    assert torch.equal(model.lm_head.weight_scales, head_scales)
    assert config.vocab_size == model.lm_head.out_features


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_prefill_rows_equal_dequantise_then_matmul(dtype, bias):
    """Over 32 rows: dequantise exactly (into the shared scratch) and call torch's matmul, in
    x's dtype; bf16 x on a compiled tier without bf16 dot products multiplies in fp32 and
    rounds once (torch's bf16 GEMM is slow there: kernels.dense.backend.prefill_linear)."""
    module, w = make_linear(96, 64, bias)
    x = torch.randn(45, 64).to(dtype)
    gemm = dtype
    if dtype == torch.bfloat16 and module.path.backend.tier not in (Tier.REFERENCE,
                                                                    Tier.AVX512_BF16):
        gemm = torch.float32
    bias_t = None if module.bias is None else module.bias.to(gemm)
    want = F.linear(x.to(gemm), w.to(gemm), bias_t).to(dtype)
    assert torch.equal(module(x), want)


@pytest.mark.parametrize("rows", [1, 2, 7, 32])
@pytest.mark.parametrize("bias", [False, True])
def test_decode_rows_within_fp32_accumulation_bound(rows, bias):
    """Up to 32 rows: the fused kernel; checked against the float64 product within the fp32
    accumulation bound (K+2)*2^-24*sum|x||w| (the bound the reference matmul meets too)."""
    module, w = make_linear(160, 96, bias)
    x = torch.randn(rows, 96)
    got = module(x)
    want = x.double() @ w.double().T + (0 if module.bias is None else module.bias.double())
    bound = (96 + 2) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    assert got.dtype == torch.float32 and got.shape == (rows, 160)
    assert ((got.double() - want).abs() <= bound + 1e-30).all()


def test_oversized_weight_runs_the_fused_kernel_by_32_row_slices():
    """A weight larger than the scratch is never dequantised: 32-row slices of the fused op."""
    module, _ = make_linear(128, 64, True, scratch_bytes=1024)
    x = torch.randn(70, 64)
    want = torch.cat([mxfp4.linear(x[i:i + 32], module.weight_blocks, module.weight_scales,
                                   module.bias) for i in range(0, 70, 32)])
    assert torch.equal(module(x), want)


def test_reference_backend_and_3d_input_match_the_kernel_api():
    module, _ = make_linear(64, 64, True, backend="reference")
    x = torch.randn(3, 5, 64)
    want = mxfp4.linear(x, module.weight_blocks, module.weight_scales, module.bias,
                        backend="reference")
    assert torch.equal(module(x), want)


def test_scratch_is_shared_and_reused(tiny_untied):
    model, _ = load_model(tiny_untied, "float32", quantization="mxfp4")
    modules = list(quantized_modules(model).values())
    assert len({id(m.scratch) for m in modules}) == 1
    scratch = modules[0].scratch
    first = scratch.view(8, 8, torch.float32)
    assert scratch.view(4, 4, torch.float32).data_ptr() == first.data_ptr()


def test_in_features_must_be_a_multiple_of_32():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(48, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_linears(model, QuantConfig())


def test_load_rejects_a_wrong_shape():
    module, _ = make_linear(64, 64, False)
    with pytest.raises(ValueError, match="expected"):
        module.load("weight", torch.zeros(64, 32), 0, 64, "w")
    with pytest.raises(ValueError, match="expected"):
        module.load("weight_scales", torch.zeros(64, 2), 0, 64, "w")  # float, not uint8
