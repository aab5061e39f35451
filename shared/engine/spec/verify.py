"""Verification of a draft against the target model's own samples (lossless).

The runner samples the target at every scheduled position of a speculating request exactly as
it samples one token (same logits pipeline, same per-position seeding: the draw at position p
depends only on (seed, p, probs)), giving s_0..s_d for a draft t_0..t_{d-1}. The accepted
output is the longest prefix with s_j == t_j, then the target's own token at the first mismatch
(or the bonus token s_d when all d match).

Why that is lossless, and the rejection sampling of a one-hot draft: s_j ~ p_j, so the draft
token t_j is accepted with probability p_j(t_j); on a rejection the emitted s_j is p_j
conditioned on s_j != t_j, which is the residual distribution (p_j with t_j removed,
renormalised). Each s_j uses its own noise, so every emitted token has exactly the
distribution of sampling one token at a time; greedy rows are the argmax case (accept iff
the draft equals the argmax). Coupling the accept test and the residual draw to one sample
also keeps seeded requests reproducible with speculation on or off, alone or in a batch.

Exactness holds to the extent that the model computes a position's logits the same whether a
step holds 1 or 1 + K rows of the request: bit for bit in float32 (tested), and in bf16 on the
native kernels, dense or MXFP4, whose GEMVs sum every output in one fixed order and whose
attention and elementwise ops work per row (tests/engine/test_spec_bf16_exact.py on the real
model, test_spec_decode.py). The scheduler keeps a speculating step within 32 rows
(MAX_STEP_ROWS); not covered: a decode row beside a prefill chunk that takes the step past 32
rows (all rows then go through torch's GEMM, whose per-row sums depend on the row count; the
same holds with speculation off, where the chunk boundaries differ).
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_tokens(draft: Sequence[int], samples: Sequence[int]) -> list[int]:
    """The tokens to append: s_0..s_a where a is the number of accepted draft tokens.

    samples has one more entry than draft (the target's sample at each drafted position and
    at the bonus position).
    """
    if len(samples) != len(draft) + 1:
        raise ValueError(f"{len(samples)} samples for a draft of {len(draft)} tokens")
    a = 0
    while a < len(draft) and samples[a] == draft[a]:
        a += 1
    return list(samples[:a + 1])
