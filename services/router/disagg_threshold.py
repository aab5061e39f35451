"""The conditional-disaggregation threshold: fixed (`--disagg-min-tokens N`) or learned (`auto`).

A prompt of L tokens either takes a prefill leg and has its KV moved to a decode worker
(disaggregated), or is computed by the decode worker itself (served whole, `decode_only`). The
prompt is computed once either way; what differs is the cost around it, in sequence-seconds:

    cost_disagg(L) = a + x * L      the request pays the extra leg: HTTP, queueing on the
                                    prefill worker and the KV transfer
    cost_local(L)  = B * p * L      the B sequences in the decode worker's batch each wait the
                                    p * L seconds the prompt's prefill holds their step

with, all learned as exponential moving averages (EMA, weight `alpha` per sample):

    p [s/token], a [s]  slope and intercept of the prefill leg's wall time (router-measured,
                        arrival to answer) against its computed (uncached) prompt tokens: an EMA
                        least-squares fit, p = cov(L, t) / var(L), a = mean(t) - p * mean(L)
    x [s/token]         EMA(kv_transfer seconds the decode reports) / EMA(prompt tokens moved)
    B [sequences]       EMA of max(1, mean load of the group's decode workers) at each P/D
                        decision (the floor: a stall is assumed to hold at least one sequence)

Serving whole is cheaper while cost_local(L) < cost_disagg(L), i.e. for L < L* with

    L* = a / (B * p - x)            (tokens; no crossing when B * p <= x: serve whole up to the
                                    ceiling)

and the threshold is ceil(L*) clamped to [floor, ceiling]: prompts with fewer tokens are served
whole. Until `min_samples` prefill legs and transfers were seen, and while the prompt lengths
seen are too alike to separate a from p (coefficient of variation under `min_spread`) or the fit
is not physical (p <= 0), the threshold is the prior. The model assumes the decode worker
computes a prompt token about as fast as the prefill worker (true on one box); p, a and x only
move while some prompts still take the P/D path (B moves with every decision).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

AUTO = "auto"


def parse_min_tokens(value: str) -> int | None:
    """`--disagg-min-tokens`: a token count >= 0, or `auto` (None: learn it). For argparse."""
    if value.strip().lower() == AUTO:
        return None
    try:
        tokens = int(value)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise argparse.ArgumentTypeError(
            f"expected a prompt length in tokens (an integer >= 0) or 'auto', got {value!r}")
    return tokens


@dataclass(frozen=True)
class DisaggLearning:
    """How `auto` learns: EMA weight, samples before leaving the prior, bounds, the prior."""

    prior_tokens: int = 32
    floor_tokens: int = 0
    ceiling_tokens: int = 2048
    alpha: float = 0.1
    min_samples: int = 8
    min_spread: float = 0.1  # coefficient of variation of the prefill lengths needed for a fit

    def __post_init__(self) -> None:
        if not 0 <= self.floor_tokens <= self.prior_tokens <= self.ceiling_tokens:
            raise ValueError("disaggregation threshold bounds need 0 <= floor <= prior <= "
                             "ceiling")
        if not 0 < self.alpha <= 1 or self.min_samples < 1 or self.min_spread < 0:
            raise ValueError("learning needs 0 < alpha <= 1, min_samples >= 1, min_spread >= 0")


class ThresholdSource(StrEnum):
    """Where the current threshold comes from."""

    FIXED = "fixed"  # --disagg-min-tokens N
    PRIOR = "prior"  # auto, not enough (or not usable) measurements yet
    LEARNED = "learned"  # auto, from the cost model


class Ema:
    """An exponential moving average; the first sample is taken as it is (no bias to zero)."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.value = 0.0
        self.count = 0

    def add(self, sample: float) -> None:
        self.count += 1
        self.value = sample if self.count == 1 else self.value + self.alpha * (sample - self.value)


@dataclass(frozen=True)
class ThresholdEstimate:
    """The threshold and the model inputs it came from (None: not measured yet)."""

    tokens: int
    source: ThresholdSource
    prefill_s_per_token: float | None = None  # p
    prefill_overhead_s: float | None = None  # a
    transfer_s_per_token: float | None = None  # x
    decode_batch: float | None = None  # B
    prefill_samples: int = 0
    transfer_samples: int = 0
    reason: str | None = None  # why the prior still holds

    def describe(self) -> dict[str, Any]:
        return {"threshold_tokens": self.tokens, "source": self.source.value,
                "prefill_s_per_token": self.prefill_s_per_token,
                "prefill_overhead_s": self.prefill_overhead_s,
                "transfer_s_per_token": self.transfer_s_per_token,
                "decode_batch": self.decode_batch, "prefill_samples": self.prefill_samples,
                "transfer_samples": self.transfer_samples, "reason": self.reason}


class DisaggThreshold:
    """The prompt length below which requests are served whole on a decode worker.

    Fixed when built with a token count; with `learning`, an estimator fed by the orchestrator
    (prefill legs, KV transfers) and the pairing (decode batch at each decision), recomputed at
    each observation so `tokens` is a cheap read on the routing path.
    """

    def __init__(self, fixed_tokens: int, learning: DisaggLearning | None) -> None:
        self.learning = learning
        alpha = learning.alpha if learning is not None else 1.0
        # Prefill fit moments: E[L], E[t], E[L^2], E[L*t]; transfer: E[kv seconds], E[L].
        self._len, self._time, self._len2, self._len_time = (Ema(alpha) for _ in range(4))
        self._kv_s, self._kv_len = Ema(alpha), Ema(alpha)
        self._batch = Ema(alpha)
        self._estimate = (ThresholdEstimate(fixed_tokens, ThresholdSource.FIXED)
                          if learning is None else self._compute())

    @property
    def auto(self) -> bool:
        return self.learning is not None

    @property
    def tokens(self) -> int:
        return self._estimate.tokens

    @property
    def estimate(self) -> ThresholdEstimate:
        return self._estimate

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill leg computed `tokens` uncached prompt tokens in `seconds` (wall, router)."""
        if self.learning is None or tokens <= 0 or not seconds >= 0:
            return
        for ema, sample in ((self._len, tokens), (self._time, seconds),
                            (self._len2, tokens * tokens), (self._len_time, tokens * seconds)):
            ema.add(float(sample))
        self._estimate = self._compute()

    def observe_transfer(self, tokens: int, seconds: float) -> None:
        """A decode got the KV of a `tokens`-token prompt in `seconds` (what it reported)."""
        if self.learning is None or tokens <= 0 or not seconds >= 0:
            return
        self._kv_s.add(seconds)
        self._kv_len.add(float(tokens))
        self._estimate = self._compute()

    def observe_batch(self, load: float) -> None:
        """The decode side's load (sequences) when a P/D decision was made."""
        if self.learning is None:
            return
        self._batch.add(max(1.0, load))
        self._estimate = self._compute()

    def _fit(self) -> tuple[float, float] | None:
        """(p, a) from the EMA moments, or None when the lengths are too alike."""
        assert self.learning is not None
        mean = self._len.value
        var = self._len2.value - mean * mean
        if mean <= 0 or var <= (self.learning.min_spread * mean) ** 2:
            return None
        p = (self._len_time.value - mean * self._time.value) / var
        return p, self._time.value - p * mean

    def _compute(self) -> ThresholdEstimate:
        learning = self.learning
        assert learning is not None
        fit = self._fit() if self._len.count else None
        x = self._kv_s.value / self._kv_len.value if self._kv_len.count else None
        batch = self._batch.value if self._batch.count else 1.0
        inputs: dict[str, Any] = {
            "prefill_s_per_token": fit[0] if fit else None,
            "prefill_overhead_s": fit[1] if fit else None, "transfer_s_per_token": x,
            "decode_batch": batch, "prefill_samples": self._len.count,
            "transfer_samples": self._kv_len.count}
        reason = self._not_ready(fit, x)
        if reason is not None:
            return ThresholdEstimate(learning.prior_tokens, ThresholdSource.PRIOR,
                                     reason=reason, **inputs)
        assert fit is not None and x is not None
        p, a = fit
        gain = batch * p - x  # s/token a prompt token costs more locally than moved
        tokens = (learning.ceiling_tokens if gain <= 0
                  else _clamp_ceil(max(a, 0.0) / gain, learning))
        return ThresholdEstimate(tokens, ThresholdSource.LEARNED, **inputs)

    def _not_ready(self, fit: tuple[float, float] | None, x: float | None) -> str | None:
        assert self.learning is not None
        need = self.learning.min_samples
        if self._len.count < need or self._kv_len.count < need:
            return f"fewer than {need} prefill legs and KV transfers measured"
        if fit is None:
            return "prompt lengths too alike to separate overhead from per-token cost"
        if fit[0] <= 0 or x is None:
            return "prefill time does not grow with prompt length"
        return None


def _clamp_ceil(tokens: float, learning: DisaggLearning) -> int:
    if not math.isfinite(tokens):
        return learning.ceiling_tokens
    return min(learning.ceiling_tokens, max(learning.floor_tokens, math.ceil(tokens)))
