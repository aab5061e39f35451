"""The real SmolLM2-135M in bf16: the engine's native decode path (fused decoder layers and
paged attention, chosen by LLMEngine.from_config) generates the same greedy tokens as the
plain-torch layers over the same dense GEMVs, for a concurrent batch of prompts of different
lengths (one prefill step, then batched decode steps)."""

from __future__ import annotations

from pathlib import Path

import pytest

import kernels.dense as dense
from shared.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import load_model
from shared.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village, there lived an old clockmaker who", "1, 2, 3,"]
NEW_TOKENS = 24


def _config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
                        num_threads=1, enable_prefix_caching=False)


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def test_native_engine_matches_plain_layers(tokenizer_dir: Path) -> None:
    native = LLMEngine.from_config(_config(tokenizer_dir))
    model = native.runner.model
    assert model.native is not None, "the native decode path should be active on this machine"
    assert all(layer.fused is not None for layer in model.layers)

    plain_model, model_config = load_model(tokenizer_dir, "bfloat16")
    dense.accelerate_linears(plain_model)  # the same GEMVs, plain-torch everything else
    plain = LLMEngine.from_model(_config(tokenizer_dir), plain_model, model_config,
                                 Tokenizer(tokenizer_dir))

    prompts = [native.tokenizer.encode(p) for p in PROMPTS]
    got, want = _greedy(native, prompts), _greedy(plain, prompts)
    assert all(len(t) == NEW_TOKENS for t in got.values())
    assert got == want
