"""The inference engine: scheduler, paged KV cache, model runner, sampler, and the offline
(`LLM`) and asyncio (`AsyncEngine`) front ends.

Exports resolve lazily (PEP 562), so importing a light submodule such as
`shared.engine.sampling_params` (the router does) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "shared.engine.llm",
    "CompletionOutput": "shared.engine.llm",
    "GenerationOutput": "shared.engine.llm",
    "AsyncEngine": "shared.engine.async_engine",
    "EngineDeadError": "shared.engine.async_engine",
    "EngineState": "shared.engine.async_engine",
    "LLMEngine": "shared.engine.engine",
    "EngineStats": "shared.engine.stats",
    "PrefilledKV": "shared.engine.request",
    "SamplingParams": "shared.engine.sampling_params",
    "RequestOutput": "shared.engine.outputs",
    "FinishReason": "shared.engine.outputs",
    "TokenLogprob": "shared.engine.outputs",
}
__all__ = [
    "LLM", "AsyncEngine", "CompletionOutput", "EngineDeadError", "EngineState", "EngineStats", "FinishReason",
    "GenerationOutput", "LLMEngine", "PrefilledKV", "RequestOutput", "SamplingParams",
    "TokenLogprob",
]

if TYPE_CHECKING:
    from shared.engine.async_engine import AsyncEngine, EngineDeadError, EngineState
    from shared.engine.engine import LLMEngine
    from shared.engine.llm import LLM, CompletionOutput, GenerationOutput
    from shared.engine.outputs import FinishReason, RequestOutput, TokenLogprob
    from shared.engine.request import PrefilledKV
    from shared.engine.sampling_params import SamplingParams
    from shared.engine.stats import EngineStats


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shared.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
