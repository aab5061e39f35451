"""`pdmesh quantize` writes a pre-quantised checkpoint (`*.weight_blocks` / `*.weight_scales`,
config.json `quantization_config`) that loads without re-quantising and gives the very same
packed weights, and greedy tokens, as quantising on the fly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernels import mxfp4
from services.cli import main as cli_main
from shared.model.loader import iter_weights, load_model, open_checkpoint, stored_tensor_names
from shared.model.quant import DEFAULT_ENCODER, QuantConfig
from shared.model.quant_checkpoint import write_quantized_checkpoint
from tests.support.quant import PROMPTS, engine_from, greedy, quantized_modules


def quantize_cli(src: Path, out: Path, *flags: str) -> int:
    return cli_main(["quantize", str(src), str(out), "--format", "mxfp4", *flags])


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize(("flag", "head"), [("--lm-head", True), ("--no-lm-head", False)])
@pytest.mark.parametrize("method", [None, "ocp", "mse"])
def test_written_checkpoint_layout(tiny_untied, tmp_path, flag, head, method):
    out = tmp_path / "q"
    assert quantize_cli(tiny_untied, out, flag, *(["--method", method] if method else [])) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert ("lm_head" in config["quantization_config"]["modules_to_not_convert"]) != head
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (tiny_untied / name).read_bytes()
    stored = dict(iter_weights(open_checkpoint(out).weight_files))
    source = dict(iter_weights(open_checkpoint(tiny_untied).weight_files))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert q not in stored
    encoder = mxfp4.Encoder(method) if method else DEFAULT_ENCODER
    blocks, scales = mxfp4.quantize(source[q], backend="reference", encoder=encoder)
    if method == "ocp":  # the plain OCP rule, the reference's own quantize
        assert torch.equal((blocks, scales)[1], mxfp4.reference.quantize(source[q])[1])
    assert torch.equal(stored[q + "_blocks"], blocks) and torch.equal(stored[q + "_scales"], scales)
    assert ("lm_head.weight_blocks" in stored) == head and ("lm_head.weight" in stored) != head
    assert torch.equal(stored["model.embed_tokens.weight"], source["model.embed_tokens.weight"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head", [True, False])
def test_prequantised_loads_as_on_the_fly(tiny_untied, tmp_path, dtype, head):
    out = tmp_path / "q"
    assert quantize_cli(tiny_untied, out, "--lm-head" if head else "--no-lm-head") == 0
    quant = QuantConfig(quantize_lm_head=head)
    fly, _ = load_model(tiny_untied, dtype, quantization=quant)
    pre, _ = load_model(out, dtype)  # quantization detected from config.json
    assert set(quantized_modules(pre)) == set(quantized_modules(fly))
    assert_same_state(pre, fly)
    assert greedy(engine_from(pre, out, dtype), PROMPTS) == greedy(
        engine_from(fly, tiny_untied, dtype), PROMPTS)


def test_prequantised_tied_head(tiny_tied, tmp_path):
    """A tied model stores the dense embedding plus a packed `lm_head.weight_*`."""
    out = tmp_path / "q"
    assert quantize_cli(tiny_tied, out, "--lm-head") == 0
    names = stored_tensor_names(open_checkpoint(out).weight_files)
    assert {"model.embed_tokens.weight", "lm_head.weight_blocks"} <= names
    fly, _ = load_model(tiny_tied, "float32", quantization=QuantConfig(quantize_lm_head=True))
    pre, _ = load_model(out, "float32", quantization="mxfp4")
    assert_same_state(pre, fly)
    assert greedy(engine_from(pre, out), PROMPTS) == greedy(engine_from(fly, tiny_tied), PROMPTS)


def test_sharded_checkpoint_and_pipeline_stages(tiny_untied, tmp_path):
    out = tmp_path / "q"
    report = write_quantized_checkpoint(tiny_untied, out, QuantConfig(quantize_lm_head=True),
                                        max_shard_bytes=1 << 20)
    assert len(report.files) > 2 and (out / "model.safetensors.index.json").is_file()
    whole, _ = load_model(tiny_untied, "float32", quantization=QuantConfig(quantize_lm_head=True))
    assert_same_state(load_model(out, "float32")[0], whole)
    first, _ = load_model(out, "float32", layer_range=(0, 1))
    last, _ = load_model(out, "float32", layer_range=(1, 2))
    assert torch.equal(first.layers[0].mlp.down_proj.weight_blocks,
                       whole.layers[0].mlp.down_proj.weight_blocks)
    assert torch.equal(last.lm_head.weight_scales, whole.lm_head.weight_scales)


def test_refusals(tiny_untied, tmp_path, capsys):
    out = tmp_path / "q"
    assert quantize_cli(tiny_untied, out, "--no-lm-head") == 0
    assert quantize_cli(out, tmp_path / "again") == 2  # already quantised
    assert quantize_cli(tiny_untied, out) == 2  # output not empty
    assert "already quantised" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dense LM head"):
        load_model(out, "float32", quantization=QuantConfig(quantize_lm_head=True))
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no quantization_config"):
        load_model(out, "float32")
