"""GPTQ for MXFP4 (kernels/mxfp4/gptq.py, shared/model/gptq.py, `pdmesh quantize --method
gptq`): lower output error than the MSE encoder under correlated inputs, ordinary MXFP4
bytes, exactly the MSE encoder when H is diagonal, and a checkpoint that loads and serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernels.mxfp4 import reference
from kernels.mxfp4.encoder import quantize_mse
from kernels.mxfp4.format import E2M1_MAGNITUDES
from kernels.mxfp4.gptq import _round_column, quantize_gptq
from services.cli import main as cli_main
from shared.config import EngineConfig
from shared.model.attention import AttentionMetadata
from shared.model.loader import iter_weights, load_model, open_checkpoint
from shared.model.tokenizer import Tokenizer
from tests.support.quant import PROMPTS, engine_from, greedy

# Calibration and evaluation texts for the tiny model: unrelated to each other. The calibration
# text is varied on purpose: a few repeated sentences give a low-rank H that GPTQ overfits
# (logits then further from dense than MSE's on other text).
CALIBRATION = (
    "The committee met on Tuesday to review the budget for the new library. Several members "
    "asked whether the heating system could be replaced first, since the old boiler had failed "
    "twice during the winter. Rain fell over the hills all night; by morning the river had "
    "risen past the second step of the mill, and the ducks sat on the bench by the gate. "
    "Mix two cups of flour with a pinch of salt, add warm water slowly, and knead for ten "
    "minutes until the dough is smooth. In 1854 the railway reached the valley, bringing coal, "
    "newspapers and visitors from the city. Why do cats sleep so much? Mostly because hunting "
    "takes short bursts of energy, and resting saves it. Quarterly revenue grew 4% to 12.3 "
    "million, while costs fell; the board expects similar results next year. She opened the "
    "letter, read it twice, and laughed out loud for the first time in weeks.")
EVALUATION = ("To install the package, open a terminal and run the setup script. Check the "
              "version number afterwards, then restart the service so the change applies.")


def correlated_inputs(rows: int, cols: int, seed: int) -> torch.Tensor:
    """x [rows, cols] float64 whose columns are strongly correlated (a random mixing)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(cols, dtype=torch.float64) + 0.3 * torch.randn(cols, cols, generator=g,
                                                                      dtype=torch.float64)
    return torch.randn(rows, cols, generator=g, dtype=torch.float64) @ mix


def output_error(x: torch.Tensor, w: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor],
                 ) -> float:
    q = reference.dequantize(*packed, torch.float64)
    return float((x @ (w.double() - q).T).square().sum())


def test_output_error_below_mse_encoder() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 128)
    x = correlated_inputs(1024, 128, seed=1)
    h = x.T @ x / x.shape[0]
    gptq, mse = output_error(x, w, quantize_gptq(w, h, 0.01)), output_error(x, w, quantize_mse(w))
    assert gptq < 0.75 * mse


def test_scaled_identity_hessian_is_the_mse_encoder() -> None:
    """With H = c I, U is diagonal: no error reaches another column, and every column weighs
    the same in the exponent choice, so the bytes are quantize_mse's. (A non-uniform diagonal
    H weighs the columns of a group unequally: not MSE's choice then.)"""
    torch.manual_seed(2)
    w = torch.randn(40, 96) * torch.logspace(-3, 1, 96)
    for c in (1.0, 3.7):
        h = c * torch.eye(96, dtype=torch.float64)
        for got, want in zip(quantize_gptq(w, h), quantize_mse(w), strict=True):
            assert torch.equal(got, want)


def test_bytes_are_ordinary_mxfp4() -> None:
    """Every decoded value is on the E2M1 grid times its block's scale, and re-encoding the
    decoded weight at the stored exponents (the reference's rounding) gives the same bytes."""
    torch.manual_seed(3)
    w = torch.randn(16, 64) * 3
    x = correlated_inputs(256, 64, seed=4)
    blocks, scales = quantize_gptq(w, x.T @ x / 256)
    values = reference.dequantize(blocks, scales, torch.float64).unflatten(-1, (-1, 32))
    scale = reference.e8m0_values()[scales.long()].unsqueeze(-1)  # [16, 2, 1]
    grid = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    assert torch.isin((values / scale).abs(), grid).all()
    again = reference.encode(values, scales.long() - 127)
    assert torch.equal(again[0], blocks) and torch.equal(again[1], scales)


def test_round_column_matches_reference_rounding() -> None:
    """The column rounding is reference.e2m1_codes' (ties to even, saturation), ties included."""
    mids = [(a + b) / 2 for a, b in zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:], strict=False)]
    x = torch.tensor([*mids, *E2M1_MAGNITUDES, 7.0, 100.0], dtype=torch.float64)
    x = torch.cat([x, torch.rand(1000, dtype=torch.float64) * 8])
    x = torch.cat([x, -x])
    scale = torch.full_like(x, 0.25)
    want = reference.e2m1_values()[reference.e2m1_codes(x.abs())] * torch.sign(x) * 0.25
    assert torch.equal(_round_column(x * 0.25, scale).abs(), want.abs())


def test_dead_columns_and_bad_input() -> None:
    torch.manual_seed(5)
    w = torch.randn(8, 64)
    x = correlated_inputs(128, 64, seed=6)
    x[:, 3] = 0  # an input that never fires
    blocks, scales = quantize_gptq(w, x.T @ x / 128)
    assert reference.dequantize(blocks, scales)[:, 3].eq(0).all()
    with pytest.raises(ValueError, match="damp"):
        quantize_gptq(w, torch.eye(64), damp=0.0)
    with pytest.raises(ValueError, match="expected"):
        quantize_gptq(w, torch.eye(32))


def quantize_cli(src: Path, out: Path, *flags: str) -> int:
    return cli_main(["quantize", str(src), str(out), *flags])


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calibration.txt"
    path.write_text(CALIBRATION, encoding="utf-8")
    return path


@torch.inference_mode()
def eval_logits(model_dir: Path, tokenizer_dir: Path, block: int = 16) -> torch.Tensor:
    """Logits [T, vocab] of EVALUATION, one fp32 prefill over a fresh paged KV cache."""
    model, _ = load_model(model_dir, "float32")
    ids = Tokenizer(tokenizer_dir).encode(EVALUATION)
    c, n = model.config, len(ids)
    kv = torch.zeros(c.num_layers, 2, -(-n // block), block, c.num_kv_heads, c.head_dim)
    meta = AttentionMetadata.build([0], [n], [list(range(-(-n // block)))], block)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta, kv))


def test_gptq_checkpoint_serves_and_beats_mse(tiny_untied, tmp_path, calibration_file) -> None:
    outs = {}
    # GPTQ alone (--no-awq): the fold is tests/quant/test_awq.py's
    for name, flags in {"gptq": ["--method", "gptq", "--no-awq", "--calibration",
                                 str(calibration_file)],
                        "mse": ["--method", "mse"]}.items():
        outs[name] = tmp_path / name
        assert quantize_cli(tiny_untied, outs[name], *flags) == 0
    config = json.loads((outs["gptq"] / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    stored = dict(iter_weights(open_checkpoint(outs["gptq"]).weight_files))
    mse = dict(iter_weights(open_checkpoint(outs["mse"]).weight_files))
    q = "model.layers.1.mlp.down_proj.weight_blocks"
    assert not torch.equal(stored[q], mse[q])  # GPTQ did change the rounding
    first, _ = load_model(outs["gptq"], "float32")  # the pre-quantised loader, twice
    second, _ = load_model(outs["gptq"], "float32")
    assert greedy(engine_from(first, outs["gptq"]), PROMPTS, max_tokens=8) == greedy(
        engine_from(second, outs["gptq"]), PROMPTS, max_tokens=8)
    dense = eval_logits(tiny_untied, tiny_untied)
    err = {k: float((eval_logits(outs[k], tiny_untied) - dense).square().sum())
           for k in ("gptq", "mse")}
    assert err["gptq"] < err["mse"], err


def test_gptq_tied_head(tiny_tied, tmp_path, calibration_file) -> None:
    """--lm-head: the (tied) head is GPTQ-rounded too, on the final norm's outputs; the dense
    embedding is stored unchanged beside it."""
    out = tmp_path / "q"
    assert quantize_cli(tiny_tied, out, "--method", "gptq", "--calibration",
                        str(calibration_file), "--lm-head") == 0
    stored = dict(iter_weights(open_checkpoint(out).weight_files))
    source = dict(iter_weights(open_checkpoint(tiny_tied).weight_files))
    embed = "model.embed_tokens.weight"
    assert torch.equal(stored[embed], source[embed]) and "lm_head.weight_blocks" in stored
    model, _ = load_model(out, "float32")
    assert greedy(engine_from(model, out), PROMPTS[:1], max_tokens=4)


@pytest.mark.parametrize(("flags", "message"), [
    (["--method", "gptq", "--calibration", "MISSING"], "MISSING"),
    (["--method", "gptq", "--calibration", "EMPTY"], "empty"),
    (["--method", "gptq", "--damp", "0"], "damp"),
    (["--method", "mse", "--damp", "0.1"], "--method gptq"),
    (["--method", "mse", "--no-awq"], "--method gptq"),
])
def test_bad_gptq_input_exits_2(tiny_untied, tmp_path, capsys, flags, message) -> None:
    (tmp_path / "EMPTY").write_text(" \n", encoding="utf-8")
    flags = [str(tmp_path / f) if f in ("MISSING", "EMPTY") else f for f in flags]
    assert quantize_cli(tiny_untied, tmp_path / "out", *flags) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_on_the_fly_gptq_is_refused() -> None:
    with pytest.raises(ValueError, match="pdmesh quantize"):
        EngineConfig(quantization="mxfp4", quant_encoder="gptq")


def test_generated_calibration(tiny_untied) -> None:
    """The default calibration: each generic chat prompt, templated, plus the model's own
    sampled reply (seeded: SamplingParams' seed makes it reproducible)."""
    from shared.engine.calibration import generated_sequences

    prompts = ("Explain tides.", "Write a haiku.")
    first = generated_sequences(tiny_untied, tokens=8, prompts=prompts, dtype="float32",
                                kv_cache_bytes=4 << 20)
    tokenizer = Tokenizer(tiny_untied)
    template = tokenizer.apply_chat_template([{"role": "user", "content": prompts[0]}])
    prompt = tokenizer.encode(template, add_special_tokens=False)
    assert len(first) == 2 and first[0][:len(prompt)] == prompt and len(first[0]) > len(prompt)
