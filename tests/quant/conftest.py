"""Fixtures for MXFP4 integration tests: random checkpoints (make-model with SmolLM2's
tokenizer), written once per distinct spec per session.

Engines here use an untied lm_head unless a test is about the tied head: with tied embeddings
a random model's greedy output collapses into repeating the last prompt token.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_untied(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(preset="tiny", tie_word_embeddings=False, seed=0)


@pytest.fixture(scope="session")
def tiny_tied(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(preset="tiny", tie_word_embeddings=True, seed=1)
