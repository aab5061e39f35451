"""Prefill attention (the op pdmesh_dense::prefill_attention): our two flash kernels, bf16 dot
products (kernels/dense/csrc/flash_avx512bf16.cpp) and fp32 FMA on AVX2 (flash_avx2.cpp), and
torch's CPU flash kernel, each against causal attention written out in fp64 over the same paged
cache, and the choice between them that rope_attention makes on each tier.

What equality means: every kernel takes bf16 q/k/v, accumulates in fp32 and rounds the softmax
probabilities to bf16 before P @ V (as HF's attention does in bf16), so each is within
rtol 2^-7, atol 2^-8 of the fp64 reference; and ours are never more than 1.5x torch's worst
error on the same inputs (the same computation in another summation order).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import kernels.dense as dense
from kernels.dense import LayerGeometry, StepTables
from shared.model.rope import RopeConfig, RotaryEmbedding
from tests.support.dense import dense_or_skip

BLOCK = 16


FLASH_KERNELS = ("avx512_bf16", "avx2")  # the op's kernel names: each runs on its tier's CPUs


@pytest.fixture(params=FLASH_KERNELS)
def flash_kernel(request: pytest.FixtureRequest) -> str:
    """A flash kernel this CPU can run (the other skips: its tier is missing here)."""
    dense_or_skip(request.param)
    return str(request.param)


def _case(q_len: int, cached: int, heads: int, kv_heads: int, d: int, seed: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """q [q_len, H D], a cache holding the context's K/V in shuffled blocks, the table, ctx."""
    g = torch.Generator().manual_seed(seed)
    ctx = cached + q_len
    nblk = -(-ctx // BLOCK)
    table = (torch.randperm(nblk + 3, generator=g)[:nblk]).to(torch.int32)
    kv = torch.randn(2, nblk + 3, BLOCK, kv_heads, d, generator=g).to(torch.bfloat16)
    q = torch.randn(q_len, heads * d, generator=g).to(torch.bfloat16)
    return q, kv, table, ctx


def _reference(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, ctx: int, heads: int,
               kv_heads: int, scale: float) -> torch.Tensor:
    """Causal attention in fp64: row t (position ctx - q_len + t) sees keys 0..its position."""
    d = kv.shape[-1]
    keys = kv[0][table.long()].reshape(-1, kv_heads, d)[:ctx].double()
    values = kv[1][table.long()].reshape(-1, kv_heads, d)[:ctx].double()
    group = heads // kv_heads
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    t = q.shape[0]
    s = torch.einsum("thd,khd->htk", q.double().view(t, heads, d), keys) * scale
    pos = torch.arange(t) + ctx - t
    s.masked_fill_(torch.arange(ctx)[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("htk,khd->thd", s.softmax(-1), values).reshape(t, heads * d)


def _attend(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, ctx: int, heads: int,
            kv_heads: int, scale: float, kernel: str) -> torch.Tensor:
    return torch.ops.pdmesh_dense.prefill_attention(q, kv, table, ctx, heads, kv_heads, scale,
                                                    kernel)


# (q_len, cached, heads, kv_heads, head_dim): SmolLM2's heads (group 3, 64 wide) as a whole
# prompt and as a later chunk; no grouping, group 8 and 16; every supported width class (32,
# 96 = six channel vectors, 128, 256); prompts that end mid-tile and cross 128-key blocks; a
# group whose rows fill no whole 6-row tile (16 x 1 + 5 tokens), and 16 query heads per kv head
# over many work items (the AVX2 kernel sizes its items by rows).
SHAPES = [
    (200, 0, 9, 3, 64), (97, 300, 9, 3, 64), (33, 0, 4, 4, 32), (300, 0, 8, 1, 128),
    (130, 20, 8, 2, 96), (70, 300, 4, 2, 256), (45, 500, 16, 1, 64), (700, 0, 6, 2, 64),
    (21, 0, 1, 1, 64), (150, 40, 32, 2, 64),
]


@pytest.mark.parametrize(("q_len", "cached", "heads", "kv_heads", "d"), SHAPES)
def test_flash_kernel_matches_fp64_attention(flash_kernel: str, q_len: int, cached: int,
                                             heads: int, kv_heads: int, d: int) -> None:
    q, kv, table, ctx = _case(q_len, cached, heads, kv_heads, d, seed=q_len + d)
    scale = d ** -0.5
    want = _reference(q, kv, table, ctx, heads, kv_heads, scale)
    ours = _attend(q, kv, table, ctx, heads, kv_heads, scale, flash_kernel)
    theirs = _attend(q, kv, table, ctx, heads, kv_heads, scale, "torch")
    assert ours.shape == q.shape and ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.double(), want, rtol=2**-7, atol=2**-8)
    torch.testing.assert_close(theirs.double(), want, rtol=2**-7, atol=2**-8)
    worst_ours = (ours.double() - want).abs().max().item()
    worst_theirs = (theirs.double() - want).abs().max().item()
    assert worst_ours <= 1.5 * worst_theirs + 1e-3


def test_flash_kernel_is_deterministic_across_threads(flash_kernel: str) -> None:
    """Work items write disjoint rows and never sum across threads: 1 and 2 threads agree."""
    q, kv, table, ctx = _case(300, 100, 9, 3, 64, seed=7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _attend(q, kv, table, ctx, 9, 3, 0.125, flash_kernel)
        torch.set_num_threads(2)
        two = _attend(q, kv, table, ctx, 9, 3, 0.125, flash_kernel)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def _cpu_flags() -> set[str]:
    """This CPU's flags, read independently of the library's own detection."""
    flags = re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    assert flags is not None, "no flags line in /proc/cpuinfo"
    return set(flags.group(1).split())


def _has_amx() -> bool:
    return "amx_bf16" in _cpu_flags()


# Per tier: the kernel its fused op runs for a sequence of 16+ new rows (AMX: see below), and the
# name `pdmesh doctor` prints for it.
ROUTES = {
    "avx512_bf16": ("avx512_bf16", "bf16 flash kernel (vdpbf16ps)"),
    "avx512": ("torch", "torch's flash kernel (fp32 FMA)"),
    "avx2": ("avx2", "fp32 flash kernel (AVX2 FMA)"),
}


@pytest.mark.parametrize("tier", sorted(ROUTES))
@pytest.mark.parametrize("q_len", [20, 200])
def test_rope_attention_routes_prefill_rows_to_the_kernel_for_this_cpu(tier: str,
                                                                       q_len: int) -> None:
    """A sequence of 16+ new rows (64+ for torch's kernel: 200 here) runs its tier's flash
    kernel: on avx512_bf16 the bf16 kernel where the CPU has no AMX (torch's kernel runs bf16
    at fp32 speed there) and torch's with AMX; on avx2 the fp32 FMA kernel; on avx512 torch's.
    The fused op's output equals that kernel's bit for bit on the same rotated q and cache."""
    path = dense_or_skip(tier)
    heads, kv_heads, d, cached = 9, 3, 64, 50
    ctx = cached + q_len
    decoder = dense.decoder(path.backend)
    assert decoder is not None
    g = torch.Generator().manual_seed(q_len)
    qkv = torch.randn(q_len, (heads + 2 * kv_heads) * d, generator=g).to(torch.bfloat16)
    nblk = -(-ctx // BLOCK)
    cache = torch.randn(2, nblk + 1, BLOCK, kv_heads, d, generator=g).to(torch.bfloat16)
    table = torch.arange(1, nblk + 1, dtype=torch.int32)
    rotary = RotaryEmbedding(RopeConfig(), d, 4096, torch.bfloat16)
    tables = StepTables(table[None], torch.tensor([ctx], dtype=torch.int32),
                        torch.tensor([0, q_len], dtype=torch.int32))
    out = decoder.rope_attention(qkv, cache, rotary.table(ctx), tables,
                                 LayerGeometry(heads, kv_heads, d, 1e-5, d ** -0.5))
    kernel, name = ROUTES[tier]
    if tier == "avx512_bf16" and _has_amx():
        kernel, name = "torch", "torch's flash kernel (AMX)"
    assert decoder.prefill_attention_kernel == name
    if kernel == "torch" and q_len < 64:
        return  # torch's kernel starts at 64 rows: the per-row kernel ran (test_dense_layer.py)
    # The rotated q, as rope_attention computed it (RoPE is bit-exact against torch: see
    # test_dense_layer.py), then the kernel this CPU should have used.
    cos, sin = rotary.lookup(torch.arange(cached, ctx))
    q = RotaryEmbedding.apply(qkv[:, : heads * d].view(q_len, heads, d), cos, sin)
    expected = _attend(q.reshape(q_len, -1).contiguous(), cache, table, ctx, heads, kv_heads,
                       d ** -0.5, kernel)
    assert torch.equal(out, expected)


def test_doctor_names_the_prefill_attention_kernel() -> None:
    """What `pdmesh doctor` prints is what the engine's default tier runs."""
    from services.doctor import _dense_status

    decoder = dense.decoder()
    if decoder is None:
        pytest.skip("no native decoder on this machine: doctor says so instead")
    assert f"prefill attention: {decoder.prefill_attention_kernel}" in _dense_status()


def test_bad_input_raises(flash_kernel: str) -> None:
    q, kv, table, ctx = _case(40, 10, 8, 2, 64, seed=1)
    with pytest.raises(RuntimeError, match="q_len <= context_len"):
        _attend(q, kv, table, 39, 8, 2, 0.125, flash_kernel)
    with pytest.raises(RuntimeError, match="block id out of range"):
        _attend(q, kv, torch.full_like(table, kv.shape[1]), ctx, 8, 2, 0.125, flash_kernel)
    with pytest.raises(RuntimeError, match="do not match the heads"):
        _attend(q, kv, table, ctx, 6, 2, 0.125, flash_kernel)
    with pytest.raises(RuntimeError, match="kernel must be 'torch', 'avx512_bf16' or 'avx2'"):
        _attend(q, kv, table, ctx, 8, 2, 0.125, "fast")
    q80, kv80, table80, ctx80 = _case(40, 0, 4, 2, 80, seed=2)  # 80: not a multiple of 32
    with pytest.raises(RuntimeError, match="multiple of 32"):
        _attend(q80, kv80, table80, ctx80, 4, 2, 80 ** -0.5, flash_kernel)
    # torch's kernel runs any width.
    want = _reference(q80, kv80, table80, ctx80, 4, 2, 80 ** -0.5)
    torch.testing.assert_close(_attend(q80, kv80, table80, ctx80, 4, 2, 80 ** -0.5, "torch")
                               .double(), want, rtol=2**-7, atol=2**-8)


@pytest.mark.parametrize("kernel", FLASH_KERNELS)
def test_a_kernel_runs_only_where_the_cpu_has_its_instructions(kernel: str) -> None:
    """The op checks the CPU before running a tier's code (a SIGILL is not an error): it
    refuses with a reason where the CPU lacks the kernel's instructions (avx512_bf16; avx2 and
    fma), and runs where it has them."""
    info = dense.build_info()
    assert info.state == "ready", f"dense build failed: {info.error}"
    q, kv, table, ctx = _case(40, 0, 4, 2, 64, seed=3)
    flags = _cpu_flags()
    if {"avx512_bf16"} <= flags if kernel == "avx512_bf16" else {"avx2", "fma"} <= flags:
        got = _attend(q, kv, table, ctx, 4, 2, 0.125, kernel)
        torch.testing.assert_close(got.double(), _reference(q, kv, table, ctx, 4, 2, 0.125),
                                   rtol=2**-7, atol=2**-8)
    else:
        with pytest.raises(RuntimeError, match="cannot run"):
            _attend(q, kv, table, ctx, 4, 2, 0.125, kernel)
