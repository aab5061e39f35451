"""Fixtures for KV-transfer tests: in-process KV services on 127.0.0.1, always cleaned up."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from kv_helpers import Node, start_node


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
