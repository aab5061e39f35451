"""Fixtures for MXFP4 integration tests: random checkpoints (make-model with SmolLM2's
tokenizer), written once per distinct spec per session.

Engines here use an untied lm_head unless a test is about the tied head: with tied embeddings
a random model's greedy output collapses into repeating the last prompt token.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shared.model.make_model import ModelSpec, write_checkpoint
from shared.model.registry import resolve_model


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """EngineConfig.num_threads sets torch's process-wide count: put it back after each test."""
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
def tiny_untied(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(preset="tiny", tie_word_embeddings=False, seed=0)


@pytest.fixture(scope="session")
def tiny_tied(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(preset="tiny", tie_word_embeddings=True, seed=1)
