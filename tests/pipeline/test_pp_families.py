"""Every model family through pipeline parallelism: PP=2 gives the one-process engine's tokens.

One small random checkpoint per family beyond Llama (whose run is test_equivalence.py); the
family's own HF parity is tests/model/test_llama_vs_hf.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.model.make_model import VOCAB_SIZE, ModelSpec, write_checkpoint
from shared.model.registry import resolve_model
from shared.pipeline.engine import PipelineEngine
from tests.support.engine import random_prompts, run_engine
from tests.support.gpt_oss_ckpt import write_gpt_oss
from tests.support.pipeline import (
    assert_quiescent,
    engine_config,
    greedy,
    pipeline_config,
    reference,
)

FAMILIES = {
    # QK-norm and a head_dim (48) that is not hidden / heads (32).
    "qwen3": ModelSpec(arch="qwen3", preset="small", tie_word_embeddings=False, head_dim=48,
                       seed=3),
    # Fused qkv_proj/gate_up_proj in the checkpoint; Phi-4-mini's partial rotary.
    "phi3": ModelSpec(arch="phi3", preset="small", tie_word_embeddings=False, seed=3,
                      partial_rotary_factor=0.75),
    # Qwen2 with layers 0-1 full and 2-3 sliding over 8 positions: each stage gets its own
    # layers' windows (by global index).
    "qwen2_sliding": ModelSpec(arch="qwen2", preset="small", tie_word_embeddings=False, seed=3,
                               sliding_window=8, max_window_layers=2),
    # Every layer slides: the engine drops blocks while both stages run.
    "mistral_sliding": ModelSpec(arch="mistral", preset="small", tie_word_embeddings=False,
                                 seed=3, sliding_window=8),
    # Routed experts on layers 1 and 3 (decoder_sparse_step 2): one sparse layer per stage.
    "qwen3_moe": ModelSpec(arch="qwen3_moe", preset="small", tie_word_embeddings=False, seed=3,
                           decoder_sparse_step=2),
    # Sandwich norms, soft-caps, sliding layers (window 8) and a local RoPE base.
    "gemma2": ModelSpec(arch="gemma2", preset="small", seed=3),
    "gemma3": ModelSpec(arch="gemma3_text", preset="small", tie_word_embeddings=False, seed=3),
}
CHUNKED = {"max_num_batched_tokens": 24}


# gpt-oss (sinks, experts with biases, alternating windows, YaRN) is written by HF itself.
GPT_OSS = "gpt_oss"


def _checkpoint(name: str, out: Path, tokenizer_dir: Path) -> Path:
    if name == GPT_OSS:
        return write_gpt_oss(out, seed=3, vocab_size=VOCAB_SIZE, tokenizer_dir=tokenizer_dir)
    return write_checkpoint(out, FAMILIES[name], tokenizer_dir)


@pytest.fixture(scope="module", params=[*FAMILIES, GPT_OSS])
def family_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer_dir = resolve_model("smollm2-135m-instruct", progress=False)
    return _checkpoint(request.param, tmp_path_factory.mktemp(f"pp-{request.param}"),
                       tokenizer_dir)


@pytest.mark.timeout(60)
def test_pp2_matches_one_process(family_ckpt: Path) -> None:
    prompts = random_prompts([3, 17, 40, 29], seed=7)
    params = [greedy(n) for n in (12, 7, 10, 9)]
    expected = reference(family_ckpt, prompts, params, **CHUNKED)
    assert len({t for out in expected.values() for t in out.token_ids}) > 4  # input-dependent
    with PipelineEngine(engine_config(family_ckpt, **CHUNKED), pipeline_config(2)) as engine:
        got = run_engine(engine, prompts, params)
        assert {i: o.token_ids for i, o in got.items()} == {
            i: o.token_ids for i, o in expected.items()}
        assert_quiescent(engine)
