"""The front ends over a PipelineEngine: the AsyncEngine the worker drives, and offline use.

PipelineAsyncEngine is the AsyncEngine (one engine thread bridged to asyncio) whose engine is
a PipelineEngine; the engine thread drives `step()` exactly as it drives an LLMEngine, so the
worker's HTTP service needs no change beyond the factory. What it adds:
- `start()` launches the stage processes off the event loop;
- `shutdown()` stops the engine thread (which aborts every request) and then the pipeline,
  waiting for each in-flight step's tokens once before the stages exit;
- a stage dying or hanging makes `step()` raise on the engine thread, which fails every
  in-flight request with an ERROR output and sets `healthy = False`; `shutdown()` then
  cleans up, and a fresh PipelineAsyncEngine can be started in the same process.
While idle the engine thread still wakes every second and steps, which notices a dead stage.

PipelineLLM is `LLM` (generate / chat) over a pipeline:
    with PipelineLLM(model=DIR, pp_size=2, num_threads=1) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0))
pp_size=1 runs the plain one-process LLMEngine, so PP=N vs PP=1 is a one-argument change.
"""

from __future__ import annotations

import asyncio
from typing import Any

from shared.config import DEFAULT_MODEL, EngineConfig
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import LLMEngine
from shared.engine.llm import LLM
from shared.pipeline.config import PipelineConfig
from shared.pipeline.engine import PipelineEngine
from shared.pipeline.events import PipelineHooks


class PipelineAsyncEngine(AsyncEngine):
    """AsyncEngine whose engine is a PipelineEngine with `pipeline.pp_size` stages."""

    def __init__(self, config: EngineConfig, pipeline: PipelineConfig,
                 hooks: PipelineHooks | None = None) -> None:
        super().__init__(config)
        self.pipeline = pipeline
        self.hooks = hooks
        self._pipeline_engine: PipelineEngine | None = None

    async def start(self, engine: LLMEngine | None = None) -> None:
        if engine is None:
            engine = await asyncio.to_thread(PipelineEngine, self.config, self.pipeline,
                                             self.hooks)
        if isinstance(engine, PipelineEngine):
            self._pipeline_engine = engine
        try:
            await super().start(engine)
        except BaseException:
            await self._close_pipeline()
            raise

    async def shutdown(self) -> None:
        await super().shutdown()
        await self._close_pipeline()

    async def _close_pipeline(self) -> None:
        engine, self._pipeline_engine = self._pipeline_engine, None
        if engine is not None:
            await asyncio.to_thread(engine.close)


class PipelineLLM(LLM):
    """`LLM` whose engine is a PipelineEngine (pp_size >= 2) or an LLMEngine (pp_size 1).

    Keyword arguments: pp_size, pp_layer_partition (e.g. (3, 1)), or a whole `pipeline`
    PipelineConfig; `hooks` for tests; everything else is an EngineConfig field. Call
    `close()` or use it as a context manager to stop the stages.
    """

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "float32",
                 max_model_len: int | None = None, *, pp_size: int = 2,
                 pp_layer_partition: tuple[int, ...] | None = None,
                 pipeline: PipelineConfig | None = None, hooks: PipelineHooks | None = None,
                 **kwargs: Any) -> None:
        self.pipeline = pipeline or PipelineConfig(pp_size=pp_size,
                                                   layer_partition=pp_layer_partition)
        self.hooks = hooks
        super().__init__(model, dtype, max_model_len, **kwargs)

    def _build_engine(self, config: EngineConfig) -> LLMEngine:
        if self.pipeline.enabled:
            return PipelineEngine(config, self.pipeline, self.hooks)
        return LLMEngine.from_config(config)

    def close(self) -> None:
        if isinstance(self.engine, PipelineEngine):
            self.engine.close()

    def __enter__(self) -> PipelineLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
