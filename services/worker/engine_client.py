"""The slice of `shared.engine.AsyncEngine` the worker uses, and how the real one is built.

Written as a Protocol so tests can serve a deterministic fake engine through the same app.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

from shared.config import EngineConfig
from shared.engine.kv_connector import AsyncKVConnector, KVRequestOptions
from shared.engine.outputs import RequestOutput
from shared.engine.sampling_params import SamplingParams
from shared.engine.stats import EngineStats
from shared.engine.structured_spec import StructuredOutputSpec
from shared.pipeline.config import PipelineConfig


class TokenizerLike(Protocol):
    @property
    def eos_token_ids(self) -> Sequence[int]: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = ..., tools: Any = ...,
        continue_final_message: bool = ..., **kwargs: Any
    ) -> str: ...


class EngineClient(Protocol):
    """An engine that runs on its own thread and streams `RequestOutput`s to asyncio.

    Leaving a `generate` iterator early (or calling `abort`) frees the request's KV blocks
    within one engine step. An exception escaping an engine step fails the engine for good:
    every request gets an ERROR output at once, `healthy` turns False, `failure` says why and
    the failure listeners run. The P/D legs pass `generate` a `KVRequestOptions` and reach
    the engine's KV only through `kv_connector` (a mixed worker never does either).
    """

    tokenizer: TokenizerLike
    model_config: Any  # shared.model.config.ModelConfig (vocab_size...)
    config: EngineConfig
    engine_id: str
    max_model_len: int
    fingerprint: str
    model_dir: Path | None  # the resolved checkpoint directory (its generation_config.json...)
    kv_connector: AsyncKVConnector

    @property
    def healthy(self) -> bool: ...

    @property
    def failure(self) -> str | None:
        """Why the engine failed; None while it runs, and after a clean shutdown."""
        ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        kv: KVRequestOptions | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    def add_failure_listener(self, fn: Callable[[str], None]) -> None:
        """Call fn(reason) on the event loop once the engine has failed (every request it
        ran has then got an ERROR output, and new ones are refused)."""
        ...

    def abort(self, request_id: str) -> None: ...

    async def compile_grammar(self, spec: StructuredOutputSpec) -> None:
        """Compile a structured-output grammar into the engine's cache, off the event loop and
        within the configured time; InvalidStructuredOutput (with `param`) if it cannot be."""
        ...

    def stats(self) -> EngineStats: ...


EngineFactory = Callable[[EngineConfig], EngineClient]

# The casts below: EngineClient describes a started engine, while AsyncEngine types its
# tokenizer `Tokenizer | None`, None until start() (which the worker awaits before reading it,
# see services.worker.runtime). That member is the only mismatch today (drop the cast to see
# mypy's list); warn_redundant_casts flags the casts once AsyncEngine conforms as it is.


def real_engine_factory(config: EngineConfig) -> EngineClient:
    """Build the real AsyncEngine; imported lazily (torch) so the CLI and tests stay light."""
    from shared.engine.async_engine import AsyncEngine

    return cast(EngineClient, AsyncEngine(config))


def pipeline_engine_factory(pipeline: PipelineConfig) -> EngineFactory:
    """A factory for a pipeline-parallel worker: stage 0 runs here, the other stages are
    spawned by the engine (shared.pipeline). Imported lazily like the plain engine."""

    def make(config: EngineConfig) -> EngineClient:
        from shared.pipeline.facades import PipelineAsyncEngine

        return cast(EngineClient, PipelineAsyncEngine(config, pipeline))

    return make
