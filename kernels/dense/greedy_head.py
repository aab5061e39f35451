"""GreedyHead: the greedy token of a bf16 LM head from an int8 screen plus a few exact rows.

A greedy decode step reads the whole LM head to keep one index: SmolLM2's tied head is 49,152
x 576 bf16, 57 MB of the step's 270. GreedyHead keeps an int8 copy of the head (one scale per
row) and, per step, screens it (half the bytes), bounds how far each screened logit can be from
the exact one, and recomputes exactly only the rows that could still win: a handful of the
49,152. The token is the one argmax over the full head's logits gives, bit for bit, ties to the
lowest index included: the candidates' logits come from the same GEMV kernel, rounded alike
(csrc/greedy_head.cpp states the bound and why it is safe). It costs the int8 copy's memory
(half the head's) and applies only where a row's token is the plain argmax: greedy sampling
with no logprobs, penalties, bans or grammar (the engine's runner decides).
"""

from __future__ import annotations

import math
from typing import TypeGuard

import torch
from torch import nn

from kernels.dense.backend import MAX_ROWS, Backend
from kernels.dense.module import DenseLinear
from kernels.huge_pages import huge_page_empty

SCREEN_CHUNK = 32  # csrc/dense.h kScreenChunk: q rows are zero-padded to a multiple of it
# Rows per call up to which the screen beats the full head, per tier (benchmarks/greedy_head.py,
# SmolLM2's head, caches flushed, 2 threads, AMD Zen 4: full/screen 1.50x at 1 row, 1.14x at 4
# and 0.86x at 8 on avx512_bf16, whose vdpbf16ps GEMV stays a weight stream longest; 1.08x at
# 16 and 1.01x at 32 on avx512; 1.94x at 32 on avx2). The screen's integer work grows with the
# rows; the full head's stays one stream of the weights until its GEMV turns compute-bound.
SCREEN_MAX_ROWS = {Backend.AVX512_BF16: 4, Backend.AVX512: 16, Backend.AVX2: MAX_ROWS}
_ROWS_PER_PASS = 4096  # head rows quantised at a time (bounds the fp64 temporaries)


def _rounding_slack(kpad: int) -> float:
    """Relative fp32 rounding of a kpad-term dot product, as gamma_n = n u / (1 - n u) with
    u = 2^-24 and n = 2 kpad + 8: the exact kernel's accumulation (vdpbf16ps rounds once per
    pair step) and the screen's conversion and scaling, with room to spare."""
    n = 2 * kpad + 8
    u = 2.0 ** -24
    return n * u / (1 - n * u)


def screen_weights(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight bf16 [V, K] -> (q int8 [V, kpad], coef fp32 [3, V]): q = round(w / s) per row
    (s = max|w| / 127), coef = (s, a, b) with a = |w - s q| and b = |s q| (L2 norms over the
    row), each widened by the rounding slack so that the op's bound holds (greedy_head.cpp)."""
    v, k = weight.shape
    kpad = -(-k // SCREEN_CHUNK) * SCREEN_CHUNK
    # On huge pages like the decoder stack (kernels/huge_pages.py): each screen streams it all.
    q = huge_page_empty(v * kpad).view(torch.int8).view(v, kpad)  # zero-filled: the padding
    coef = torch.empty(3, v, dtype=torch.float32)
    slack = _rounding_slack(kpad)
    for r0 in range(0, v, _ROWS_PER_PASS):
        w = weight[r0:r0 + _ROWS_PER_PASS].double()
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).float().double()
        qr = torch.round(w / scale[:, None]).clamp_(-127, 127)
        sq = qr * scale[:, None]
        err = (w - sq).norm(dim=1)
        qn = sq.norm(dim=1)
        wn = w.norm(dim=1)
        rows = slice(r0, r0 + len(w))
        q[rows, :k] = qr.to(torch.int8)
        coef[0, rows] = scale.float()
        # Round the coefficients up (float() may round down): a relative 1e-6 covers it.
        coef[1, rows] = ((err + slack * (wn + qn)) * (1 + 1e-6)).float()
        coef[2, rows] = (qn * (1 + slack) * (1 + 1e-6)).float()
    if not bool(torch.isfinite(coef).all()):
        raise ValueError("greedy head: the LM head holds non-finite weights")
    return q, coef


class GreedyHead(nn.Module):
    """The greedy token of a DenseLinear LM head (bf16 [V, K], no bias) on the C++ kernels.

    Holds the head's DenseLinear (its weight is shared, not copied) and the int8 screen as
    non-persistent buffers, so the model's byte count includes them and no checkpoint gains
    them. forward(hidden) returns the token ids, or None when the op could not settle a row
    (non-finite hidden state or logits): the caller then runs the full head, whose logits
    guard reports the row.
    """

    q: torch.Tensor
    coef: torch.Tensor

    def __init__(self, head: DenseLinear) -> None:
        super().__init__()
        if not GreedyHead.takes(head):
            raise ValueError("greedy head: needs a bias-free DenseLinear on the C++ kernels")
        self.head = [head]  # a list: not a submodule (the model owns it), no double count
        q, coef = screen_weights(head.weight.detach())
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("coef", coef, persistent=False)
        self.vocab_size = head.out_features
        self.max_rows = SCREEN_MAX_ROWS[head.path.backend]
        self._path_id = head.path.backend.path_id
        self._op = head.path.library.ops.greedy_head.default  # type: ignore[union-attr]

    @staticmethod
    def takes(head: nn.Module) -> TypeGuard[DenseLinear]:
        """Whether `head` is a DenseLinear whose every decode call runs the C++ GEMV."""
        return (isinstance(head, DenseLinear) and head.bias is None
                and head.path.library is not None
                and head.path.takes_weight(head.weight, None)
                and hasattr(head.path.library.ops, "greedy_head"))

    def forward(self, hidden: torch.Tensor) -> list[int] | None:
        """hidden bf16 [N, K], N <= MAX_ROWS -> the N token ids argmax of the head's logits
        gives, or None. Exact for any N; callers screen only up to max_rows, where it is also
        faster."""
        if hidden.dim() != 2 or hidden.dtype != torch.bfloat16 or not 1 <= len(hidden) <= MAX_ROWS:
            raise ValueError(f"greedy head: expected bf16 [1..{MAX_ROWS}, K], got "
                             f"{hidden.dtype} {tuple(hidden.shape)}")
        tokens: list[int] = self._op(hidden.contiguous(), self.head[0].weight, self.q, self.coef,
                                     self._path_id).tolist()
        return None if min(tokens) < 0 else tokens  # (a torch op here costs a parallel region)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, int8 screen {math.prod(self.q.shape) / 2**20:.1f} MiB"
