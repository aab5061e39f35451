"""A padded vocabulary (more model rows than tokenizer tokens, as Qwen2.5's 151,936 rows for
151,665 tokens): prompt ids up to the model's rows are taken, generated ids past the tokenizer
are kept in token_ids and decode to "", and greedy tokens equal HF transformers' (fp32).

Reference: HF transformers (`generate` for tokens, its fast tokenizer for text), which takes
any id below the model's row count and spells ids past the tokenizer as nothing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from shared.config import EngineConfig
from shared.engine import AsyncEngine, FinishReason, SamplingParams
from shared.engine.engine import LLMEngine
from shared.model.make_model import VOCAB_SIZE
from tests.support.engine import hf_greedy, run_engine

ROWS = VOCAB_SIZE + 64
PROMPTS = [[1, 9038, 2088, 28, 638], [504, 2365, 6354, 16438], [VOCAB_SIZE + 3, 17, ROWS - 1, 42]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf_padded(padded_vocab_ckpt: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(padded_vocab_ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(padded_vocab_ckpt: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(padded_vocab_ckpt)


@pytest.fixture(scope="module")
def hf_tokens(hf_padded) -> list[list[int]]:
    return [hf_greedy(hf_padded, p, MAX_TOKENS) for p in PROMPTS]


def engine_config(ckpt: Path) -> EngineConfig:
    return EngineConfig(model=str(ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20,
                        num_threads=1)


def test_the_checkpoint_emits_ids_past_the_tokenizer(hf_padded, hf_tokenizer, hf_tokens) -> None:
    """Precondition of this file: HF's model has more rows than the tokenizer has tokens, and
    its greedy outputs hold both kinds of ids."""
    assert hf_padded.config.vocab_size == ROWS and len(hf_tokenizer) == VOCAB_SIZE
    flat = [t for out in hf_tokens for t in out]
    assert any(t >= VOCAB_SIZE for t in flat) and any(t < VOCAB_SIZE for t in flat)


def test_greedy_equals_hf_and_text_skips_unknown_ids(padded_vocab_ckpt, hf_tokenizer,
                                                     hf_tokens) -> None:
    engine = LLMEngine.from_config(engine_config(padded_vocab_ckpt))
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # run_engine also checks that the streamed token and text deltas add up to the final.
    finals = run_engine(engine, PROMPTS, [greedy] * len(PROMPTS))
    for i, want in enumerate(hf_tokens):
        out = finals[i]
        assert out.finish_reason is FinishReason.LENGTH and out.error is None
        assert out.token_ids == want, f"prompt {i}"
        assert out.text == hf_tokenizer.decode(want, skip_special_tokens=True)


def test_stop_strings_and_logprobs_with_unknown_ids(padded_vocab_ckpt, hf_tokenizer,
                                                    hf_tokens) -> None:
    """The detokenizer's stop-string hold-back and logprobs see padded ids like any other."""
    engine = LLMEngine.from_config(engine_config(padded_vocab_ckpt))
    full = hf_tokenizer.decode(hf_tokens[0], skip_special_tokens=True)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            stop=[stop], logprobs=2)
    out = run_engine(engine, PROMPTS[:1], [params])[0]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop
    assert out.text == full[:full.index(stop)]
    assert out.token_ids == hf_tokens[0][:len(out.token_ids)]


async def test_async_engine_stays_healthy_on_unknown_ids(padded_vocab_ckpt, hf_tokens) -> None:
    """The reported failure: an id past the tokenizer reached the detokenizer on the engine
    thread, which died. Now it is an ordinary token."""
    engine = AsyncEngine(engine_config(padded_vocab_ckpt))
    await engine.start()
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

        async def last(i: int):
            outs = [o async for o in engine.generate(f"r{i}", PROMPTS[i], greedy)]
            return outs[-1]

        finals = await asyncio.wait_for(asyncio.gather(*(last(i) for i in range(len(PROMPTS)))),
                                        60)
        assert [f.token_ids for f in finals] == hf_tokens
        assert engine.healthy
        with pytest.raises(ValueError, match=str(ROWS)):
            async for _ in engine.generate("bad", [5, ROWS], greedy):
                pass
    finally:
        await engine.shutdown()
