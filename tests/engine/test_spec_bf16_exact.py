"""Greedy speculative decoding in bf16 on the real SmolLM2-135M-Instruct: the tokens equal
speculation off exactly, one request at a time and in a batch.

The reference is the same engine with speculation off. This holds only because every kernel on
the bf16 decode path computes a row the same way whatever the other rows of its step (the
dense GEMV's fixed summation order, attention per (row, kv head), elementwise ops per row): a
verify step runs a request's 1 + K rows where speculation off runs one. The prompts ask the
model to copy or edit a given text, so drafts are both accepted and rejected.
"""

from __future__ import annotations

import pytest

from shared.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from tests.support.engine import assert_all_blocks_free, run_engine

pytestmark = pytest.mark.slow

CODE = ("def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
        "    return total / len(values)\n")
ASKS = [
    "Add type hints to this Python code and print the whole code:\n\n```python\n" + CODE + "```",
    "Repeat the following text exactly: To install the tool, download the archive, unpack it "
    "and add that directory to your PATH.",
    "Write this list again in reverse order: red, orange, yellow, green, blue, indigo, violet",
    "Fix the spelling in this sentence: The quik brown fox jumpd over the lazzy dog.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def engine(model: str, spec: dict[str, object] | None) -> LLMEngine:
    e = LLMEngine.from_config(EngineConfig(  # type: ignore[arg-type]
        model=model, dtype="bfloat16", kv_cache_memory_bytes=64 << 20, num_threads=1,
        enable_prefix_caching=False, speculative_config=spec))
    if e.runner.model.native is None:
        # The plain-torch path (no C++ compiler, or PDMESH_KERNEL_TIER=reference) runs bf16
        # rows through torch's GEMM, whose sums depend on the row count: there bf16 greedy
        # speculation is as exact as bf16 batching is (README), and fp32 is exact
        # (test_spec_decode.py runs it on every tier).
        pytest.skip("bf16 exactness is a property of the native kernels; this is plain torch")
    return e


@pytest.fixture(scope="module")
def prompts(tokenizer_dir) -> list[list[int]]:
    tok = engine(str(tokenizer_dir), None).tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": a}]),
                       add_special_tokens=False) for a in ASKS]


@pytest.fixture(scope="module")
def off(tokenizer_dir, prompts) -> list[list[int]]:
    """Speculation off, each prompt alone: every decode step is one row."""
    e = engine(str(tokenizer_dir), None)
    return [run_engine(e, [p], [GREEDY])[0].token_ids for p in prompts]


@pytest.mark.parametrize("k", [4, 7])
def test_alone_equals_speculation_off(tokenizer_dir, prompts, off, k):
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
            "prompt_lookup_max": 5, "min_acceptance_rate": 0.0}
    e = engine(str(tokenizer_dir), spec)
    on = [run_engine(e, [p], [GREEDY])[0].token_ids for p in prompts]
    assert on == off
    s = e.stats()
    assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens  # accepts and rejects
    assert_all_blocks_free(e)


def test_batch_equals_speculation_off(tokenizer_dir, prompts):
    """All prompts at once: speculation off decodes 4 rows a step, on up to 4 x (1 + 4) rows
    (the prefill steps are the same on both sides)."""
    params = [GREEDY] * len(prompts)
    want = run_engine(engine(str(tokenizer_dir), None), prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8,
            "min_acceptance_rate": 0.0}
    e = engine(str(tokenizer_dir), spec)
    got = run_engine(e, prompts, params)
    assert [got[i].token_ids for i in range(len(prompts))] == [
        want[i].token_ids for i in range(len(prompts))]
    assert e.stats().spec_num_accepted_tokens > 0


# The first two asks (a code edit, a verbatim copy): both accept and reject drafts, and each
# draft step is a whole runner step of the MXFP4 model, so more asks only add time. With the
# draft's LM head quantised too and cut to the 16384 commonest ids (draft_vocab_size), the
# code edit alone.
@pytest.mark.parametrize(("cut", "asks"), [(None, 2), (16384, 1)])
def test_mxfp4_self_draft_equals_speculation_off(tokenizer_dir, prompts, off, cut, asks):
    """The quantised self-draft: the MXFP4 copy of the model proposes, the bf16 model
    verifies; the tokens are the bf16 model's own."""
    from shared.model.quant import MXFP4Linear

    spec = {"method": "draft_model", "model": str(tokenizer_dir), "quantization": "mxfp4",
            "num_speculative_tokens": 4, "min_acceptance_rate": 0.0}
    if cut is not None:
        spec.update(draft_vocab_size=cut, quantize_lm_head=True)
    e = engine(str(tokenizer_dir), spec)
    head = e.scheduler.drafter.proposer.runner.model.lm_head
    assert isinstance(head, MXFP4Linear) == (cut is not None)
    on = [run_engine(e, [p], [GREEDY])[0].token_ids for p in prompts[:asks]]
    assert on == off[:asks]
    s = e.stats()
    assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens
    assert_all_blocks_free(e)
