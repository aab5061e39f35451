"""Gemma 2 / Gemma 3 configuration: HF defaults, refusals by key, and the compat-hash factors.

HF parity of the decoder itself (windows, soft-caps, sandwich norms, local RoPE) is in
test_llama_vs_hf.py; P/D and PP equality in tests/pd and tests/pipeline test_*_families.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from transformers import Gemma2Config, Gemma3TextConfig

from services.kv_transfer.pull import PullTransfer
from shared.config import EngineConfig
from shared.engine.kv_spec import kv_spec_of
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.model.config import ModelConfig
from shared.model.gemma_config import FULL, SLIDING
from shared.model.make_model import ModelSpec, hf_config, write_checkpoint
from shared.model.registry import resolve_model
from shared.protocol.compat import CompatFactors, diff_factors

BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def _gemma3(**extra: Any) -> dict[str, Any]:
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **BASE, **extra}


def _gemma2(**extra: Any) -> dict[str, Any]:
    return {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", **BASE, **extra}


@pytest.mark.parametrize("raw, hf_cls", [(_gemma2(), Gemma2Config), (_gemma3(), Gemma3TextConfig)])
def test_defaults_follow_the_hf_config_classes(raw: dict[str, Any], hf_cls: type) -> None:
    cfg = ModelConfig.from_hf(raw)
    hf = hf_cls(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    spec = cfg.gemma
    assert spec is not None
    assert cfg.layer_windows == tuple(hf.sliding_window if t == SLIDING else None
                                      for t in hf.layer_types)
    assert spec.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert spec.attn_softcap == hf.attn_logit_softcapping
    assert spec.final_softcap == hf.final_logit_softcapping
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.qk_norm == (hf_cls is Gemma3TextConfig)
    if hf_cls is Gemma3TextConfig:  # the sliding layers' own base, 10,000 against 1,000,000
        assert spec.local_rope.theta == hf.rope_parameters[SLIDING]["rope_theta"]
        assert cfg.rope.theta == hf.rope_parameters[FULL]["rope_theta"]


def test_gemma3_nested_in_a_multimodal_config_is_read_from_text_config() -> None:
    text = {k: v for k, v in _gemma3().items() if k != "architectures"}
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": text}
    assert ModelConfig.from_hf(raw) == ModelConfig.from_hf(_gemma3())


@pytest.mark.parametrize("change, key", [
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"layer_types": [SLIDING] * 3}, "layer_types"),
    ({"layer_types": ["chunked_attention"] * 6}, "layer_types"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "mrope"),
])
def test_what_the_decoder_cannot_run_is_refused_by_key(change: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf(_gemma2(**change))


def _hash(raw: dict[str, Any]) -> CompatFactors:
    spec = kv_spec_of("m", "fp", EngineConfig(), ModelConfig.from_hf(raw))
    return CompatFactors.for_transfer(spec, PullTransfer)


@pytest.mark.parametrize("change, factor", [
    ({"sliding_window": 512}, "attention_windows"), ({"layer_types": [FULL] * 6},
                                                     "attention_windows"),
    ({"attn_logit_softcapping": 20.0}, "rope"), ({"query_pre_attn_scalar": 64}, "rope"),
    ({"rope_local_base_freq": 5000.0}, "rope"),
])
def test_every_kv_changing_gemma_constant_changes_the_hash(change: dict[str, Any],
                                                           factor: str) -> None:
    """Windows are the one attention_windows factor of every family (not repeated among the
    gemma.* keys); Gemma's other constants ride in the rope factor."""
    base, changed = _hash(_gemma3()), _hash(_gemma3(**change))
    assert base.hash != changed.hash
    (diff,) = diff_factors(base, changed.to_wire())
    assert diff.name == factor
    if factor == "rope":
        assert "gemma." in diff.local


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_bf16_engine_serves_gemma_on_the_plain_path(arch: str, tmp_path) -> None:
    """bf16 runs the plain path (the native kernels decline Gemma), over a prompt longer than
    the window; the tokens' correctness is the fp32 HF parity of test_llama_vs_hf.py."""
    spec = ModelSpec(arch=arch, seed=1)
    tokenizer_dir = resolve_model("smollm2-135m-instruct", progress=False)
    path = write_checkpoint(tmp_path / "ckpt", spec, tokenizer_dir)
    window = hf_config(spec)["sliding_window"]
    prompt = [(37 * i) % 4000 + 100 for i in range(4 * window)]
    llm = LLM(model=str(path), dtype="bfloat16", cache_dir=tmp_path, num_threads=1)
    assert llm.engine.runner.model.native is None
    out = llm.generate([prompt],
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.prompt_token_ids == prompt
