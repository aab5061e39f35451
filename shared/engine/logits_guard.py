"""LogitsGuard: finds the rows of a step's logits that hold NaN or inf, cheaply.

Broken weights (a NaN in a checkpoint, a bad quantisation) or an overflow give logits with no
distribution to sample from; sampling them anyway answers garbage with status 200 (token 0
repeated, every logprob at the floor). The guard runs on every step that samples: one sum
over the step's [R, V] logits (finite only if every element is: a NaN or an inf makes it NaN
or inf; measured 6 us for one row of SmolLM2's 49,152 against 90 us for `isfinite().all()`,
25 us against 940 us for 16 rows), and only when that is not finite a per-row pass to name
the rows (none, when finite values merely overflowed the sum). Those rows are filled with
zeros (so the batch's sampler tensors stay finite) and the engine fails exactly those requests.

It also keeps what /metrics and /health report: how many requests failed so, and when the
latest did (None again once a later step sampled only finite logits: the model is usable).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CheckedLogits:
    """`logits` [R, V] safe to sample; `bad_rows` (indices into R) must not be used."""

    logits: torch.Tensor
    bad_rows: tuple[int, ...]


class LogitsGuard:
    """Checks each step's logits for non-finite values; counts the requests it failed."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.num_non_finite = 0  # requests failed for non-finite logits, since start
        self.last_non_finite_at: float | None = None  # clock time; None once a step is clean

    def check(self, logits: torch.Tensor) -> CheckedLogits:
        """logits [R, V] fp32 -> the same tensor when all finite (one reduction, no copy),
        else a copy with the bad rows zeroed and their indices."""
        bad = (None if math.isfinite(float(logits.sum(dtype=torch.float32)))
               else ~torch.isfinite(logits).all(dim=1))  # [R] bool
        rows = () if bad is None else tuple(bad.nonzero()[:, 0].tolist())
        if bad is None or not rows:  # all finite (a sum may overflow on finite values)
            self.last_non_finite_at = None
            return CheckedLogits(logits, ())
        self.num_non_finite += len(rows)
        self.last_non_finite_at = self._clock()
        return CheckedLogits(logits.masked_fill(bad[:, None], 0.0), rows)

    def clean(self) -> None:
        """A step sampled without logits, every row from finite values (the screened greedy
        head settles only those): as a clean check, the model is usable again."""
        self.last_non_finite_at = None

    def reset(self) -> int:
        """Forget the counts (after the warm-up request); returns how many there were."""
        count, self.num_non_finite, self.last_non_finite_at = self.num_non_finite, 0, None
        return count
