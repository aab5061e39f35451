"""Helpers for MXFP4 integration tests: the reference-dequantised model and greedy runs."""

from __future__ import annotations

import random

import torch
from torch import nn

from kernels import mxfp4
from shared.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.model.llama import LlamaForCausalLM
from shared.model.quant import DEFAULT_ENCODER, MXFP4Linear
from shared.model.tokenizer import Tokenizer

ENGINE = {"kv_cache_memory_bytes": 4 << 20, "num_threads": 1}
VOCAB = 49152


def random_prompts(lengths: list[int], seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


# Lengths below and above 32: prefill batches take the > 32-row path, decode the fused one.
PROMPTS = random_prompts([5, 17, 40, 70])


def reference_dequantised(w: torch.Tensor,
                          encoder: mxfp4.Encoder = DEFAULT_ENCODER) -> torch.Tensor:
    """W -> dequantize(quantize(W)) on the plain-torch oracle, fp32 (the loader's default
    encoder unless told)."""
    blocks, scales = mxfp4.quantize(w, backend="reference", encoder=encoder)
    return mxfp4.dequantize(blocks, scales, torch.float32, backend="reference")


def replace_with_reference(model: LlamaForCausalLM, quantize_lm_head: bool) -> None:
    """Give a dense model's Linear weights their reference MXFP4 round trip, in place.

    A tied head gets its own Parameter (the embedding stays dense), as MXFP4Linear does.
    """
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or (name == "lm_head" and not quantize_lm_head):
            continue
        module.weight = nn.Parameter(reference_dequantised(module.weight.detach()),
                                     requires_grad=False)


def engine_from(model: LlamaForCausalLM, tokenizer_dir, dtype: str = "float32") -> LLMEngine:
    config = EngineConfig(model=str(tokenizer_dir), dtype=dtype, **ENGINE)  # type: ignore[arg-type]
    return LLMEngine.from_model(config, model, model.config, Tokenizer(tokenizer_dir))


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 32) -> list[list[int]]:
    """Greedy tokens of every prompt, all run together (continuous batching), EOS ignored."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"q-{i}", p, params)
    final: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[int(out.request_id.split("-")[1])] = out.token_ids
    return [final[i] for i in range(len(prompts))]


def quantized_modules(model: nn.Module) -> dict[str, MXFP4Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, MXFP4Linear)}
