"""Fixtures for pipeline tests: a small random checkpoint (4 layers, so PP=3 fits; untied
lm_head so greedy output does not collapse) and a bounded, one-thread engine config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.model.make_model import ModelSpec, write_checkpoint
from shared.model.registry import resolve_model


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Stage 0 sets torch's process-wide thread count; put it back after each test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer_dir = resolve_model("smollm2-135m-instruct", progress=False)
    spec = ModelSpec(preset="small", tie_word_embeddings=False, seed=0)
    return write_checkpoint(tmp_path_factory.mktemp("pp-ckpt"), spec, tokenizer_dir)
