"""Fixtures shared by every test area: torch's thread count restored after each test, the
embedded model's tokenizer directory, and random-weight checkpoints written once per spec.

Engines in tests run on 1 thread (fast and stable on a busy 2-core box); EngineConfig's
num_threads sets torch's process-wide count, so each test puts it back, and likewise the
kernel-tier cap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kernels.tier import set_max_tier
from shared.config import kernel_tier_from_env
from shared.model.make_model import ModelSpec, write_checkpoint
from shared.model.registry import resolve_model


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _restore_kernel_tier() -> Iterator[None]:
    """Building an engine sets the process-wide kernel-tier cap (EngineConfig.kernel_tier);
    each test starts from the session's own: PDMESH_KERNEL_TIER, else auto. Running the suite
    with PDMESH_KERNEL_TIER=reference (or avx2...) thus caps every default kernel lookup too."""
    set_max_tier(kernel_tier_from_env())
    yield


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    return resolve_model("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory,
                    tokenizer_dir: Path) -> Callable[..., Path]:
    """make_checkpoint(**ModelSpec fields) -> checkpoint dir (SmolLM2's tokenizer), written
    once per distinct spec per session."""
    cache: dict[ModelSpec, Path] = {}

    def build(**fields: object) -> Path:
        spec = ModelSpec(**fields)  # type: ignore[arg-type]
        if spec not in cache:
            cache[spec] = write_checkpoint(tmp_path_factory.mktemp("ckpt"), spec, tokenizer_dir)
        return cache[spec]

    return build
