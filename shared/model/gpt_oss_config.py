"""gpt-oss configuration: what an OpenAI gpt-oss checkpoint adds to the Llama geometry.

HF transformers' GptOssConfig semantics and defaults: every layer is a mixture of experts
(`num_local_experts`, `num_experts_per_tok`, experts `intermediate_size` wide, with biases and a
clamped SwiGLU: `swiglu_alpha`, `swiglu_limit`), a biased router whose top-k logits are
softmaxed, attention with q/k/v/o biases and one learnt sink logit per head, layers alternating
between a 128-token sliding window and full attention (`layer_types`), and YaRN RoPE (theta
150,000, factor 32 over 4,096 original positions) when the config gives none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GPT_OSS_TYPE = "gpt_oss"
SLIDING, FULL = "sliding_attention", "full_attention"
# HF GptOssConfig defaults for keys a config.json may omit.
GPT_OSS_DEFAULTS: dict[str, Any] = {
    "max_position_embeddings": 131072, "bos_token_id": None, "eos_token_id": None,
    "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5, "sliding_window": 128,
    "tie_word_embeddings": False, "attention_bias": True, "rope_theta": 150000.0,
}
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


@dataclass(frozen=True)
class GptOssSpec:
    """gpt-oss's experts (count, top-k, width, the clamped SwiGLU's gain and limit). Its
    attention layout (the window and which layers slide) is ModelConfig.layer_windows, from
    `layer_types` (defaulting to `default_layer_types`) and `sliding_window`."""

    num_experts: int
    top_k: int
    intermediate_size: int
    swiglu_alpha: float
    swiglu_limit: float

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, "
                             f"got {self.top_k}")

    def as_factors(self) -> dict[str, Any]:
        """What config.json alone sets that changes the KV bytes, for the compat hash (the
        expert shapes are the weights'; the windows are the `attention_windows` factor)."""
        return {"gpt_oss.swiglu": f"{self.swiglu_alpha}/{self.swiglu_limit}"}


def default_layer_types(num_layers: int) -> list[str]:
    """HF GptOssConfig's default when a config gives no `layer_types`: layers alternate,
    sliding first."""
    return [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]


def gpt_oss_from_hf(cfg: Mapping[str, Any]) -> GptOssSpec:
    """The spec of a normalised gpt-oss config dict; refuses, naming the key, what the decoder
    cannot run."""
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if experts is None:
        raise ValueError("gpt-oss config is missing num_local_experts")
    return GptOssSpec(num_experts=int(experts), top_k=int(cfg.get("num_experts_per_tok", 4)),
                      intermediate_size=int(cfg["intermediate_size"]),
                      swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                      swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))


def with_default_rope(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """HF GptOssConfig: no rope_parameters / rope_scaling means its YaRN defaults."""
    out = dict(cfg)
    if out.get("rope_parameters") is None and out.get("rope_scaling") is None:
        out["rope_scaling"] = dict(DEFAULT_ROPE)
    return out
