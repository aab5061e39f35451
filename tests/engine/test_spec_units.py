"""Speculative decoding parts on their own: the n-gram proposer against a brute-force
reference, verification keeping the target distribution (chi-square), and the config."""

from __future__ import annotations

import argparse
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.config import EngineConfig
from shared.engine.request import Request
from shared.engine.sampler import Sampler, SamplingTensors
from shared.engine.sampling_params import SamplingParams
from shared.engine.spec.ngram import propose_ngram
from shared.engine.spec.verify import accepted_tokens
from shared.speculative_config import SpeculativeConfig


def brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The earliest earlier occurrence of the longest matching suffix, by plain loops."""
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 4),
       st.integers(0, 3), st.integers(1, 6))
def test_ngram_matches_brute_force(tokens: list[int], lo: int, extra: int, k: int) -> None:
    assert propose_ngram(tokens, lo, lo + extra, k) == brute_force(tokens, lo, lo + extra, k)


def test_ngram_prefers_the_longest_suffix() -> None:
    # [7, 8] occurs at 0 (-> 1) and the longer [6, 7, 8] at 4 (-> 2).
    assert propose_ngram([7, 8, 1, 9, 6, 7, 8, 2, 6, 7, 8], 1, 3, 1) == [2]
    assert propose_ngram([7, 8, 1, 9, 6, 7, 8, 2, 6, 7, 8], 1, 2, 1) == [1]


def test_accepted_tokens_prefix_then_target_token() -> None:
    assert accepted_tokens([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accepted_tokens([5, 6], [5, 6, 3]) == [5, 6, 3]  # all accepted: the bonus token
    assert accepted_tokens([5], [4, 5]) == [4]
    with pytest.raises(ValueError):
        accepted_tokens([5], [5])


def chi_square_p(observed: list[int], probs: list[float]) -> float:
    """Upper tail of the chi-square statistic (torch's regularised gamma: no scipy here)."""
    total = sum(observed)
    stat = sum((o - total * p) ** 2 / (total * p) for o, p in zip(observed, probs, strict=True))
    df = len(probs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def test_verification_keeps_the_target_distribution() -> None:
    """Draft [t0, t1] against known target distributions p0, p1 (two positions), over many
    seeds: the first emitted token ~ p0, t0 accepted with probability p0(t0), and after an
    accept the second emitted token ~ p1; rejection draws follow the residual of p0."""
    vocab = 6
    p0 = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    p1 = torch.tensor([0.40, 0.05, 0.15, 0.10, 0.20, 0.10])
    logits = torch.stack([p0.log(), p1.log(), p1.log()])  # positions 0, 1, bonus
    draft = [1, 4]
    sampler = Sampler()
    first, second, residual = [0] * vocab, [0] * vocab, [0] * vocab
    accepts, draws = 0, 3000
    for seed in range(draws):
        req = Request("r", [0, 1, 2], SamplingParams(temperature=1.0, seed=seed))
        st_ = SamplingTensors.from_requests([req] * 3, vocab, [0, 1, 2])
        out = accepted_tokens(draft, sampler(logits.clone(), st_).token_ids)
        first[out[0]] += 1
        if out[0] == draft[0]:
            accepts += 1
            second[out[1]] += 1
        else:
            residual[out[0]] += 1
    assert chi_square_p(first, p0.tolist()) > 1e-3
    assert chi_square_p(second, p1.tolist()) > 1e-3
    rest = [0.0 if i == draft[0] else float(p) / (1 - float(p0[1])) for i, p in enumerate(p0)]
    assert chi_square_p([c for i, c in enumerate(residual) if i != 1],
                        [p for i, p in enumerate(rest) if i != 1]) > 1e-3
    # acceptance ~ Binomial(draws, p0(t0)): within 4.5 standard deviations
    sd = math.sqrt(draws * 0.3 * 0.7)
    assert abs(accepts - draws * 0.3) < 4.5 * sd


def test_chi_square_helper_rejects_a_wrong_distribution() -> None:
    rng = random.Random(0)
    counts = [0, 0]
    for _ in range(2000):
        counts[rng.random() < 0.6] += 1
    assert chi_square_p(counts, [0.4, 0.6]) > 1e-3
    assert chi_square_p(counts, [0.5, 0.5]) < 1e-6


def test_config_parses_vllm_json_and_refuses_bad_values() -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, ' \
           '"prompt_lookup_max": 4}'
    config = EngineConfig(speculative_config=spec)  # type: ignore[arg-type]  # coerced
    assert config.speculative_config == SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=4)
    for bad, key in [('{"method": "eagle"}', "method"),
                     ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                     ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens"),
                     ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
                      "prompt_lookup_max"),
                     ('{"method": "ngram", "prompt_lookup_min": "2"}', "prompt_lookup_min"),
                     ('{"method": "ngram", "disable_by_batch_size": -1}', "disable_by_batch_size"),
                     ('{"method": "ngram", "num_spec_tokens": 2}', "num_spec_tokens"),
                     ('{"method": "ngram", "min_acceptance_rate": 2}', "min_acceptance_rate"),
                     ('{"num_speculative_tokens": 2}', "method"),
                     ('{"method": "draft_model"}', "speculative_config.model is required"),
                     ('{"method": "draft_model", "model": " "}', "model is required"),
                     ('{"method": "ngram", "model": "m"}', "draft_model only"),
                     ('{"method": "ngram", "draft_vocab_size": 8}', "draft_model only"),
                     ('{"method": "draft_model", "model": "m", "draft_vocab_size": 0}',
                      "draft_vocab_size must be"),
                     ('{"method": "draft_model", "model": "m", "draft_vocab_size": true}',
                      "draft_vocab_size must be"),
                     ('{"method": "draft_model", "model": "m", "quantize_lm_head": true}',
                      "needs quantization"),
                     ('{"method": "draft_model", "model": "m", "quantization": "mxfp4", '
                      '"quantize_lm_head": 1}', "quantize_lm_head must be true or false"),
                     ('{"method": "draft_model", "model": "m", "quantization": "int4"}',
                      "quantization"),
                     ('[1]', "JSON object"), ('{"method": ', "JSON")]:
        with pytest.raises(ValueError, match=key):
            EngineConfig(speculative_config=bad)  # type: ignore[arg-type]
    self_draft = SpeculativeConfig.parse(
        '{"method": "draft_model", "model": "smollm2-135m-instruct", "quantization": "mxfp4"}')
    assert self_draft is not None and self_draft.quantization == "mxfp4"


def test_serve_flag_reaches_the_engine_and_a_bad_one_exits_cleanly(
        capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main
    from services.worker.config import WorkerConfig, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram"}'])
    assert WorkerConfig.from_args(args, {}).engine.speculative_config == SpeculativeConfig()
    assert main(["serve", "--port", "0", "--speculative-config", '{"method": "x"}']) == 2
    err = capsys.readouterr().err
    assert "speculative_config.method" in err and "Traceback" not in err


def test_up_forwards_the_flag_to_decode_workers_only_and_refuses_a_bad_one(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from services.cli import main
    from services.commands import up
    from services.kv_transfer.config import KV_SECRET_ENV

    monkeypatch.setenv(KV_SECRET_ENV, "0" * 64)  # `up` would otherwise set one in os.environ

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    args = parser.parse_args(["--speculative-config", spec])
    for role, forwarded in (("decode", True), ("mixed", True), ("prefill", False)):
        flags = up.worker_flags(role, args, 1, 2, 1)
        assert (["--speculative-config", spec] == flags[flags.index("--speculative-config"):][:2]
                if forwarded else "--speculative-config" not in flags)
    assert main(["up", "--speculative-config", '{"method": "ngram", "x": 1}']) == 2
    err = capsys.readouterr().err
    assert "unknown key(s) x" in err and "Traceback" not in err


def test_a_request_below_break_even_stops_speculating() -> None:
    from shared.engine.spec.drafter import Drafter

    req = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=50))
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                        acceptance_window=8, min_acceptance_rate=0.25), 100)
    assert drafter.propose(req) == [3, 1, 2]
    drafter.record(req, 6, 1)  # 1/6 below 0.25, but fewer than 8 drafted: keep going
    assert drafter.propose(req) == [3, 1, 2]
    drafter.record(req, 3, 2)  # 3/9 >= 0.25
    assert drafter.propose(req) == [3, 1, 2]
    drafter.record(req, 3, 0)  # 3/12 == 0.25: not below
    assert drafter.propose(req) == [3, 1, 2]
    drafter.record(req, 3, 0)  # 3/15 < 0.25: off for good
    assert drafter.propose(req) == []
    assert (drafter.stats.num_drafts, drafter.stats.num_draft_tokens,
            drafter.stats.num_accepted_tokens) == (4, 15, 3)
    # accepts of 1, 2, 0 and 0 tokens; every one of the K positions is counted, zeros too
    assert drafter.stats.accepted_per_position == [2, 1, 0]
    # Drafts never run past max_tokens (one slot is the token sampled after the draft).
    short = Request("s", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=3))
    assert drafter.propose(short) == [3, 1]


def test_pipeline_workers_refuse_speculation() -> None:
    from services.worker.config import WorkerConfig, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--pp-size", "2", "--speculative-config", '{"method": "ngram"}'])
    with pytest.raises(ValueError, match="speculative-config"):
        WorkerConfig.from_args(args, {})
