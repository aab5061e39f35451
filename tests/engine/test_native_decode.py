"""The engine's native decode path (fused decoder layers, paged attention and dense GEMVs,
chosen by LLMEngine.from_config) against the plain-torch layers, on every dense kernel tier
this CPU can execute, with the real SmolLM2-135M in bf16.

What "the native path equals the plain path" means, across tiers:

1. Bit-exact where the arithmetic is the same. One tier run twice on the same batch, or with
   1 and with 2 threads, gives the same greedy tokens and the same logits to the bit: no
   reduction order may depend on thread timing or load (the kernels split work by output
   rows; the order of each row's sums is fixed by the code, not by the schedule).

2. Within a stated tolerance where the order of a reduction differs. The native kernels sum
   in their own order (vdpbf16ps pairs, 16- or 8-lane FMA accumulators, a one-pass paged
   attention) and torch in another, so their bf16 activations round differently and 30
   layers amplify the difference; the plain layers themselves differ as much between a
   decode step and a prefill of the same tokens. Free-running greedy tokens are no measure:
   one near-tie flip changes every later token. So the test teacher-forces: the plain model
   runs one prefill over each prompt plus the native engine's greedy tokens, and at every
   generated position
     - the native logits are within LOGIT_ATOL of the plain ones (max over the vocabulary);
     - the native token is the plain argmax, or lies less than TIE_GAP below the plain top
       logit: a near-tie, where the plain path's own top two are that close.

The thresholds come from measured distributions, one native vs teacher-forced plain run of 24
prompts (16 texts, 8 random-token ones) x 48 greedy tokens = 1152 positions, on an AMD Zen 3
(the avx2 tier; see the issue-13 note). Logits of SmolLM2 in bf16 are bf16 numbers (the LM
head's output), so at |logit| 16..32 they move in steps of 0.125.
  - Native avx2 engine vs plain prefill: max |dlogit| per position p50 0.375, p90 0.56,
    p99 0.78, max 1.06; 25 of 1152 tokens differ from the plain argmax, every one at a
    reference gap of <= 0.25 (two bf16 steps; 10 of them exact ties in the reference).
  - Plain engine decode vs plain prefill (the noise floor of bf16 itself, torch vs torch):
    p50 0.375, p90 0.56, p99 0.81, max 1.28; also 25 flips, each at a gap of <= 0.25.
  - The reference's own top-2 gap is 0 at 1% of positions and < 0.125 at 5%.
LOGIT_ATOL = 2.0 is ~1.5x the largest difference seen on either path (the avx512 tiers sum in
wider vectors but round to the same bf16 activations). TIE_GAP = 0.5 is twice the largest gap
at which a token was seen to flip: four bf16 steps at the top logits. A kernel bug (a wrong
row, a missing bias, a stale cache block) moves logits by whole units and argmaxes far beyond
a near-tie, which both bounds catch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels.dense as dense
from shared.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.kernel_tiers import backend_tier, cpu_tier
from shared.model.loader import load_model
from tests.support.native_contract import (
    LogitRecorder,
    PositionStats,
    Tolerance,
    compare_positions,
    reference_logits,
    violations,
)

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village, there lived an old clockmaker who", "1, 2, 3,"]
NEW_TOKENS = 24
LOGIT_ATOL = 2.0
TIE_GAP = 0.5
TOLERANCE = Tolerance(LOGIT_ATOL, TIE_GAP)
# Every compiled dense backend; the plain-torch reference is what they are compared against.
NATIVE_BACKENDS = [str(b) for b in dense.Backend if b is not dense.Backend.REFERENCE]


def _native_engine(model_dir: Path, backend: str, threads: int = 1) -> LLMEngine:
    """A bf16 engine capped at `backend`'s tier, so that it runs exactly that backend. A
    failed build fails; only a CPU that cannot execute the tier skips."""
    tier = backend_tier(backend)
    if tier > cpu_tier():
        pytest.skip(f"this CPU cannot run {backend}")
    info = dense.build_info()
    assert info.state == "ready", f"dense build failed: {info.error}"
    assert backend in info.available, f"a {cpu_tier().label} CPU should run {backend}: {info}"
    engine = LLMEngine.from_config(EngineConfig(
        model=str(model_dir), dtype="bfloat16", kv_cache_memory_bytes=64 << 20,
        num_threads=threads, enable_prefix_caching=False, kernel_tier=tier.label))
    model = engine.runner.model
    assert model.native is not None and str(model.native.path.backend) == backend
    assert all(layer.fused is not None for layer in model.layers)
    return engine


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> LogitRecorder:
    """One concurrent batch (a prefill step, then batched decode steps), recorded."""
    recorder = LogitRecorder(engine)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert all(len(recorder.tokens[f"r{i}"]) == NEW_TOKENS for i in range(len(prompts)))
    return recorder


def _prompts(engine: LLMEngine) -> list[list[int]]:
    return [engine.tokenizer.encode(p) for p in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_native_engine_matches_plain_layers(tokenizer_dir: Path, backend: str) -> None:
    native = _native_engine(tokenizer_dir, backend)
    prompts = _prompts(native)
    recorded = _greedy(native, prompts)
    plain, _ = load_model(tokenizer_dir, "bfloat16")  # torch layers, torch linears
    stats: list[PositionStats] = []
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        tokens = recorded.tokens[rid]
        ref = reference_logits(plain, prompt + tokens)[len(prompt) - 1:-1]  # [NEW_TOKENS, V]
        stats += compare_positions(rid, tokens, recorded.stacked(rid), ref)
    assert not violations(stats, TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("backend", NATIVE_BACKENDS)
def test_native_tier_is_deterministic_across_runs_and_threads(tokenizer_dir: Path,
                                                              backend: str) -> None:
    runs = []  # two runs that differ in thread count: equal logits mean neither varies
    for threads in (1, 2):
        engine = _native_engine(tokenizer_dir, backend, threads)
        runs.append(_greedy(engine, _prompts(engine)))
    first = runs[0]
    for other in runs[1:]:
        assert other.tokens == first.tokens
        for rid in first.tokens:
            assert torch.equal(other.stacked(rid), first.stacked(rid)), rid


# ---- the comparison itself, on what any CPU runs ----------------------------------------------

def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_identical_logits_and_tokens_pass() -> None:
    ref = _logits([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    stats = compare_positions("r", [1, 0], ref.clone(), ref)
    assert [(s.ref_token, s.max_abs_diff, s.ref_gap, s.ref_top2_gap) for s in stats] == [
        (1, 0.0, 0.0, 2.0), (0, 0.0, 0.0, 1.0)]
    assert violations(stats, Tolerance(0.0, 0.0)) == []


def test_logits_beyond_the_tolerance_fail() -> None:
    ref = _logits([[0.0, 3.0, 1.0]])
    near = ref + _logits([[0.0, 0.0, 0.25]])
    assert violations(compare_positions("r", [1], near, ref), Tolerance(0.25, 0.1)) == []
    (bad,) = violations(compare_positions("r", [1], near, ref), Tolerance(0.2, 0.1))
    assert "r step 0: logits differ by 0.2500 > 0.2" in bad


def test_a_flip_is_allowed_only_at_a_reference_near_tie() -> None:
    ref = _logits([[1.0, 1.25, 0.0]])  # top-2 gap 0.25
    flipped = _logits([[1.3, 1.25, 0.0]])  # the native path prefers token 0
    (s,) = compare_positions("r", [0], flipped, ref)
    assert (s.token, s.ref_token, s.ref_gap, s.ref_top2_gap) == (0, 1, 0.25, 0.25)
    assert violations([s], Tolerance(1.0, 0.5)) == []
    (bad,) = violations([s], Tolerance(1.0, 0.25))
    assert "token 0 instead of 1" in bad
    # a flip to the third token: judged by its own gap, not the top-2 gap
    (third,) = compare_positions("r", [2], _logits([[1.0, 1.25, 2.0]]), ref)
    assert third.ref_gap == 1.25 and len(violations([third], Tolerance(1.0, 0.5))) == 2


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="2 tokens, 1 native and 1 reference rows"):
        compare_positions("r", [0, 1], _logits([[0.0]]), _logits([[0.0]]))


def test_recorder_and_teacher_forced_reference_on_the_plain_fp32_path(make_engine,
                                                                      small_ckpt: Path) -> None:
    """The helpers themselves, on an fp32 engine (plain torch on every CPU): the recorder maps
    batched rows back to their requests, and the teacher-forced prefill reproduces each
    step's logits to fp32 rounding."""
    engine = make_engine()
    prompts = [[5, 9, 14, 3], [7] * 11, [2, 4]]  # different lengths: rows move between steps
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    recorder = LogitRecorder(engine)
    got: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(f"q{i}", ids, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert dict(recorder.tokens) == got
    with pytest.raises(ValueError, match="already has a LogitRecorder"):
        LogitRecorder(engine)
    plain, _ = load_model(small_ckpt, "float32")
    for i, ids in enumerate(prompts):
        rid, tokens = f"q{i}", got[f"q{i}"]
        native = recorder.stacked(rid)
        assert native.argmax(-1).tolist() == tokens  # the logits each token was sampled from
        ref = reference_logits(plain, ids + tokens)[len(ids) - 1:-1]
        stats = compare_positions(rid, tokens, native, ref)
        assert violations(stats, Tolerance(1e-4, 0.0)) == []
