"""Swapping a loaded model onto the native CPU kernels: the fast bf16 GEMV and fused decoder.

Its own module so that the engine and the speculative draft model (a second model the engine
owns) take it from one place without importing each other.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from shared.config import EngineConfig

if TYPE_CHECKING:
    from kernels.dense.greedy_head import GreedyHead

log = logging.getLogger(__name__)


def accelerate(model: torch.nn.Module, config: EngineConfig) -> None:
    """Swap bf16 nn.Linear layers for the native GEMV (kernels.dense) where it can build, and
    route the model's forward through the native fused decoder layer / paged attention.

    torch's batch-1 bf16 matmul reads weights at ~9 GiB/s here; the kernel streams them near
    memory bandwidth. The swap keeps the same Parameters (tied lm_head stays tied). The fused
    layer replaces ~20 torch ops per layer (norms, RoPE, gather + padded SDPA, SiLU, adds) by
    one C++ call per decode step. Without a compiler everything stays on plain torch, with the
    build's warning. fp32 models are untouched.
    """
    if config.dtype != "bfloat16":
        return
    from kernels.dense import BuildConfig, accelerate_linears, configure, decoder

    # The build root follows the engine's cache dir; a prebuilt library (`pdmesh kernels build`,
    # PDMESH_KERNELS_DIR: the container image) is taken as the MXFP4 library takes it.
    configure(BuildConfig(build_root=config.resolved_cache_dir / "torch_extensions",
                          prebuilt_dir=BuildConfig.from_env().prebuilt_dir))
    swapped = accelerate_linears(model)
    log.info("kernels.dense: %d bf16 linear layers use the fast GEMV path", swapped)
    native = decoder(mxfp4_int8=config.quant_activations == "int8")
    use_native = getattr(model, "use_native", None)  # models without a native path lack it
    built = prebuild_gemm_shapes(model, config)
    log.info("kernels.dense: %d bf16 GEMM shapes built ahead of serving", built)
    if native is not None and callable(use_native):
        fused = use_native(native)
        if getattr(model, "native", None) is not None:
            log.info("kernels.dense: native paged attention; %d fused decoder layers", fused)
        else:  # QK-norm, MoE...: layouts the fused kernels do not take
            log.info("kernels.dense: this model's layout has no native decode path; plain torch")


@torch.no_grad()
def prebuild_gemm_shapes(model: torch.nn.Module, config: EngineConfig) -> int:
    """Run each distinct prefill-sized bf16 GEMM the model can issue once, so that oneDNN's
    primitive cache holds them all before the first request; returns how many ran.

    Prefill rows are bucketed (kernels/dense/backend.py padded_rows), so the shapes are a
    known, bounded set: every linear's (in, out) times every row bucket up to the step's token
    budget (the LM head: up to the batch's sequences), and every decode batch size on the
    reference path, whose small products are GEMMs too. Building them here, as vLLM captures
    its CUDA graphs for a fixed list of batch sizes at start-up, makes a worker's RSS when it
    turns ready its RSS in steady state (each primitive holds ~0.6 MB of JIT'd code and
    scratch), and takes the build off the first request of each new length. Layers shared
    across the stack are run once per shape; tiers that widen bf16 to fp32, and CPUs whose
    bf16 GEMM is not oneDNN's (onednn_bf16_gemm), cache nothing.
    """
    from kernels.dense import DenseLinear
    from kernels.dense.backend import BF16_GEMM_TIERS, MAX_ROWS, onednn_bf16_gemm, row_buckets
    from shared.model.quant import MXFP4Linear

    seen: set[tuple[type, int, int, bool]] = set()
    runs = 0
    if not onednn_bf16_gemm():  # torch's own bf16 GEMM: no primitive cache to fill
        return runs
    for name, module in model.named_modules():
        if not isinstance(module, DenseLinear | MXFP4Linear):
            continue
        if module.path.backend.tier not in BF16_GEMM_TIERS:
            continue
        key = (type(module), module.in_features, module.out_features, module.bias is not None)
        if key in seen:
            continue
        seen.add(key)
        top = config.max_num_batched_tokens
        if name.rpartition(".")[2] == "lm_head":  # samples one row per sequence (+ drafts)
            spec = config.speculative_config
            top = min(top, config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec
                                                       else 0)))
        # Without a C++ library (the reference path) decode-sized products are GEMMs too.
        small = range(1, min(top, MAX_ROWS) + 1) if module.path.library is None else range(0)
        for rows in [*small, *row_buckets(top)]:
            module(torch.zeros(rows, module.in_features, dtype=torch.bfloat16))
            runs += 1
    return runs


def greedy_head(model: object, config: EngineConfig) -> GreedyHead | None:
    """The screened greedy head of `model`'s LM head (kernels/dense/greedy_head.py), or None:
    config.greedy_screen off, a model whose logits are more than the head's output (Gemma's
    soft-cap), no LM head on this stage, or a head the dense C++ kernels do not run (MXFP4,
    fp32, no compiler). Built once per runner; its int8 copy is half the head's bytes."""
    if not config.greedy_screen or not getattr(model, "logits_are_head_output", False):
        return None
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Module):
        return None
    from kernels.dense.greedy_head import GreedyHead

    if not GreedyHead.takes(head):
        return None
    try:
        screen = GreedyHead(head)
    except ValueError as exc:  # non-finite weights: the full head runs, the guard reports
        log.warning("greedy head: not screened (%s)", exc)
        return None
    log.info("greedy head: %s", screen.extra_repr())
    return screen
