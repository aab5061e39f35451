"""The real SmolLM2-135M-Instruct (embedded GGUF, converted): greedy fp32 tokens equal HF
transformers' `generate`, and the bf16 chat answer knows the capital of France."""

from __future__ import annotations

import pytest
import torch

from shared.engine import LLM, SamplingParams
from tests.support.engine import hf_greedy

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,", "1, 2, 3, 4,"]


def test_greedy_fp32_matches_hf(tokenizer_dir):
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(tokenizer_dir), dtype="float32", kv_cache_memory_bytes=64 << 20,
              num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    hf = AutoModelForCausalLM.from_pretrained(tokenizer_dir, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, out.prompt_token_ids, 32), prompt


def test_bf16_chat_knows_paris(tokenizer_dir):
    llm = LLM(model=str(tokenizer_dir), dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
              num_threads=1)
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0.0, max_tokens=24))
    assert "Paris" in out.text
