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
from shared.model.make_model import ModelSpec, write_checkpoint
from shared.model.registry import resolve_model

SMALL = {"preset": "small", "tie_word_embeddings": False, "seed": 0}


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Engines here run on 1 thread (fast and stable on a busy 2-core box); EngineConfig's
    num_threads sets torch's process-wide count, so put it back after each test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    return resolve_model("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory,
                    tokenizer_dir: Path) -> Callable[..., Path]:
    """make_checkpoint(**ModelSpec fields) -> checkpoint dir, written once per distinct spec."""
    cache: dict[ModelSpec, Path] = {}

    def build(**fields: object) -> Path:
        spec = ModelSpec(**fields)  # type: ignore[arg-type]
        if spec not in cache:
            cache[spec] = write_checkpoint(tmp_path_factory.mktemp("ckpt"), spec, tokenizer_dir)
        return cache[spec]

    return build


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
