"""ModelConfig normalisation: flat and nested layouts, both RoPE key generations, refusals."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoConfig

from shared.model.config import ModelConfig
from shared.model.rope import RopeConfig, RopeType

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": [2, 7], "torch_dtype": "bfloat16",
}


def nested(text: dict, **top: object) -> dict:
    """A multimodal-style config wrapping `text` under text_config."""
    return {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
            "vision_config": {"hidden_size": 32, "model_type": "clip_vision_model"},
            "text_config": text, **top}


def hf_view(d: dict) -> dict:
    """The same fields as HF transformers derives them (independent reference)."""
    c = AutoConfig.for_model(**{k: v for k, v in d.items() if k != "architectures"})
    rp = c.rope_parameters
    return {"num_kv_heads": c.num_key_value_heads, "head_dim": getattr(c, "head_dim", None)
            or c.hidden_size // c.num_attention_heads, "theta": rp["rope_theta"],
            "rope_type": rp["rope_type"], "factor": rp.get("factor", 1.0),
            "max_pos": c.max_position_embeddings, "tie": c.tie_word_embeddings,
            "eps": c.rms_norm_eps}


def our_view(m: ModelConfig) -> dict:
    return {"num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim, "theta": m.rope.theta,
            "rope_type": m.rope.type.value, "factor": m.rope.factor,
            "max_pos": m.max_position_embeddings, "tie": m.tie_word_embeddings,
            "eps": m.rms_norm_eps}


def test_flat_llama() -> None:
    m = ModelConfig.from_hf(LLAMA)
    assert (m.architecture, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (
        "LlamaForCausalLM", 2, 4, 2, 16)
    assert m.rope == RopeConfig(theta=50000.0)
    assert m.eos_token_ids == (2, 7) and m.bos_token_id == 1 and m.torch_dtype == "bfloat16"
    assert not m.attention_bias and not m.attention_out_bias
    assert our_view(m) == hf_view(LLAMA)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.hidden_size = 3  # type: ignore[misc]


def test_nested_equals_flat() -> None:
    text = {k: v for k, v in LLAMA.items() if k != "architectures"}
    assert ModelConfig.from_hf(nested(text)) == ModelConfig.from_hf(LLAMA)
    # Fields only at the top level still count; equal values in both places are fine.
    partial = {k: v for k, v in text.items() if k != "tie_word_embeddings"}
    both = nested(partial, tie_word_embeddings=True, vocab_size=1000)
    assert ModelConfig.from_hf(both) == ModelConfig.from_hf(LLAMA)


def test_conflicting_layouts_are_refused_naming_fields() -> None:
    text = {k: v for k, v in LLAMA.items() if k != "architectures"}
    bad = nested(text, hidden_size=128, num_hidden_layers=2, num_key_value_heads=4)
    with pytest.raises(ValueError, match="disagree") as err:
        ModelConfig.from_hf(bad)
    assert "hidden_size" in str(err.value) and "num_key_value_heads" in str(err.value)
    assert "num_hidden_layers" not in str(err.value)


@pytest.mark.parametrize("rope_keys", [
    {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}},
    {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_parameters": {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0}},
    {"rope_theta": 1e6, "rope_parameters": {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0}},
])
def test_both_rope_generations(rope_keys: dict) -> None:
    base = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    m = ModelConfig.from_hf({**base, **rope_keys})
    assert m.rope == RopeConfig(theta=1e6, type=RopeType.LINEAR, factor=2.0)
    assert our_view(m) == hf_view({**base, **rope_keys})


def test_rope_generations_disagreeing_are_refused() -> None:
    cfg = {**LLAMA, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    with pytest.raises(ValueError, match="theta"):
        ModelConfig.from_hf(cfg)


def test_llama3_rope_defaults_original_context_like_hf() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    m = ModelConfig.from_hf({**LLAMA, "rope_scaling": scaling})
    hf = AutoConfig.for_model(**{k: v for k, v in LLAMA.items() if k != "architectures"},
                              rope_scaling=scaling)
    assert m.rope.original_max_position_embeddings == hf.rope_parameters[
        "original_max_position_embeddings"] == 256
    assert (m.rope.low_freq_factor, m.rope.high_freq_factor) == (1.0, 4.0)


@pytest.mark.parametrize("scaling, match", [
    ({"rope_type": "mrope", "factor": 4.0}, "unsupported rope scaling type 'mrope'"),
    ({"rope_type": "linear"}, "needs a 'factor'"),
    ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_unsupported_rope_is_refused(scaling: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**LLAMA, "rope_scaling": scaling})


def test_qwen2_always_has_qkv_bias_and_no_o_bias() -> None:
    cfg = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
           "attention_bias": False}
    m = ModelConfig.from_hf(cfg)
    assert m.architecture == "Qwen2ForCausalLM" and m.attention_bias and not m.attention_out_bias
    llama = ModelConfig.from_hf({**LLAMA, "attention_bias": True})
    assert llama.attention_bias and llama.attention_out_bias


def test_qwen3_has_qk_norm_its_own_head_dim_and_hf_defaults() -> None:
    """Qwen3: QK-norm always, head_dim from the config (HF's default 128 when absent, not
    hidden / heads), q/k/v and o biases only with attention_bias; checked against HF's own
    Qwen3Config."""
    qwen3 = {k: v for k, v in LLAMA.items() if k != "architectures"} | {"model_type": "qwen3"}
    m = ModelConfig.from_hf({**qwen3, "architectures": ["Qwen3ForCausalLM"]})
    assert m.qk_norm and m.head_dim == 128 and not m.attention_bias and not m.attention_out_bias
    assert our_view(m) == hf_view(qwen3)
    explicit = ModelConfig.from_hf({**qwen3, "head_dim": 24, "attention_bias": True})
    assert (explicit.head_dim, explicit.q_size, explicit.kv_size) == (24, 96, 48)
    assert explicit.attention_bias and explicit.attention_out_bias
    assert our_view(explicit) == hf_view({**qwen3, "head_dim": 24, "attention_bias": True})
    assert not ModelConfig.from_hf(LLAMA).qk_norm


def test_explicit_head_dim_and_mqa() -> None:
    m = ModelConfig.from_hf({**LLAMA, "head_dim": 32, "num_key_value_heads": 1})
    assert (m.head_dim, m.num_kv_heads, m.q_size, m.kv_size) == (32, 1, 128, 32)
    assert our_view(m) == hf_view({**LLAMA, "head_dim": 32, "num_key_value_heads": 1})


def hf_windows(d: dict) -> tuple[int | None, ...]:
    """Each layer's window as HF's modeling code reads it (independent reference): Qwen2/3,
    Gemma 2/3 and gpt-oss attention take config.sliding_window on "sliding_attention" layers;
    Mistral, Phi-3 and Qwen3-MoE pass config.sliding_window to every layer."""
    c = AutoConfig.for_model(**{k: v for k, v in d.items() if k != "architectures"})
    n = c.num_hidden_layers
    by_type = ("qwen2", "qwen3", "gemma2", "gemma3_text", "gpt_oss")
    types = c.layer_types if d["model_type"] in by_type else ["sliding_attention"] * n
    windows = tuple(c.sliding_window if t == "sliding_attention" else None for t in types)
    return () if all(w is None for w in windows) else windows


@pytest.mark.parametrize("extra", [
    {"model_type": "mistral", "sliding_window": 128},
    {"model_type": "mistral"},  # HF's Mistral default window is 4096 < 131072
    {"model_type": "mistral", "sliding_window": 64,  # HF Mistral ignores layer_types
     "layer_types": ["full_attention", "sliding_attention"]},
    {"model_type": "phi3", "sliding_window": 32},
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 128,
     "max_window_layers": 1},
    {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 128,
     "max_window_layers": 0},
    {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 16,
     "layer_types": ["sliding_attention", "full_attention"]},
    {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 16,
     "max_window_layers": 0},
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16},  # 28 > 2 layers
    {"model_type": "qwen3_moe", "use_sliding_window": True, "sliding_window": 16},
    {"model_type": "qwen3_moe", "use_sliding_window": False, "sliding_window": 16},
    {"model_type": "gemma2", "sliding_window": 16, "hidden_activation": "gelu_pytorch_tanh"},
    {"model_type": "gemma3_text", "sliding_window": 16, "num_hidden_layers": 7,
     "hidden_activation": "gelu_pytorch_tanh"},  # HF's default pattern: layer 6 is full
    {"model_type": "gpt_oss", "sliding_window": 16, "num_local_experts": 4},
    {"model_type": "gpt_oss", "sliding_window": 16, "num_local_experts": 4,
     "layer_types": ["full_attention", "sliding_attention"]},
])
def test_layer_windows_follow_hf(extra: dict) -> None:
    cfg = {**LLAMA, "architectures": None, **extra}
    if "max_position_embeddings" not in extra and extra["model_type"] == "mistral":
        cfg.pop("max_position_embeddings")
    m = ModelConfig.from_hf(cfg)
    assert m.layer_windows == hf_windows(cfg)
    windows = [m.window(i) for i in range(m.num_layers)]
    assert m.kv_window == (None if None in windows else max(windows))  # type: ignore[type-var]


def test_mixed_layers_have_no_kv_window() -> None:
    m = ModelConfig.from_hf({**LLAMA, "architectures": None, "model_type": "qwen2",
                             "use_sliding_window": True, "sliding_window": 8,
                             "max_window_layers": 1})
    assert m.layer_windows == (None, 8) and m.kv_window is None
    assert ModelConfig.from_hf(LLAMA).kv_window is None


@pytest.mark.parametrize("extra, match", [
    # HF Llama has no sliding-window attention: refuse rather than guess.
    ({"model_type": "llama", "sliding_window": 64, "layer_types": ["sliding_attention"] * 2},
     "sliding_window=64"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["chunked_attention"] * 2}, "layer_types"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["sliding_attention"]}, "layer_types"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window"),
])
def test_unsupported_sliding_window_settings_are_refused(extra: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**LLAMA, "architectures": None, **extra})


@pytest.mark.parametrize("extra", [
    {"model_type": "mistral", "sliding_window": None},
    {"model_type": "mistral", "sliding_window": 256},  # window covers the whole context
    {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 128},
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 128,
     "max_window_layers": 2},  # no layer at or past max_window_layers
    {"model_type": "qwen3", "sliding_window": 128},  # HF Qwen3: use_sliding_window is False
])
def test_harmless_sliding_window_settings_load(extra: dict) -> None:
    m = ModelConfig.from_hf({**LLAMA, "architectures": None, **extra})
    assert m.model_type == extra["model_type"]


@pytest.mark.parametrize("change, match", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported model"),
    ({"hidden_size": None, "vocab_size": None}, "vocab_size, hidden_size"),
    ({"num_key_value_heads": 3}, "multiple of"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_bad_configs_are_refused(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**LLAMA, **change})


def test_eos_int_and_dtype_key_variants() -> None:
    m = ModelConfig.from_hf({**{k: v for k, v in LLAMA.items() if k != "torch_dtype"},
                             "eos_token_id": 5, "dtype": "float32"})
    assert m.eos_token_ids == (5,) and m.torch_dtype == "float32"
