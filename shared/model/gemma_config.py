"""Gemma 2 and Gemma 3 (text) configuration: what a Gemma checkpoint adds to the Llama geometry.

`gemma_from_hf` normalises the Gemma-only keys of an HF config.json (HF transformers'
Gemma2Config / Gemma3TextConfig defaults and semantics) into a frozen `GemmaSpec`, which
`ModelConfig.gemma` carries; the layers that use it live in `shared.model.gemma`. The sliding
windows are not here: `ModelConfig.layer_windows` holds every family's, from `layer_types`
(defaulting to `default_layer_types`) and `sliding_window`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.model.rope import RopeConfig

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA_TYPES = ("gemma2", "gemma3_text")
# HF config-class defaults (Gemma2Config, Gemma3TextConfig) for keys a config.json may omit.
GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"max_position_embeddings": 8192, "bos_token_id": 2, "eos_token_id": 1,
               "head_dim": 256, "tie_word_embeddings": True, "sliding_window": 4096,
               "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"max_position_embeddings": 131072, "bos_token_id": 2, "eos_token_id": 1,
                    "head_dim": 256, "tie_word_embeddings": True, "sliding_window": 4096,
                    "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
                    "attn_logit_softcapping": None, "final_logit_softcapping": None},
}
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma 3's default RoPE bases


@dataclass(frozen=True)
class GemmaSpec:
    """What a Gemma checkpoint adds to the Llama geometry: attention scale and soft-caps, and
    the sliding layers' own RoPE (which layers slide, and how far, is
    ModelConfig.layer_windows). Every field changes the KV bytes or the logits a prompt
    produces, so all of it joins the compat hash (`as_factors`)."""

    version: int  # 2 or 3
    query_pre_attn_scalar: float
    attn_softcap: float | None
    final_softcap: float | None
    local_rope: RopeConfig  # RoPE of the sliding layers (Gemma 2: the same as the full ones)

    def as_factors(self) -> dict[str, Any]:
        """Flat, hashable form for the compat hash (prefixed `gemma.`); the windows are the
        `attention_windows` factor."""
        return {"gemma.version": self.version,
                "gemma.query_pre_attn_scalar": self.query_pre_attn_scalar,
                "gemma.attn_softcap": self.attn_softcap,
                "gemma.final_softcap": self.final_softcap,
                **{f"gemma.local_rope.{k}": (repr(v) if isinstance(v, tuple) else v)
                   for k, v in self.local_rope.as_dict().items()}}


def gemma_from_hf(model_type: str, cfg: Mapping[str, Any], max_pos: int
                  ) -> tuple[GemmaSpec, RopeConfig]:
    """(GemmaSpec, RoPE of the full-attention layers) from a normalised Gemma config dict.

    Refuses, naming the key, what the decoder cannot run: another activation or a
    bidirectional variant (ModelConfig's `_layer_windows` checks `layer_types`).
    """
    if cfg.get("hidden_activation") != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {cfg.get('hidden_activation')!r} is not supported "
                         "for Gemma (only gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true is not supported (causal LM only)")
    version = 2 if model_type == "gemma2" else 3
    full, local = _ropes(version, cfg, max_pos)
    spec = GemmaSpec(version=version,
                     query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
                     attn_softcap=_opt_float(cfg.get("attn_logit_softcapping")),
                     final_softcap=_opt_float(cfg.get("final_logit_softcapping")),
                     local_rope=local)
    return spec, full


def default_layer_types(model_type: str, num_layers: int, cfg: Mapping[str, Any]) -> list[str]:
    """HF's defaults when a config gives no `layer_types`: Gemma 2 slides on even layers;
    Gemma 3 on all but every `sliding_window_pattern`-th (6)."""
    if model_type == "gemma2":
        return [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    pattern = int(cfg.get("sliding_window_pattern") or 6)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]


def _ropes(version: int, cfg: Mapping[str, Any], max_pos: int) -> tuple[RopeConfig, RopeConfig]:
    """(full-attention RoPE, sliding RoPE). Gemma 3 keeps one `rope_parameters` block per layer
    type (transformers 5) or a top-level rope_theta / rope_scaling for the full layers plus
    `rope_local_base_freq` for the sliding ones (older configs)."""
    if version == 2:
        rope = RopeConfig.from_hf(cfg, max_pos)
        return rope, rope
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and (FULL in params or SLIDING in params):
        full = dict(params.get(FULL) or {})
        local = dict(params.get(SLIDING) or {})
        full.setdefault("rope_theta", cfg.get("rope_theta", _GLOBAL_THETA))
        local.setdefault("rope_theta", cfg.get("rope_local_base_freq", _LOCAL_THETA))
        return (RopeConfig.from_hf({"rope_parameters": full}, max_pos),
                RopeConfig.from_hf({"rope_parameters": local}, max_pos))
    flat = {k: cfg.get(k) for k in ("rope_scaling", "rope_parameters")}
    flat["rope_theta"] = cfg.get("rope_theta", _GLOBAL_THETA)
    local_theta = float(cfg.get("rope_local_base_freq") or _LOCAL_THETA)
    return RopeConfig.from_hf(flat, max_pos), RopeConfig(theta=local_theta)


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)
