"""Shared helpers for the pipeline tests: configs, a run loop, references, leak checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import read_config
from shared.pipeline.channel import Counter
from shared.pipeline.config import PipelineConfig
from shared.pipeline.engine import PipelineEngine
from tests.support.engine import run_engine


def block_bytes(ckpt: Path, block_size: int = 16) -> int:
    """fp32 KV bytes of one block over all layers, from the checkpoint's geometry."""
    c = read_config(ckpt)
    return c.num_layers * 2 * block_size * c.num_kv_heads * c.head_dim * 4


def engine_config(ckpt: Path, **overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = {"model": str(ckpt), "kv_cache_memory_bytes": 4 << 20,
                              "num_threads": 1, **overrides}
    if "kv_blocks" in fields:
        fields["kv_cache_memory_bytes"] = fields.pop("kv_blocks") * block_bytes(ckpt)
    return EngineConfig(**fields)


def pipeline_config(pp_size: int, **overrides: Any) -> PipelineConfig:
    return PipelineConfig(pp_size=pp_size, **{"step_timeout_s": 20.0, "connect_timeout_s": 60.0,
                                              **overrides})


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def reference(ckpt: Path, prompts: list[list[int]], params: list[SamplingParams],
              late: dict[int, int] | None = None, **overrides: Any) -> dict[int, RequestOutput]:
    """The same run on a one-process LLMEngine (PP=1)."""
    return run_engine(LLMEngine.from_config(engine_config(ckpt, **overrides)), prompts, params,
                      late)


def assert_quiescent(engine: PipelineEngine) -> None:
    """No handoff outstanding, nothing in flight, every block free, traffic balanced."""
    assert len(engine.ledger) == 0
    assert engine.num_in_flight == 0
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, stats
    assert engine.kv.ref_counts == [0] * engine.kv.num_blocks
    assert stats.num_running == stats.num_waiting == 0
    counters = engine.counters
    last = engine.pipeline.pp_size - 1
    assert counters[0, Counter.TOKEN_RECVS_POSTED] == engine.ledger.num_created
    assert counters[last, Counter.TOKENS_SENT] == engine.ledger.num_created
    assert counters[last, Counter.TOKEN_RECVS_ON_LAST] == 0
