"""gpt-oss against HF transformers on small random checkpoints (fp32): experts with biases and
the clamped SwiGLU, the biased top-k router, attention sinks, alternating sliding windows (8
positions here, which every prompt exceeds) and YaRN, from HF's dense layout and from the
MXFP4 `*_blocks`/`*_scales` layout OpenAI ships (loaded into MXFP4Linear as stored)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssForCausalLM

from kernels import mxfp4
from shared.model.gpt_oss import GptOssForCausalLM as Ours
from shared.model.loader import load_model
from shared.model.quant import MXFP4Linear
from tests.support.gpt_oss_ckpt import WINDOW, write_gpt_oss
from tests.support.model import PagedRunner, random_ids

VOCAB = 256
ATOL, RTOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gpt_oss(tmp_path_factory.mktemp("gpt-oss"), seed=0, vocab_size=VOCAB)


def _hf(path: Path) -> GptOssForCausalLM:
    return GptOssForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_greedy(hf: GptOssForCausalLM, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])  # an explicit mask: a prompt may contain the pad id
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_config_reads_the_gpt_oss_layout(dense: Path) -> None:
    _, cfg = load_model(dense, torch.float32)
    spec = cfg.gpt_oss
    assert spec is not None and (spec.num_experts, spec.top_k) == (4, 2)
    # HF's default layer_types alternate, sliding first: the windows are ModelConfig's.
    assert cfg.layer_windows == (WINDOW, None) and cfg.kv_window is None
    assert cfg.rope.type.value == "yarn" and cfg.rope.attention_factor > 1.0
    assert cfg.attention_bias and cfg.attention_out_bias


@pytest.mark.parametrize("length", [5, 30])
def test_greedy_matches_hf_past_the_window(dense: Path, length: int) -> None:
    ours, _ = load_model(dense, torch.float32)
    assert isinstance(ours, Ours)
    prompt = [t % VOCAB for t in random_ids(length, seed=length)]
    tokens, _ = PagedRunner(ours, seed=2).greedy("s", prompt, 12)
    assert tokens == _hf_greedy(_hf(dense), prompt, 12)
    assert len(set(tokens)) > 1, "degenerate continuation would not exercise decoding"


def test_chunked_and_batched_logits_match_hf(dense: Path) -> None:
    ours, _ = load_model(dense, torch.float32)
    hf = _hf(dense)
    a, b = ([t % VOCAB for t in random_ids(n, seed=n)] for n in (21, 13))
    runner = PagedRunner(ours, seed=1)
    got_a = [runner.step([("a", a[:9])])["a"]]
    out = runner.step([("b", b), ("a", a[9:])])  # a's second chunk beside b's prefill
    got_a.append(out["a"])
    with torch.no_grad():
        for got, ids in ((torch.cat(got_a), a), (out["b"], b)):
            ref = hf(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


def _mxfp4_pair(dense: Path, out: Path) -> tuple[Path, Path]:
    """(an MXFP4 checkpoint in OpenAI's layout, a dense one holding its exact dequantisation)."""
    tensors = load_file(str(dense / "model.safetensors"))
    packed, exact = dict(tensors), dict(tensors)
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        blocks, scales = mxfp4.quantize(t.transpose(1, 2).contiguous())  # [E, out, in/32, 16]
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        exact[name] = mxfp4.dequantize(blocks, scales, dtype=torch.float32).transpose(1, 2)
    config = json.loads((dense / "config.json").read_text())
    dirs = []
    for kind, weights, extra in (
            ("mxfp4", packed, {"quantization_config": {
                "quant_method": "mxfp4", "modules_to_not_convert": [
                    "model.layers.*.self_attn", "model.layers.*.mlp.router",
                    "model.embed_tokens", "lm_head"]}}),
            ("exact", exact, {})):
        d = out / kind
        d.mkdir()
        save_file({k: v.contiguous() for k, v in weights.items()}, str(d / "model.safetensors"),
                  metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps({**config, **extra}))
        dirs.append(d)
    return dirs[0], dirs[1]


def test_mxfp4_experts_load_natively_and_match_hf_on_their_dequantisation(
        dense: Path, tmp_path: Path) -> None:
    packed, exact = _mxfp4_pair(dense, tmp_path)
    ours, _ = load_model(packed, torch.float32)
    experts = ours.layers[0].mlp.experts
    assert all(isinstance(e.gate_up_proj, MXFP4Linear) for e in experts)
    assert not isinstance(ours.layers[0].self_attn.qkv_proj, MXFP4Linear)  # kept dense
    stored = load_file(str(packed / "model.safetensors"))
    assert torch.equal(experts[1].down_proj.weight_blocks,
                       stored["model.layers.0.mlp.experts.down_proj_blocks"][1])
    prompt = [t % VOCAB for t in random_ids(24, seed=3)]
    tokens, _ = PagedRunner(ours, seed=2).greedy("s", prompt, 10)
    assert tokens == _hf_greedy(_hf(exact), prompt, 10)
