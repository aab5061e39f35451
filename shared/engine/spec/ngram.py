"""N-gram (prompt lookup) proposer: a pure function on token lists.

The longest suffix of the sequence (prompt + output) with a length in [min_n, max_n] that also
occurs earlier in the sequence proposes the tokens that followed its EARLIEST earlier
occurrence (for input-grounded work that is the copy in the prompt, with the most continuation
available), up to k of them. No match: no proposal.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: list[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k draft tokens continuing `tokens`, or [] (see the module docstring)."""
    if k < 1 or min_n < 1 or max_n < min_n:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    length = len(seq)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Earlier windows: starts 0..length-n-1 (the suffix itself starts at length-n).
        windows = sliding_window_view(seq[:length - 1], n)  # [length-n, n]
        hits = np.flatnonzero((windows == seq[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return [int(t) for t in seq[start:start + k]]
    return []
