"""The engine with MXFP4 weights: greedy tokens equal those of the same engine running a dense
fp32 model whose linear weights are the reference (plain-torch) MXFP4 round trip.

Prefill batches (> 32 rows) run dequantise + torch matmul, decode steps (1..4 rows) the fused
C++ kernel from the packed bytes, so both paths are covered. Prompts mix lengths below and
above 32 tokens; they run together (batched decode) and one alone (single-row decode).
"""

from __future__ import annotations

import pytest

from services.cli import main as cli_main
from shared.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.model.loader import load_model
from shared.model.quant import DEFAULT_QUANTIZE_LM_HEAD, MXFP4Linear, QuantConfig
from tests.support.quant import (
    ENGINE,
    PROMPTS,
    engine_from,
    greedy,
    quantized_modules,
    replace_with_reference,
)


def reference_tokens(ckpt, quantize_lm_head: bool, batch: list[list[int]]) -> list[list[int]]:
    model, _ = load_model(ckpt, "float32")
    replace_with_reference(model, quantize_lm_head)
    return greedy(engine_from(model, ckpt), batch)


@pytest.mark.parametrize("quantize_lm_head", [False, True])
def test_greedy_equals_reference_dequantised_model(tiny_untied, quantize_lm_head):
    model, _ = load_model(tiny_untied, "float32",
                          quantization=QuantConfig(quantize_lm_head=quantize_lm_head))
    assert isinstance(model.lm_head, MXFP4Linear) == quantize_lm_head
    engine = engine_from(model, tiny_untied)
    batched = greedy(engine, PROMPTS)
    assert batched == reference_tokens(tiny_untied, quantize_lm_head, PROMPTS)
    assert all(len(t) == 32 for t in batched)
    alone = greedy(engine, PROMPTS[2:3])
    assert alone == reference_tokens(tiny_untied, quantize_lm_head, PROMPTS[2:3])
    # The comparison discriminates: the dense model's own tokens are different.
    dense, _ = load_model(tiny_untied, "float32")
    assert greedy(engine_from(dense, tiny_untied), PROMPTS) != batched


def test_qkv_bias_model_equals_reference(make_checkpoint):
    """Qwen2 (q/k/v biases): the fp32 bias is added by the kernel, as nn.Linear adds it."""
    ckpt = make_checkpoint(preset="tiny", arch="qwen2", tie_word_embeddings=False, seed=2)
    model, _ = load_model(ckpt, "float32", quantization=QuantConfig(quantize_lm_head=False))
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    assert greedy(engine_from(model, ckpt), PROMPTS) == reference_tokens(ckpt, False, PROMPTS)


def test_tied_head_quantised_keeps_the_embedding_dense(tiny_tied):
    model, _ = load_model(tiny_tied, "float32", quantization=QuantConfig(quantize_lm_head=True))
    dense, _ = load_model(tiny_tied, "float32")
    assert model.embed_tokens.weight.equal(dense.embed_tokens.weight)  # lookup stays exact
    assert greedy(engine_from(model, tiny_tied), PROMPTS) == reference_tokens(tiny_tied, True,
                                                                              PROMPTS)


def test_engine_config_quantization_loads_mxfp4(tiny_untied):
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_untied), quantization="mxfp4",
                                                dtype="float32", **ENGINE))
    quantized = quantized_modules(engine.runner.model)
    # 2 layers x (qkv, o, gate_up, down), plus the head when that is the default
    assert len(quantized) == 8 + DEFAULT_QUANTIZE_LM_HEAD
    assert greedy(engine, PROMPTS) == reference_tokens(tiny_untied, DEFAULT_QUANTIZE_LM_HEAD,
                                                       PROMPTS)


def test_engine_config_can_quantize_the_lm_head(tiny_untied):
    """--quantize-lm-head: the head joins the 8 decoder linears, same tokens as the reference."""
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_untied), quantization="mxfp4",
                                                quantize_lm_head=True, dtype="float32", **ENGINE))
    assert isinstance(engine.runner.model.lm_head, MXFP4Linear)
    assert len(quantized_modules(engine.runner.model)) == 9
    assert greedy(engine, PROMPTS) == reference_tokens(tiny_untied, True, PROMPTS)


def test_quantize_lm_head_needs_quantization():
    with pytest.raises(ValueError, match="needs quantization"):
        EngineConfig(quantize_lm_head=True)


def test_bf16_engine_runs_mxfp4(tiny_untied):
    """bf16 activations take the vdpbf16ps/bf16 paths: same shapes, finite, deterministic."""
    model, _ = load_model(tiny_untied, "bfloat16", quantization="mxfp4")
    first = greedy(engine_from(model, tiny_untied, "bfloat16"), PROMPTS)
    again = greedy(engine_from(model, tiny_untied, "bfloat16"), PROMPTS)
    assert first == again and all(len(t) == 32 for t in first)


def test_generate_command_passes_quantization(tiny_untied, capsys):
    rc = cli_main(["generate", "--model", str(tiny_untied), "--prompt", "Hello there",
                   "--max-tokens", "6", "--quantization", "mxfp4", "--threads", "1",
                   "--temperature", "0"])
    assert rc == 0
    assert capsys.readouterr().out.strip()
