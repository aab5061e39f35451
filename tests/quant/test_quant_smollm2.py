"""The real SmolLM2-135M-Instruct with MXFP4 weights still knows the capital of France."""

from __future__ import annotations

import pytest

from shared.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_mxfp4_chat_knows_paris(tokenizer_dir):
    llm = LLM(model=str(tokenizer_dir), dtype="bfloat16", quantization="mxfp4",
              kv_cache_memory_bytes=16 << 20, num_threads=1)
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0.0, max_tokens=12))
    assert "Paris" in out.text, out.text
