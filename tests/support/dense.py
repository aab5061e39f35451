"""The dense library's compiled tiers as test parameters, and the skip rule for them."""

from __future__ import annotations

import pytest

import kernels.dense as dense

# Every compiled tier of the dense library (kernels.tier labels), fastest first: each runs the
# same tests against the plain-torch reference; a CPU lacking one skips that tier's tests only.
DENSE_TIERS = ("avx512_bf16", "avx512", "avx2")


def dense_or_skip(tier: str) -> dense.KernelPath:
    """tier's KernelPath; a failed build fails the test, only a CPU lacking the tier skips."""
    info = dense.build_info()
    assert info.state == "ready", f"dense build failed: {info.error}"
    if tier not in info.available:
        pytest.skip(f"this CPU cannot run {tier}")
    return dense.kernel_path(tier)
