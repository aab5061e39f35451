"""Fixtures for KV-transfer tests: in-process KV services on 127.0.0.1, always cleaned up."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from shared.model.make_model import ModelSpec, write_checkpoint
from shared.model.registry import resolve_model
from tests.support.kv import Node, start_node


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random-weight checkpoint (untied lm_head) for the tests with real engines."""
    tokenizer = resolve_model("smollm2-135m-instruct", progress=False)
    spec = ModelSpec(preset="small", tie_word_embeddings=False, seed=0)
    return write_checkpoint(tmp_path_factory.mktemp("kv-ckpt"), spec, tokenizer)


@pytest.fixture
async def nodes() -> AsyncIterator[Callable[..., Awaitable[Node]]]:
    """nodes(role, mode="pull", **options) -> a started Node; all stopped at teardown."""
    started: list[Node] = []

    async def make(role: str, mode: str = "pull", **options: object) -> Node:
        node = await start_node(role, mode, **options)
        started.append(node)
        return node

    yield make
    for node in started:
        await node.runner.cleanup()
