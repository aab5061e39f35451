"""The conditional-disaggregation threshold: the learned estimator against the cost model its
module documents (recomputed here from the synthetic inputs), the router deciding with it, and
the flag that picks it."""

from __future__ import annotations

import argparse
import math
import random

import numpy as np
import pytest

from services.cli import build_parser
from services.router.config import RouterConfig
from services.router.disagg_threshold import (
    DisaggLearning,
    DisaggThreshold,
    ThresholdSource,
)
from tests.support.fake_worker import FakeWorker, expected_text

LENGTHS = (16, 48, 130, 400, 900)


def _break_even(a: float, p: float, x: float, batch: float) -> float:
    """L where B * p * L (stalling the decode batch) equals a + x * L (the extra leg)."""
    return a / (batch * p - x)


def _feed(t: DisaggThreshold, rounds: int, a: float, p: float, x: float, batch: float,
          noise: float = 0.0, seed: int = 0) -> list[tuple[int, float]]:
    rng = random.Random(seed)
    seen = []
    for i in range(rounds):
        length = LENGTHS[i % len(LENGTHS)]
        seconds = (a + p * length) * (1 + rng.uniform(-noise, noise))
        t.observe_prefill(length, seconds)
        t.observe_transfer(length, x * length * (1 + rng.uniform(-noise, noise)))
        t.observe_batch(batch)
        seen.append((length, seconds))
    return seen


def test_exact_measurements_give_the_break_even_threshold():
    a, p, x, batch = 0.012, 4e-4, 2e-5, 3.0
    t = DisaggThreshold(0, DisaggLearning(prior_tokens=5, min_samples=4))
    _feed(t, 40, a, p, x, batch)
    est = t.estimate
    assert est.source is ThresholdSource.LEARNED
    assert est.prefill_s_per_token == pytest.approx(p, rel=1e-6)
    assert est.prefill_overhead_s == pytest.approx(a, rel=1e-6)
    assert est.transfer_s_per_token == pytest.approx(x, rel=1e-6)
    assert est.decode_batch == pytest.approx(batch)
    assert t.tokens == math.ceil(_break_even(a, p, x, batch))


def test_noisy_measurements_converge_near_a_least_squares_fit():
    a, p, x, batch = 0.02, 1e-3, 5e-5, 2.0
    t = DisaggThreshold(0, DisaggLearning())
    seen = _feed(t, 200, a, p, x, batch, noise=0.03, seed=7)
    # Independent reference: ordinary least squares over the last window of samples.
    lengths, times = zip(*seen[-60:], strict=True)
    slope, intercept = np.polyfit(lengths, times, 1)
    est = t.estimate
    assert est.prefill_s_per_token == pytest.approx(slope, rel=0.1)
    assert est.prefill_overhead_s == pytest.approx(intercept, rel=0.5, abs=0.01)
    reference = _break_even(a, p, x, batch)
    assert abs(t.tokens - reference) <= 0.25 * reference


def test_prior_holds_until_enough_usable_samples():
    learning = DisaggLearning(prior_tokens=20, min_samples=8)
    t = DisaggThreshold(0, learning)
    assert t.tokens == 20 and t.estimate.source is ThresholdSource.PRIOR
    _feed(t, 7, 0.01, 1e-3, 1e-5, 1.0)
    assert t.tokens == 20 and "fewer than 8" in (t.estimate.reason or "")
    same = DisaggThreshold(0, learning)
    for _ in range(20):  # one prompt length: overhead and per-token cost cannot be told apart
        same.observe_prefill(100, 0.05)
        same.observe_transfer(100, 0.001)
    assert same.tokens == 20 and "too alike" in (same.estimate.reason or "")


def test_bounds_clamp_the_learned_threshold():
    learning = DisaggLearning(prior_tokens=8, floor_tokens=4, ceiling_tokens=300, min_samples=2)
    cheap_move = DisaggThreshold(0, learning)  # transfer dearer than the stall: always whole
    _feed(cheap_move, 10, 0.01, 1e-4, 2e-4, 1.0)
    assert cheap_move.tokens == 300
    tiny = DisaggThreshold(0, learning)  # no overhead: break-even at 0, clamped to the floor
    _feed(tiny, 10, 0.0, 1e-3, 1e-5, 4.0)
    assert tiny.tokens == 4
    big = DisaggThreshold(0, learning)
    _feed(big, 10, 1.0, 1e-3, 1e-5, 1.0)  # break-even ~1010 tokens
    assert _break_even(1.0, 1e-3, 1e-5, 1.0) > 300 and big.tokens == 300


def test_a_fixed_threshold_ignores_measurements():
    t = DisaggThreshold(12, None)
    _feed(t, 20, 0.01, 1e-3, 1e-5, 2.0)
    assert t.tokens == 12 and t.estimate.source is ThresholdSource.FIXED and not t.auto


def _config(argv: list[str]) -> RouterConfig:
    return RouterConfig.from_args(build_parser().parse_args(["router", *argv]), {})


def test_flag_takes_a_count_or_auto_and_refuses_the_rest(capsys):
    assert _config(["--disagg-min-tokens", "7"]).disagg_min_tokens == 7
    assert _config(["--disagg-min-tokens", "7"]).disagg_learning is None
    assert _config(["--disagg-min-tokens", "auto"]).disagg_learning == DisaggLearning()
    assert _config([]).disagg_learning is None and _config([]).disagg_min_tokens == 0
    for bad in ("-3", "abc", "1.5"):
        with pytest.raises(SystemExit):
            _config(["--disagg-min-tokens", bad])
        err = capsys.readouterr().err
        assert "--disagg-min-tokens" in err and "'auto'" in err and repr(bad) in err


def test_up_passes_auto_unless_told_otherwise():
    from services.commands import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    for argv, expected in (([], "auto"), (["--disagg-min-tokens", "9"], "9")):
        args = parser.parse_args(["--model", "m", "--serve-cmd", "serve", *argv])
        router = up.plan(args, 2)[0][0].argv
        i = router.index("--disagg-min-tokens")
        assert router[i + 1] == expected
    with pytest.raises(SystemExit):
        parser.parse_args(["--disagg-min-tokens", "-3"])


async def _complete(mesh, words: int) -> dict:
    body = {"model": "fake-model", "prompt": " ".join(f"w{i}" for i in range(words)),
            "max_tokens": 2}
    resp = await mesh.client.post("/v1/completions", json=body)
    doc = await resp.json()
    assert resp.status == 200 and doc["choices"][0]["text"] == expected_text(body)
    return doc


async def test_router_with_auto_routes_by_the_learned_threshold(make_mesh):
    learning = DisaggLearning(prior_tokens=3, min_samples=4)
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")],
                           disagg_learning=learning)
    threshold = mesh.state.pairing.threshold
    # Before learning, the prior decides: 2 words whole, 5 disaggregated.
    await _complete(mesh, 2)
    await _complete(mesh, 5)
    assert [len(w.calls) for w in mesh.workers] == [1, 2]
    assert threshold.estimate.prefill_samples == 1 and threshold.estimate.transfer_samples == 1
    stream = {"model": "fake-model", "prompt": "a b c d e f", "max_tokens": 2, "stream": True}
    resp = await mesh.client.post("/v1/completions", json=stream)
    assert resp.status == 200 and "[DONE]" in await resp.text()
    # A streamed P/D request is measured too (the fakes report kv_transfer_ms 1.5).
    assert threshold.estimate.prefill_samples == 2 and threshold.estimate.transfer_samples == 2
    alpha = learning.alpha  # x = EMA(kv seconds) / EMA(tokens), after 5 then 6 tokens
    assert threshold.estimate.transfer_s_per_token == pytest.approx(
        0.0015 / (5 + alpha * (6 - 5)))
    # Synthetic measurements dominate the EMA (alpha 0.1, 200 rounds): break-even ~10.3 tokens.
    a, p, x = 0.01, 1e-3, 3e-5
    _feed(threshold, 200, a, p, x, 1.0)
    expected = math.ceil(_break_even(a, p, x, 1.0))
    assert threshold.tokens == expected and threshold.estimate.source is ThresholdSource.LEARNED
    metrics = await (await mesh.client.get("/metrics")).text()
    assert f"pdmesh:disagg_threshold_tokens {float(expected)}" in metrics
    assert 'pdmesh:disagg_cost_input{input="decode_batch"} 1.0' in metrics
    described = (await mesh.metadata())["router"]
    assert described["disagg_min_tokens"] == expected
    assert described["disagg_threshold"]["source"] == "learned"
    assert described["disagg_threshold"]["prefill_s_per_token"] == pytest.approx(p, rel=0.01)
    await _complete(mesh, expected - 1)  # idle fakes: each decision sees a batch of 1
    await _complete(mesh, expected + 20)
    assert [len(w.calls) for w in mesh.workers] == [3, 5]
    assert mesh.role("decode")[0].calls[3].body.get("kv_transfer_params") is None
    assert mesh.role("decode")[0].calls[4].body["kv_transfer_params"]
    assert 'pdmesh:disagg_decision_total{decision="decode_only"} 2.0' in (
        await (await mesh.client.get("/metrics")).text())


async def test_router_with_a_fixed_threshold_reports_it(make_mesh):
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode")], disagg_min_tokens=6)
    metrics = await (await mesh.client.get("/metrics")).text()
    assert "pdmesh:disagg_threshold_tokens 6.0" in metrics
    assert "disagg_cost_input{" not in metrics
    described = (await mesh.metadata())["router"]["disagg_threshold"]
    assert described["source"] == "fixed" and described["threshold_tokens"] == 6
