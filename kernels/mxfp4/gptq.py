"""GPTQ encoder for MXFP4: rounding with error feedback under a layer's input Hessian.

GPTQ (Frantar et al., 2022) quantises a linear's weight W [out, in] column by column: the
rounding error of column j, divided by the Cholesky factor of H^-1 (H = E[x x^T] of the
layer's inputs, [in, in]), is pushed onto the columns not yet quantised, so that the output
error ||X W^T - X Q^T||^2 rather than the weight error ||W - Q||^2 is (greedily) minimised.

For MXFP4 each 32-column group shares an exponent per row. It is chosen when the group
starts, from the error-updated weights of the group: encoder.py's search over the OCP
exponent and its neighbours, with each column's squared error weighted by GPTQ's cost of it,
1 / U_jj^2 (on random correlated inputs this gives ~3-4% lower output error than the plain
MSE choice); then the group's columns are rounded one at a time to nearest-even E2M1 at that
scale, as the reference rounds. The output is ordinary MXFP4 bytes, decoded by
reference.dequantize bit for bit; only which codes get stored changes. With H = c * I no error
propagates, the weights are equal, and the result is exactly quantize_mse's
(tests/quant/test_gptq.py checks it).

Updates are lazy (Frantar et al. section 4, "lazy batch"): inside a block of BLOCK_COLUMNS
columns each column's error updates only the rest of the block; the columns after it get the
whole block's errors in one matmul. Everything is float64: Cholesky factors of a damped H of
a few thousand columns are well within its range, and MXFP4 values are exact in it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kernels.mxfp4 import reference
from kernels.mxfp4.encoder import MSE_OFFSETS
from kernels.mxfp4.format import BLOCK_SIZE, SCALE_BIAS, check_weight

BLOCK_COLUMNS = 128  # lazy-batch width; a multiple of BLOCK_SIZE, so groups never straddle
DEFAULT_DAMP = 0.1  # fraction of mean(diag(H)) added to H's diagonal (see quantize_gptq)


def inverse_cholesky(h: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h float [in, in] (symmetric PSD) -> (U float64 [in, in] upper with U^T U = (H')^-1,
    dead bool [in]), H' = h with dead columns (zero diagonal: an input that is always 0)
    replaced by identity rows, plus damp * mean(diag) on the diagonal."""
    if not damp > 0:
        raise ValueError(f"damp must be > 0 (a fraction of mean(diag(H))), got {damp}")
    if h.dim() != 2 or h.shape[0] != h.shape[1]:
        raise ValueError(f"H must be square [in, in], got {tuple(h.shape)}")
    if not bool(torch.isfinite(h).all()):
        raise ValueError("H holds non-finite values")
    h = h.to(torch.float64).clone()
    diag = torch.diagonal(h)
    dead = diag <= 0
    h[dead, :] = 0
    h[:, dead] = 0
    diag[dead] = 1
    mean = float(diag.mean())
    diag += damp * mean
    # U without forming H^-1: with J the index reversal and J H J = M M^T (M lower),
    # H^-1 = J M^-T M^-1 J, so U = J M^-1 J is upper and U^T U = H^-1 (one Cholesky and one
    # triangular inverse instead of a Cholesky, cholesky_inverse and a second Cholesky).
    lower, info = torch.linalg.cholesky_ex(h.flip(0, 1))
    if int(info):
        raise ValueError(f"H is not positive definite after damping {damp}; raise the damping")
    eye = torch.eye(h.shape[0], dtype=torch.float64)
    return torch.linalg.solve_triangular(lower, eye, upper=False).flip(0, 1), dead


def _round_column(col: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """col float64 [out], scale float64 [out] (2^shared) -> col rounded to nearest-even E2M1
    times scale, saturating at +-6 * scale: the value reference.encode stores.

    E2M1's magnitudes are evenly spaced within [0, 2] (step 0.5), [2, 4] (step 1) and
    [4, 6] (step 2), and in each range the even codes are the even multiples of the step, so
    torch.round (half to even) on x / step is reference.e2m1_codes' rounding, in 8 ops instead
    of its 15 (this loop runs once per column)."""
    x = col.abs() / scale
    fine = torch.round(x * 2) * 0.5  # [0, 2): ties 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2
    mid = torch.round(x)  # [2, 4): ties 2.5 -> 2, 3.5 -> 4
    coarse = (torch.round(x * 0.5) * 2).clamp_(max=6.0)  # [4, inf): tie 5 -> 4, saturate at 6
    value = torch.where(x < 2, fine, torch.where(x < 4, mid, coarse))
    return torch.copysign(value * scale, col)


def _group_exponent(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """v float64 [out, 32] (a group's error-updated columns), weight float64 [32] -> int64
    [out]: per row, the exponent among encoder.MSE_OFFSETS around OCP's whose rounding has the
    least weighted squared error sum_j weight_j (q_j - v_j)^2 (OCP on ties). GPTQ's cost of
    column j's error, once the later columns compensate it, is error^2 / [H_F^-1]_jj, F the
    columns not yet rounded (Frantar et al. eq. 3), and [H_F^-1]_jj = U_jj^2: the caller
    passes 1 / U_jj^2. Equal weights give mse_exponent."""
    ocp = reference.ocp_exponent(v)
    errors = []
    for d in MSE_OFFSETS:
        shared = (ocp + d).clamp(-SCALE_BIAS, SCALE_BIAS)
        scale = reference.pow2(shared).unsqueeze(-1).expand_as(v)
        q = _round_column(v.reshape(-1), scale.reshape(-1)).view_as(v)
        errors.append(((q - v).square() * weight).sum(-1))
    best = torch.stack(errors).argmin(0)  # first minimum: OCP on ties
    return (ocp + torch.tensor(MSE_OFFSETS)[best]).clamp(-SCALE_BIAS, SCALE_BIAS)


def _quantize_block(wt: torch.Tensor, u: torch.Tensor, shared: torch.Tensor,
                    first_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One lazy block, transposed so a column is a contiguous row: wt float64 [B, out] (W's
    block columns; updated in place), u the block's diagonal part of U [B, B]; shared int64
    [out, G] gets the block's B/32 exponents from group first_group on. Returns (q [B, out],
    err [B, out]: each column's rounding error / U[j, j])."""
    q, err = torch.empty_like(wt), torch.empty_like(wt)
    scale = torch.empty(0, dtype=torch.float64)
    for j in range(wt.shape[0]):
        if j % BLOCK_SIZE == 0:  # a group starts: its exponent from the updated weights
            group = first_group + j // BLOCK_SIZE
            weight = u.diagonal()[j:j + BLOCK_SIZE].square().reciprocal()  # [32]
            shared[:, group] = _group_exponent(wt[j:j + BLOCK_SIZE].T, weight)  # [out]
            scale = reference.pow2(shared[:, group])
        q[j] = _round_column(wt[j], scale)
        err[j] = (wt[j] - q[j]) / u[j, j]
        wt[j + 1:].addr_(u[j, j + 1:], err[j], alpha=-1)  # -= outer: [B-j-1, out]
    return q, err


def quantize_gptq(w: torch.Tensor, h: torch.Tensor, damp: float = DEFAULT_DAMP,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [out, in] (in % 32 == 0, finite), h [in, in] = mean x x^T of the layer's inputs
    -> (blocks uint8 [out, in/32, 16], scales uint8 [out, in/32]), GPTQ-rounded MXFP4.

    damp: fraction of mean(diag(H)) added to H's diagonal; larger trusts the calibration
    inputs less (damp -> inf gives quantize_mse). Columns whose input is always zero are
    encoded as zero (their weight never contributes)."""
    check_weight(w)
    if w.dim() != 2:
        raise ValueError(f"GPTQ quantises a 2-D weight [out, in], got {tuple(w.shape)}")
    if h.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"H is {tuple(h.shape)}, expected [{w.shape[1]}, {w.shape[1]}]")
    # W^T [in, out] float64, rounded through float32 as the other encoders round: a column
    # of W is a contiguous row here, which the per-column loop reads and writes.
    wt = w.detach().to(torch.float32).to(torch.float64).T.contiguous()
    if not bool(torch.isfinite(wt).all()):
        raise ValueError("GPTQ needs a finite weight")
    # Columns are rounded in their stored order. GPTQ's act-order (largest diag(H) first),
    # confined to each 32-column group since a group shares its exponent, cut the output
    # error of random correlated layers by 4-5% but not SmolLM2-135M's perplexity (story /
    # technical, generated calibration, damp 0.1: 36.53 / 44.32 with it, 37.04 / 42.38 without).
    with _one_thread():
        u, dead = inverse_cholesky(h, damp)
        wt[dead] = 0
        qt, shared = _quantize(wt, u)
    return reference.encode(qt.T.unflatten(-1, (-1, BLOCK_SIZE)), shared)


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread: the column loop runs ~10 ops on a few thousand elements each,
    where an OpenMP fork/join costs more than the op (a [3072, 576] weight: 0.6 s on one
    thread, 6-25 s on two when the other core is busy); the Cholesky of a [1536, 1536] H is
    no slower on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _quantize(wt: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """wt float64 [in, out] (W^T in rounding order, dead columns zeroed; consumed), u [in, in]
    from inverse_cholesky -> (Q^T float64 [in, out], shared exponents int64 [out, in/32])."""
    cols, rows = wt.shape
    qt = torch.empty_like(wt)
    shared = torch.empty(rows, cols // BLOCK_SIZE, dtype=torch.int64)
    for lo in range(0, cols, BLOCK_COLUMNS):
        hi = min(lo + BLOCK_COLUMNS, cols)
        qt[lo:hi], err = _quantize_block(wt[lo:hi].clone(), u[lo:hi, lo:hi], shared,
                                         lo // BLOCK_SIZE)
        wt[hi:] -= u[lo:hi, hi:].T @ err  # the block's errors onto every later column at once
    return qt, shared
