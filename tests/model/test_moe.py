"""The sparse MoE block (shared/model/moe.py) and Qwen3-MoE loading, against HF transformers.

Whole-model HF parity (chunked prefill, mixed batches, greedy generate) is the qwen3_moe cases
of test_llama_vs_hf.py; here: the layer layout and config keys HF reads, the block itself
bit for bit against HF's in bf16, that a step runs only the routed experts on only their
tokens, and MXFP4 experts (on the fly and pre-quantised) against the reference-dequantised
model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeForCausalLM,
    Qwen3MoeSparseMoeBlock,
)

from shared.model.config import ModelConfig
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import load_model
from shared.model.moe import MoeConfig, SparseMoeBlock
from shared.model.quant import MXFP4Linear, QuantConfig
from shared.model.quant_checkpoint import write_quantized_checkpoint
from tests.support.model import PagedRunner, random_ids
from tests.support.quant import replace_with_reference

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=32)


@pytest.mark.parametrize("step, only", [(1, []), (2, []), (1, [0, 3]), (3, [2])])
def test_sparse_layers_are_hfs(step: int, only: list[int]) -> None:
    hf_cfg = Qwen3MoeConfig(num_hidden_layers=6, num_experts=4, num_experts_per_tok=2,
                            decoder_sparse_step=step, mlp_only_layers=only, **TINY)
    hf = Qwen3MoeForCausalLM(hf_cfg)
    # HF saves num_experts as num_local_experts: parse what it writes.
    config = ModelConfig.from_hf(hf_cfg.to_dict())
    ours = LlamaForCausalLM(config, (2, 6))  # a later pipeline stage: global indices count
    want = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.layers] == want[2:]
    assert config.qk_norm and config.moe is not None and config.moe.num_experts == 4


def test_expert_count_keys() -> None:
    base = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2,
            "num_experts_per_tok": 2, **TINY}
    for key in ("num_experts", "num_local_experts"):
        moe = ModelConfig.from_hf({**base, key: 6}).moe
        assert moe is not None and moe.num_experts == 6
    with pytest.raises(ValueError, match="disagree"):
        ModelConfig.from_hf({**base, "num_experts": 6, "num_local_experts": 4})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf({**base, "num_experts": 4, "num_experts_per_tok": 5})
    assert ModelConfig.from_hf({**base, "num_experts": 0}).moe is None  # all layers dense


def _block_pair(norm: bool, dtype: torch.dtype) -> tuple[SparseMoeBlock, Qwen3MoeSparseMoeBlock]:
    """Our block and HF's with the same random weights (HF stores experts as [E, 2I, H])."""
    hf_cfg = Qwen3MoeConfig(num_hidden_layers=1, num_experts=8, num_experts_per_tok=3,
                            norm_topk_prob=norm, **TINY)
    torch.manual_seed(0)
    hf = Qwen3MoeSparseMoeBlock(hf_cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    hf = hf.to(dtype)
    moe = MoeConfig.from_hf(hf_cfg.to_dict())
    assert moe is not None
    ours = SparseMoeBlock(moe, TINY["hidden_size"], dtype)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(hf.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(hf.experts.down_proj[e])
    return ours, hf


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_equals_hf_block(norm: bool, dtype: torch.dtype) -> None:
    """Same ops in the same order (experts ascending) as HF: equal bit for bit."""
    ours, hf = _block_pair(norm, dtype)
    x = torch.randn(37, TINY["hidden_size"], generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x[None])[0])


def test_step_runs_only_routed_experts_on_their_tokens() -> None:
    ours, _ = _block_pair(True, torch.float32)
    x = torch.randn(5, TINY["hidden_size"], generator=torch.Generator().manual_seed(2))
    calls: dict[int, torch.Tensor] = {}

    def record(e: int) -> Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor], None]:
        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
            assert e not in calls, "an expert runs at most once per step"
            calls[e] = args[0]
        return hook

    for e, expert in enumerate(ours.experts):
        expert.register_forward_hook(record(e))
    with torch.no_grad():
        _, ids = ours.gate(x)
        ours(x)
    # Each expert's tokens in HF's order: by top-k slot, then token.
    routed = {e: [t for k in range(ids.shape[1]) for t in range(5) if ids[t, k] == e]
              for e in set(ids.flatten().tolist())}
    assert len(routed) < len(ours.experts), "every expert hit: the test would not discriminate"
    assert set(calls) == set(routed)
    for e, tokens in routed.items():
        assert torch.equal(calls[e], x[tokens]), e


def test_moe_layers_decline_the_fused_native_block(make_checkpoint: Callable[..., Path]) -> None:
    ckpt = make_checkpoint(arch="qwen3_moe", tie_word_embeddings=False, mlp_only_layers=(0,))
    model = load_model(ckpt, "bfloat16")[0]
    dense, sparse = model.layers
    assert isinstance(sparse.mlp, SparseMoeBlock) and sparse.native_weights(1) is None
    assert dense.native_weights(1) is not None


def test_missing_expert_weight_is_named(make_checkpoint: Callable[..., Path]) -> None:
    ckpt = make_checkpoint(arch="qwen3_moe", tie_word_embeddings=False)
    model = LlamaForCausalLM(load_model(ckpt, "float32")[1])
    weights = load_file(ckpt / "model.safetensors")
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.mlp\.experts\.5\."):
        model.load_weights(weights.items())


def _greedy(model: LlamaForCausalLM) -> list[list[int]]:
    runner = PagedRunner(model, seed=3)
    return [runner.greedy(f"s{n}", random_ids(n, seed=n), 12)[0] for n in (6, 40)]


def test_mxfp4_experts_equal_the_reference_dequantised_model(
        make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """--quantization mxfp4 packs every expert linear (the router stays dense); a
    pre-quantised checkpoint (`pdmesh quantize`) loads the very same packed experts."""
    ckpt = make_checkpoint(arch="qwen3_moe", tie_word_embeddings=False, mlp_only_layers=(0,))
    quant = QuantConfig(quantize_lm_head=False)
    fly = load_model(ckpt, "float32", quantization=quant)[0]
    block = fly.layers[1].mlp
    assert isinstance(block, SparseMoeBlock) and type(block.gate.weight) is nn.Parameter
    assert all(isinstance(e.gate_up_proj, MXFP4Linear) and isinstance(e.down_proj, MXFP4Linear)
               for e in block.experts)
    reference = load_model(ckpt, "float32")[0]
    replace_with_reference(reference, quantize_lm_head=False)
    tokens = _greedy(fly)
    assert tokens == _greedy(reference)
    write_quantized_checkpoint(ckpt, tmp_path / "q", quant)
    pre = load_model(tmp_path / "q", "float32")[0]
    state, want = pre.state_dict(), fly.state_dict()
    assert sorted(state) == sorted(want)
    assert all(torch.equal(state[k], want[k]) for k in want)
