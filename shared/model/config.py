"""Model geometry: one frozen `ModelConfig` normalised from any supported HF `config.json`.

HF configs come flat (Llama, Qwen2, Mistral, Qwen3) or with the language model nested under
`text_config` (multimodal checkpoints). Both become the same `ModelConfig`; a field set in both
places with different values is refused, so a checkpoint never loads with the wrong geometry.
Defaults for absent keys follow the HF config class of each architecture.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.model.gemma_config import (
    GEMMA_DEFAULTS,
    GEMMA_TYPES,
    GemmaSpec,
    default_layer_types,
    gemma_from_hf,
)
from shared.model.gpt_oss_config import (
    GPT_OSS_DEFAULTS,
    GPT_OSS_TYPE,
    GptOssSpec,
    gpt_oss_from_hf,
    with_default_rope,
)
from shared.model.gpt_oss_config import default_layer_types as gpt_oss_layer_types
from shared.model.moe import MoeConfig
from shared.model.rope import RopeConfig

# architecture -> HF model_type, and back.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",  # fused qkv_proj/gate_up_proj load as-is; longrope in rope.py
    "Gemma2ForCausalLM": "gemma2",  # shared.model.gemma
    "Gemma3ForCausalLM": "gemma3_text",
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3 attention, routed experts (moe.py)
    "GptOssForCausalLM": "gpt_oss",  # shared.model.gpt_oss
}
_BY_MODEL_TYPE = {v: k for k, v in ARCHITECTURES.items()}

# HF defaults for keys a config.json may omit (from each transformers config class).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
              "sliding_window": None},
    "qwen2": {"max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None,
              "num_key_value_heads": 32, "sliding_window": 4096},
    "mistral": {"max_position_embeddings": 4096 * 32, "bos_token_id": 1, "eos_token_id": 2,
                "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen3": {"max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None,
              "num_key_value_heads": 32, "sliding_window": 4096, "head_dim": 128},
    "phi3": {"max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 32000,
             "rms_norm_eps": 1e-5, "sliding_window": None},
    **GEMMA_DEFAULTS,
    GPT_OSS_TYPE: GPT_OSS_DEFAULTS,
    "qwen3_moe": {"max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None,
                  "num_key_value_heads": 4, "sliding_window": 4096},
}
_COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "hidden_act": "silu", "head_dim": None,
}
_NULL_IS_DEFAULT = frozenset(
    ("rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "attention_bias",
     "mlp_bias", "hidden_act"))
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")
# Every key normalisation reads; these are the ones compared between flat and nested layouts.
_TEXT_KEYS = _REQUIRED + (
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "original_max_position_embeddings", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act", "bos_token_id",
    "eos_token_id", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "partial_rotary_factor", "torch_dtype", "dtype", "hidden_activation",
    "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
    "rope_local_base_freq", "sliding_window_pattern", "use_bidirectional_attention",
    "partial_rotary_factor", "torch_dtype", "dtype", "num_experts", "num_local_experts",
    "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers", "swiglu_alpha", "swiglu_limit",
)


@dataclass(frozen=True)
class ModelConfig:
    """The geometry and constants of one Llama-family decoder, whatever the HF layout.

    `attention_bias` means q/k/v projections carry a bias (Qwen2 always; Llama and Qwen3 when
    their `attention_bias` is set); `attention_out_bias` means o_proj does too (Llama, Qwen3).
    `qk_norm` (Qwen3) RMS-normalises every query and key head over head_dim before RoPE, with
    one learnt weight per projection; its head_dim is its own, not hidden_size / heads.
    `eos_token_ids` is always a tuple (HF allows an int or a list). `torch_dtype` is the
    checkpoint's declared storage dtype, informational only. `layer_windows` holds each
    layer's sliding window W (HF semantics: a query at position p attends to keys at
    positions p - W < k <= p) or None for full causal attention, for every family (Gemma and
    gpt-oss included); empty means every layer is full. `moe` (Qwen3-MoE) is the expert
    layout of the sparse layers (shared.model.moe); None for dense models.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    attention_out_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    layer_windows: tuple[int | None, ...] = ()
    gemma: GemmaSpec | None = None  # Gemma 2 / 3 only: soft-caps, scale, local RoPE
    moe: MoeConfig | None = None
    gpt_oss: GptOssSpec | None = None  # gpt-oss only: experts and their clamped SwiGLU

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r} "
                             f"(supported: {', '.join(ARCHITECTURES)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        self.rope.check_head_dim(self.head_dim)
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for "
                             f"{self.num_layers} layers")
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ValueError(f"sliding windows must be >= 1, got {self.layer_windows}")
        if self.rope.partial_rotary_factor != 1.0 and self.model_type != "phi3":
            # Of the HF classes we mirror only Phi3's attention rotates a head prefix; the
            # others would rotate the whole head with a shorter table (or not at all).
            raise ValueError(f"partial_rotary_factor={self.rope.partial_rotary_factor} is only "
                             f"supported for Phi3, not {self.architecture}")

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture]

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (global index), None for full causal attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def kv_window(self) -> int | None:
        """How many trailing positions any future query can still read, when every layer
        slides: the largest window. None when some layer attends to the whole context (then
        no KV can ever be dropped)."""
        windows = [self.window(i) for i in range(self.num_layers)]
        if any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @staticmethod
    def from_hf(config_dict: Mapping[str, Any]) -> ModelConfig:
        """Normalise a parsed HF `config.json` (flat or `text_config`-nested)."""
        arch, cfg = _text_config(config_dict)
        model_type = ARCHITECTURES[arch]
        missing = [k for k in _REQUIRED if cfg.get(k) is None]
        if missing:
            raise ValueError(f"config is missing required fields: {', '.join(missing)}")
        # An explicit null keeps its HF meaning (no window, no bos, "derive head_dim"...),
        # except for keys where null can only mean "the default".
        cfg = {**_COMMON_DEFAULTS, **_DEFAULTS[model_type],
               **{k: v for k, v in cfg.items() if v is not None or k not in _NULL_IS_DEFAULT}}
        gemma = model_type in GEMMA_TYPES
        if cfg["hidden_act"] != "silu" and not gemma:  # Gemma reads hidden_activation
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        if cfg["mlp_bias"]:
            raise ValueError("mlp_bias=true is not supported")
        heads = int(cfg["num_attention_heads"])
        max_pos = int(cfg["max_position_embeddings"])
        spec, rope, oss = None, None, None
        if gemma:
            spec, rope = gemma_from_hf(model_type, cfg, max_pos)
        elif model_type == GPT_OSS_TYPE:
            cfg = with_default_rope(cfg)
            oss = gpt_oss_from_hf(cfg)
        windows = _layer_windows(model_type, cfg, max_pos)
        own_bias = (model_type in ("llama", "qwen3", "qwen3_moe", GPT_OSS_TYPE, *GEMMA_TYPES)
                    and bool(cfg["attention_bias"]))
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg["head_dim"] or int(cfg["hidden_size"]) // heads),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope=rope or RopeConfig.from_hf(cfg, max_pos),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
            attention_bias=model_type == "qwen2" or own_bias,
            attention_out_bias=own_bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            bos_token_id=None if cfg["bos_token_id"] is None else int(cfg["bos_token_id"]),
            eos_token_ids=_token_ids(cfg["eos_token_id"]),
            torch_dtype=_dtype_name(cfg.get("torch_dtype") or cfg.get("dtype")),
            layer_windows=windows,
            gemma=spec,
            moe=MoeConfig.from_hf(cfg) if model_type == "qwen3_moe" else None,
            gpt_oss=oss,
        )


def _text_config(d: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(architecture, the language model's config dict) from a flat or nested HF config."""
    nested = d.get("text_config")
    if nested is None:
        return _architecture(d.get("architectures"), d.get("model_type")), dict(d)
    if not isinstance(nested, Mapping):
        raise ValueError("text_config must be an object")
    conflicts = sorted(
        k for k in _TEXT_KEYS
        if d.get(k) is not None and nested.get(k) is not None and d[k] != nested[k]
    )
    if conflicts:
        detail = "; ".join(f"{k}: {d[k]!r} (top level) vs {nested[k]!r} (text_config)"
                           for k in conflicts)
        raise ValueError(f"config.json flat and text_config layouts disagree on {detail}")
    merged = {k: d[k] for k in _TEXT_KEYS if d.get(k) is not None}
    merged.update(nested)
    try:
        arch = _architecture(nested.get("architectures"), nested.get("model_type"))
    except ValueError:
        # The top-level architectures name the multimodal wrapper; accept them only if they
        # happen to name a supported text model.
        arch = _architecture(d.get("architectures"), None)
    return arch, merged


def _architecture(architectures: Any, model_type: Any) -> str:
    names = [architectures] if isinstance(architectures, str) else list(architectures or [])
    for name in names:
        if name in ARCHITECTURES:
            return name
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise ValueError(f"unsupported model: architectures={names or None}, model_type={model_type!r} "
                     f"(supported: {', '.join(ARCHITECTURES)})")


def _layer_windows(model_type: str, cfg: Mapping[str, Any], max_pos: int
                   ) -> tuple[int | None, ...]:
    """Each layer's sliding window, as HF transformers applies the config's keys (the one
    place any family's windows come from).

    Mistral, Phi-3 and Qwen3-MoE slide every layer by `sliding_window` (their HF models ignore
    `layer_types`); Qwen2, Qwen3 and Qwen3-MoE honour `sliding_window` only with
    `use_sliding_window`. Qwen2/3, Gemma 2/3 and gpt-oss slide the layers `layer_types` marks
    "sliding_attention", by default (`_layer_types`) the Qwen layers at or past
    `max_window_layers` and the families' own patterns. Llama has no sliding-window attention
    in HF: a window shorter than the context there is refused rather than guessed at. Empty
    when no layer slides.
    """
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window"):
        window = None  # HF: sliding_window = sliding_window if use_sliding_window else None
    types = _layer_types(model_type, cfg, int(cfg["num_hidden_layers"]))
    if "sliding_attention" not in types:
        return ()
    if window is None and model_type in (*GEMMA_TYPES, GPT_OSS_TYPE):
        raise ValueError("sliding_window must be >= 1 for sliding layers, got None")
    if window is None:
        return ()
    if int(window) < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    if model_type == "llama" and int(window) < max_pos:
        raise ValueError(
            f"sliding_window={window} is smaller than the context "
            f"(max_position_embeddings={max_pos}) on a llama config, whose HF model has no "
            "sliding-window attention; refusing to guess")
    if model_type == "llama":
        return ()
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _layer_types(model_type: str, cfg: Mapping[str, Any], layers: int) -> list[str]:
    """Each layer's attention type, "sliding_attention" or "full_attention", as the family's
    HF model reads it: `layer_types` if given (checked), else the family's default."""
    types = list(cfg.get("layer_types") or [])
    if types and len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported "
                         "(only full_attention and sliding_attention)")
    if model_type in ("mistral", "phi3", "qwen3_moe"):
        return ["sliding_attention"] * layers
    if types:
        return types
    if model_type in ("qwen2", "qwen3"):
        start = int(cfg.get("max_window_layers", 28))
        return ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    if model_type in GEMMA_TYPES:
        return default_layer_types(model_type, layers, cfg)
    if model_type == GPT_OSS_TYPE:
        return gpt_oss_layer_types(layers)
    return types


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    return str(value).removeprefix("torch.")
