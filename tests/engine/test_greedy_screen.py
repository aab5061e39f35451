"""The engine's screened greedy head (EngineConfig.greedy_screen) against the same engine
reading the whole head: the tokens must be equal, exactly, for every request.

Greedy rows whose token is the plain argmax (no logprobs, penalties, bans or grammar) take it
from the screen without computing logits: the tests count the full head's calls to show that
the screen did run. Rows that need the logits take the full head and the sampler, in the same
batch; a NaN hidden state falls back to the full head, whose guard fails that request alone.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kernels.dense as dense
from shared.config import EngineConfig
from shared.engine import FinishReason
from shared.engine.accelerate import greedy_head
from shared.engine.engine import LLMEngine
from shared.engine.runner import tensor_bytes
from shared.engine.sampling_params import SamplingParams
from shared.model.gemma import GemmaForCausalLM
from tests.conftest import NAN_TOKEN, ONE_NAN
from tests.support.engine import assert_all_blocks_free, random_prompts, run_engine
from tests.support.huge_pages import THP, mapping_flags

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _engine(model: str | Path, screen: bool, **kw: object) -> LLMEngine:
    e = LLMEngine.from_config(EngineConfig(  # type: ignore[arg-type]
        model=str(model), dtype="bfloat16", num_threads=1, kv_cache_memory_bytes=16 << 20,
        enable_prefix_caching=False, greedy_screen=screen, **kw))
    if screen and e.runner.greedy_head is None:
        info = dense.build_info()
        assert info.state == "ready", f"dense build failed: {info.error}"
        assert info.active == "reference", "a compiled dense tier must screen the head"
        pytest.skip("the plain-torch path (PDMESH_KERNEL_TIER=reference) has no screen")
    return e


def _count_full_head(engine: LLMEngine) -> list[int]:
    """Count the full head's calls (compute_logits) from now on; returns the counter."""
    calls = [0]
    model = engine.runner.model
    full = model.compute_logits

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return full(hidden)

    model.compute_logits = counted  # type: ignore[method-assign]
    return calls


@pytest.fixture(scope="module")
def tiny(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint(preset="tiny", seed=3)


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_greedy_tokens_equal_the_full_heads(which: str, tiny: Path, tokenizer_dir: Path) -> None:
    """A batch of 6 (whose steps take the screen only up to its max_rows) and 3 alone, whose
    every step takes it."""
    model = tiny if which == "tiny" else tokenizer_dir
    prompts = random_prompts([5, 17, 3, 40, 9, 2], seed=7)
    off = _engine(model, False)
    want = run_engine(off, prompts, [GREEDY] * len(prompts))
    on = _engine(model, True)
    got = run_engine(on, prompts, [GREEDY] * len(prompts))
    assert [got[i].token_ids for i in range(len(prompts))] == \
        [want[i].token_ids for i in range(len(prompts))]
    calls = _count_full_head(on)
    small = prompts[:3]
    assert on.runner.greedy_head is not None and on.runner.greedy_head.max_rows >= len(small)
    got = run_engine(on, small, [GREEDY] * len(small))
    want = run_engine(off, small, [GREEDY] * len(small))  # the same batch: bf16 prefill rounds
    assert [got[i].token_ids for i in range(3)] == [want[i].token_ids for i in range(3)]
    assert calls[0] == 0  # every token came from the screen
    assert_all_blocks_free(on)


def test_rows_that_need_logits_take_the_full_head(tiny: Path) -> None:
    """One batch: plain greedy rows beside logprobs, a repetition penalty, min_tokens (an EOS
    ban) and seeded sampling. Every request gets what the unscreened engine gives it."""
    prompts = random_prompts([6, 11, 4, 8, 13], seed=8)
    params = [GREEDY,
              SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=11,
                             ignore_eos=True)]
    want = run_engine(_engine(tiny, False), prompts, params)
    on = _engine(tiny, True)
    calls = _count_full_head(on)
    got = run_engine(on, prompts, params)
    for i in range(len(prompts)):
        assert got[i].token_ids == want[i].token_ids, i
    assert calls[0] > 0
    # Alone, the plain greedy request reads no logits at all.
    alone = _count_full_head(on)
    assert run_engine(on, [prompts[0]], [GREEDY])[0].token_ids == want[0].token_ids
    assert alone[0] == 0


def test_speculative_verify_rows_are_screened_alike(tiny: Path) -> None:
    """ngram speculation's verify rows (1 + K = 4 per request, within every tier's max_rows)
    go through the screen too: the tokens equal speculation off with the whole head."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], random_prompts([9], seed=9)[0]]
    off = _engine(tiny, False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4, "min_acceptance_rate": 0.0}
    on = _engine(tiny, True, speculative_config=spec)
    calls = _count_full_head(on)
    for p in prompts:
        assert run_engine(on, [p], [GREEDY])[0].token_ids == \
            run_engine(off, [p], [GREEDY])[0].token_ids
    assert calls[0] == 0 and on.stats().spec_num_draft_tokens > 0


def test_a_nan_row_fails_alone(make_checkpoint: Callable[..., Path], one_nan_ckpt: Path) -> None:
    """bf16, screen on: the prompt holding the NaN token gets NaN hidden states; the screen
    declines, the full head's guard fails that request, and the others keep their tokens."""
    clean = [[5, 6, 7, 8, 9], [300, 301, 302] * 7]
    bad = [5, 6, NAN_TOKEN, 8, 9]
    want = run_engine(_engine(make_checkpoint(**ONE_NAN), False), clean, [GREEDY] * 2)
    on = _engine(one_nan_ckpt, True)
    failed = on.stats().num_non_finite_logits
    got = run_engine(on, [clean[0], bad, clean[1]], [GREEDY] * 3)
    assert got[0].token_ids == want[0].token_ids and got[2].token_ids == want[1].token_ids
    assert got[1].finish_reason is FinishReason.ERROR and got[1].token_ids == []
    assert on.stats().num_non_finite_logits == failed + 1
    assert on.stats().non_finite_logits_at is None  # the later clean steps cleared /health's
    on.runner.logits_guard.last_non_finite_at = 1.0  # as right after a failure
    calls = _count_full_head(on)
    assert run_engine(on, [clean[0]], [GREEDY])[0].token_ids == want[0].token_ids
    assert calls[0] == 0 and on.stats().non_finite_logits_at is None  # screened steps clear it
    assert_all_blocks_free(on)


def test_the_screen_counts_in_the_weights_and_can_be_turned_off(tiny: Path) -> None:
    on = _engine(tiny, True)
    screen = on.runner.greedy_head
    assert screen is not None
    head = on.runner.model.lm_head
    assert screen.q.numel() >= head.weight.numel() and screen.q.dtype == torch.int8
    assert on.runner.weights_bytes == (tensor_bytes(on.runner.model)
                                       + screen.q.nbytes + screen.coef.nbytes)
    assert _engine(tiny, False).runner.greedy_head is None


def test_soft_capped_logits_are_never_screened(tiny: Path) -> None:
    """Gemma soft-caps its logits (tanh can tie values the head kept apart): no screen."""
    assert GemmaForCausalLM.logits_are_head_output is False
    on = _engine(tiny, True)
    config = EngineConfig(model=str(tiny), dtype="bfloat16")
    capped = SimpleNamespace(logits_are_head_output=False, lm_head=on.runner.model.lm_head)
    assert greedy_head(capped, config) is None
    plain = SimpleNamespace(logits_are_head_output=True, lm_head=on.runner.model.lm_head)
    assert greedy_head(plain, config) is not None


def test_the_serve_flag_turns_it_off() -> None:
    from services.commands import serve
    from services.worker.config import WorkerConfig

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    on = WorkerConfig.from_args(parser.parse_args([]), {})
    off = WorkerConfig.from_args(parser.parse_args(["--no-greedy-screen"]), {})
    assert on.engine.greedy_screen is True and off.engine.greedy_screen is False


def test_what_a_decode_step_streams_is_on_huge_page_memory(tiny: Path) -> None:
    """The fused decoder stack, the LM head and the screen's int8 copy are each moved into
    memory advised for 2 MiB pages (kernels/huge_pages.py) once the native path is on, and the
    tokens are the plain path's (test_greedy_tokens_equal_the_full_heads)."""
    engine = _engine(tiny, True)
    model = engine.runner.model
    if model.native is None:
        pytest.skip("the plain-torch path (PDMESH_KERNEL_TIER=reference) packs nothing")
    screen = engine.runner.greedy_head
    assert screen is not None and model._fused_stack is not None
    streamed = [t for t in model._fused_stack if t is not None] + [model.lm_head.weight, screen.q]
    assert all(t.data_ptr() % 64 == 0 for t in streamed)
    if THP:
        assert all("hg" in mapping_flags(t.data_ptr()) for t in streamed)
