"""Activation-aware channel scales before GPTQ (shared/model/awq.py): the fold keeps the dense
model's function for every pre-norm family (GQA, q/k/v bias, QK-norm, fused Phi-3 weights),
the search never makes a linear's rounding error worse and scales up the loud channels, and
`pdmesh quantize --method gptq` stores the folded norms (`--no-awq`: the source's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.calibration import file_sequences
from shared.model import awq
from shared.model.attention import AttentionMetadata
from shared.model.gptq import GptqConfig, GptqEncoder, calibrate
from shared.model.loader import iter_weights, load_model, open_checkpoint
from shared.model.tokenizer import Tokenizer
from tests.quant.test_gptq import CALIBRATION, EVALUATION, quantize_cli
from tests.support.quant import PROMPTS, engine_from, greedy

PRE_NORM = [{"arch": "llama"}, {"arch": "qwen2"}, {"arch": "qwen3"}, {"arch": "mistral"},
            {"arch": "phi3"}, {"arch": "llama", "attention_bias": True}]


def loud_stats(n: int, seed: int) -> awq.InputStats:
    """Inputs whose channels differ in size by 100x (a few loud ones): the case AWQ is for."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, n, generator=g, dtype=torch.float64)
    x *= torch.where(torch.rand(n, generator=g) < 0.1, 30.0, 0.3).to(torch.float64)
    return awq.InputStats(x.abs().mean(0), x.T @ x / x.shape[0])


@torch.inference_mode()
def logits(model, ids: list[int], block: int = 16) -> torch.Tensor:
    c, n = model.config, len(ids)
    kv = torch.zeros(c.num_layers, 2, -(-n // block), block, c.num_kv_heads, c.head_dim)
    meta = AttentionMetadata.build([0], [n], [list(range(-(-n // block)))], block)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta, kv))


def test_search_never_worse_and_scales_the_loud_channels() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 128)
    stats = loud_stats(128, seed=1)
    alpha, rel, s = awq.search_scales(w, stats, grid=20)
    assert alpha > 0 and rel < 0.9
    base = awq.output_error(w, stats.hessian.float(), torch.ones(128))
    assert awq.output_error(w, stats.hessian.float(), s) == pytest.approx(rel * base)
    loud = stats.mean_abs > 1
    assert s[loud].min() > s[~loud].max()  # every loud channel gets a larger scale
    # Equal channels: every alpha gives s = 1, so nothing is scaled.
    flat = awq.InputStats(torch.ones(128, dtype=torch.float64), stats.hessian)
    assert awq.search_scales(w, flat, grid=20)[:2] == (0.0, 1.0)


def test_search_measures_an_even_row_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tall W (an LM head, a big model's gate/up) is measured on SEARCH_ROWS evenly spaced
    rows: the relative error reported is that of the sample."""
    monkeypatch.setattr(awq, "SEARCH_ROWS", 16)
    torch.manual_seed(1)
    w = torch.randn(64, 128)
    stats = loud_stats(128, seed=2)
    alpha, rel, s = awq.search_scales(w, stats, grid=20)
    sample, h = w[::4], stats.hessian.float()
    assert alpha > 0
    assert awq.output_error(sample, h, s) == pytest.approx(
        rel * awq.output_error(sample, h, torch.ones(128)))


@pytest.mark.parametrize("spec", PRE_NORM, ids=lambda s: "-".join(map(str, s.values())))
def test_fold_keeps_the_dense_function(make_checkpoint, spec) -> None:
    model, _ = load_model(make_checkpoint(preset="tiny", seed=3, **spec), "float32")
    ids = Tokenizer(make_checkpoint(preset="tiny", seed=3, **spec)).encode(EVALUATION)
    before = logits(model, ids)
    c = model.config
    sizes = {"self_attn.qkv_proj": c.hidden_size, "mlp.gate_up_proj": c.hidden_size,
             "self_attn.o_proj": c.q_size, "mlp.down_proj": c.intermediate_size}
    norms = []
    for i, layer in enumerate(model.layers):
        assert awq.foldable(layer)
        norms.append(layer.input_layernorm.weight.clone())
        stats = {name: loud_stats(n, seed=10 * i + k) for k, (name, n) in enumerate(sizes.items())}
        with torch.no_grad():
            folded = awq.fold_layer(layer, c, stats)
        assert all(a > 0 for a in folded.alpha.values()), folded.alpha  # every group scaled
        assert all(r < 1 for r in folded.relative_error.values()), folded.relative_error
        # o_proj's scales are one per kv-head channel, repeated over the group's query heads
        group = c.num_heads // c.num_kv_heads
        o = folded.scales["self_attn.o_proj"].view(c.num_kv_heads, group, c.head_dim)
        assert torch.equal(o, o[:, :1].expand_as(o))
    assert not torch.equal(model.layers[0].input_layernorm.weight, norms[0])
    torch.testing.assert_close(logits(model, ids), before, rtol=1e-4, atol=1e-4)


def test_calibrate_folds_where_it_helps_and_the_model_keeps_its_function(make_checkpoint) -> None:
    """Through GPTQ's calibration (dense pass: the linears stay dense afterwards)."""
    path = make_checkpoint(preset="tiny", seed=4, arch="qwen2")
    model, _ = load_model(path, "float32")
    tok = Tokenizer(path)
    ids = tok.encode(EVALUATION)
    before = logits(model, ids)
    embedding = model.embed_tokens.weight.clone()
    result = calibrate(model, [tok.encode(CALIBRATION)],
                       GptqConfig(sequential=False, lm_head=True))
    assert sorted(result.folded) == [0, 1]
    # The tied head took its own scales (folded into the final norm); the embedding did not.
    assert result.head_alpha > 0 and "norm.weight" in result.changed_params()
    assert model.lm_head.weight is not model.embed_tokens.weight
    assert torch.equal(model.embed_tokens.weight, embedding)
    for fold in result.folded.values():
        assert all(0 <= r <= 1 for r in fold.relative_error.values())
    torch.testing.assert_close(logits(model, ids), before, rtol=1e-4, atol=1e-4)
    for name, (blocks, scales) in result.packed.items():  # ordinary MXFP4 bytes
        assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8, name
    # Without the fold nothing is folded, and the dense tensors stay as stored.
    plain, _ = load_model(path, "float32")
    assert not calibrate(plain, [tok.encode(CALIBRATION)], GptqConfig(awq=False)).folded


def test_other_families_are_rounded_without_the_fold(make_checkpoint) -> None:
    """Gemma's sandwich norms do not feed the linears directly: no fold there."""
    model, _ = load_model(make_checkpoint(preset="tiny", seed=0, arch="gemma2"), "float32")
    assert not any(awq.foldable(layer) for layer in model.layers)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantize_cli_stores_the_folded_model(make_checkpoint, tmp_path: Path, arch) -> None:
    """The checkpoint holds the folded tensors (norm weights; qwen2's v bias) that the
    encoder computed, and the packed bytes of the folded linears; `--no-awq` stores the
    source's norms. With test_fold_keeps_the_dense_function: the checkpoint is the
    quantised form of a model equal to the source."""
    src = make_checkpoint(preset="tiny", seed=5, arch=arch)
    calib = tmp_path / "calibration.txt"
    calib.write_text(CALIBRATION, encoding="utf-8")
    flags = ["--method", "gptq", "--calibration", str(calib)]
    assert quantize_cli(src, tmp_path / "awq", *flags) == 0
    assert quantize_cli(src, tmp_path / "plain", *flags, "--no-awq") == 0
    source = dict(iter_weights(open_checkpoint(src).weight_files))
    folded = dict(iter_weights(open_checkpoint(tmp_path / "awq").weight_files))
    plain = dict(iter_weights(open_checkpoint(tmp_path / "plain").weight_files))
    norms = [n for n in source if n.endswith("layernorm.weight")]
    assert norms and all(torch.equal(plain[n], source[n]) for n in norms)

    encoder = GptqEncoder(src, file_sequences(calib, Tokenizer(src)), GptqConfig())
    assert encoder.folded and encoder.dense
    for name, value in encoder.dense.items():
        assert torch.equal(folded[name], value.to(source[name].dtype)), name
        assert not torch.equal(folded[name], source[name]) or name.endswith(
            ("q_proj.bias", "k_proj.bias")), name  # q/k rows of a fused bias stay
    if arch == "qwen2":
        assert any(n.endswith("v_proj.bias") for n in encoder.dense)
    for name in source:
        if name.endswith("_proj.weight"):
            blocks, scales = encoder.pack(name, source[name])
            assert torch.equal(folded[name + "_blocks"], blocks), name
            assert torch.equal(folded[name + "_scales"], scales), name
        elif name not in encoder.dense:
            assert torch.equal(folded[name], source[name]), name
    model, _ = load_model(tmp_path / "awq", "float32")  # the pre-quantised loader serves it
    assert greedy(engine_from(model, tmp_path / "awq"), PROMPTS[:1], max_tokens=4)
