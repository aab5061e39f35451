"""Shared helpers for the pipeline tests: configs, a run loop, references, leak checks."""

from __future__ import annotations

import random
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

VOCAB = 49152


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


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_engine(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
               late: dict[int, int] | None = None, max_steps: int = 5000,
               ) -> dict[int, RequestOutput]:
    """Run prompts[i] with params[i] (prompt i in `late` is added before step late[i]);
    returns each prompt's final output and checks the streamed deltas add up."""
    late = late or {}
    final: dict[int, RequestOutput] = {}
    streamed: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        if i not in late:
            engine.add_request(f"req-{i}", p, params[i])
    step = 0
    while engine.has_unfinished_requests() or any(step <= s for s in late.values()):
        for i, s in late.items():
            if s == step:
                engine.add_request(f"req-{i}", prompts[i], params[i])
        for out in engine.step():
            i = int(out.request_id.split("-")[1])
            streamed[i] += out.new_token_ids
            if out.finished:
                final[i] = out
        step += 1
        assert step < max_steps
    for i, out in final.items():
        assert streamed[i] == out.token_ids
    return final


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
