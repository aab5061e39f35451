"""Fixtures for engine tests: random-weight checkpoints (make-model, SmolLM2 tokenizer) and
HF transformers references computed once per session.

The checkpoints use an untied lm_head: with tied embeddings a random model's greedy output
collapses into repeating the last prompt token, which would hide KV-cache bugs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shared.config import EngineConfig
from shared.engine.engine import LLMEngine

SMALL = {"preset": "small", "tie_word_embeddings": False, "seed": 0}


@pytest.fixture(scope="session")
def small_ckpt(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(**SMALL)


@pytest.fixture(scope="session")
def make_engine(small_ckpt: Path) -> Callable[..., LLMEngine]:
    """make_engine(**EngineConfig overrides) -> a fresh LLMEngine on the small checkpoint.

    kv_blocks=N sets kv_cache_memory_bytes to exactly N blocks."""
    def build(kv_blocks: int | None = None, **overrides: object) -> LLMEngine:
        if kv_blocks is not None:
            overrides["kv_cache_memory_bytes"] = kv_blocks * block_bytes(small_ckpt)
        fields = {"model": str(small_ckpt), "kv_cache_memory_bytes": 8 << 20, "num_threads": 1,
                  **overrides}
        return LLMEngine.from_config(EngineConfig(**fields))  # type: ignore[arg-type]

    return build


@pytest.fixture(scope="session")
def hf_model(small_ckpt: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(small_ckpt, dtype=torch.float32).eval()


def block_bytes(ckpt: Path, block_size: int = 16) -> int:
    """fp32 KV bytes of one block over all layers, from the checkpoint's geometry."""
    from shared.model.loader import read_config

    c = read_config(ckpt)
    return c.num_layers * 2 * block_size * c.num_kv_heads * c.head_dim * 4
