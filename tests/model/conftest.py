"""Fixtures for model tests: random checkpoints written once per distinct spec per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from shared.model.make_model import ModelSpec, write_checkpoint


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make_checkpoint(**ModelSpec fields) -> checkpoint dir, written once per distinct spec."""
    cache: dict[ModelSpec, Path] = {}

    def build(**fields: object) -> Path:
        spec = ModelSpec(**fields)  # type: ignore[arg-type]
        if spec not in cache:
            cache[spec] = write_checkpoint(tmp_path_factory.mktemp("ckpt"), spec, None)
        return cache[spec]

    return build
