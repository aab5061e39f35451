"""Pipeline parallelism: a worker's layers split across stage processes (gloo on loopback).

Exports resolve lazily (PEP 562) so that reading `PipelineConfig` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "PipelineConfig": "shared.pipeline.config",
    "parse_partition": "shared.pipeline.config",
    "PipelineEngine": "shared.pipeline.engine",
    "PipelineState": "shared.pipeline.engine",
    "PipelineAsyncEngine": "shared.pipeline.facades",
    "PipelineLLM": "shared.pipeline.facades",
    "PipelineError": "shared.pipeline.handoff",
    "TokenHandoff": "shared.pipeline.handoff",
    "EventLog": "shared.pipeline.events",
    "EventKind": "shared.pipeline.events",
    "PipelineHooks": "shared.pipeline.events",
}
__all__ = [
    "EventKind", "EventLog", "PipelineAsyncEngine", "PipelineConfig", "PipelineEngine",
    "PipelineError", "PipelineHooks", "PipelineLLM", "PipelineState", "TokenHandoff",
    "parse_partition",
]

if TYPE_CHECKING:
    from shared.pipeline.config import PipelineConfig, parse_partition
    from shared.pipeline.engine import PipelineEngine, PipelineState
    from shared.pipeline.events import EventKind, EventLog, PipelineHooks
    from shared.pipeline.facades import PipelineAsyncEngine, PipelineLLM
    from shared.pipeline.handoff import PipelineError, TokenHandoff


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shared.pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
