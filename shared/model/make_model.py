"""Random-weight HF checkpoints for fast tests: `pdmesh make-model`.

The checkpoint is a real HF directory (config.json with `architectures`, safetensors,
generation_config.json, SmolLM2's tokenizer files) that both this project and HF transformers
load. Weights are drawn so activations stay O(1) through the layers (unit-variance
embeddings, 1/sqrt(fan_in) projections, norm weights near 1): HF's own 0.02 init would leave
attention almost uniform and make RoPE or masking bugs invisible in logit comparisons.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from shared.model.config import ARCHITECTURES

VOCAB_SIZE = 49152  # SmolLM2's tokenizer
GEMMA_WINDOW = 8  # gemma2 / gemma3_text: layer 0 slides by this, layer 1 attends fully
BOS_TOKEN_ID, EOS_TOKEN_ID = 1, 2  # <|im_start|>, <|im_end|> in SmolLM2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128},
    "small": {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 256},
    # Benchmarks (benchmarks/engine.py --moe): big enough that weights, not overheads, dominate.
    "medium": {"num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 8,
               "num_key_value_heads": 4, "intermediate_size": 1536},
}
_ARCH_BY_NAME = {model_type: arch for arch, model_type in ARCHITECTURES.items()}


@dataclass(frozen=True)
class ModelSpec:
    """What to generate. None fields take the preset's value (or the architecture's default).

    rope_type is default | linear | dynamic | llama3; rope_keys picks the config generation:
    `legacy` (rope_theta + rope_scaling) or `v5` (rope_parameters). num_shards > 1 writes
    sharded safetensors plus model.safetensors.index.json. vocab_size is the number of
    embedding / LM-head rows (None: the tokenizer's 49152); more rows than tokens is the
    padded-vocab layout (Qwen2.5: 151,936 rows for 151,665 tokens). padding_head_scale
    multiplies the untied LM head's rows past the tokenizer, so that a greedy model emits
    ids the tokenizer cannot spell (tests of that case). sliding_window gives mistral, phi3
    and qwen3_moe a window on every layer, and qwen2 / qwen3 one on the layers at or past
    max_window_layers (use_sliding_window set); llama has none. Gemma always slides layer 0
    (and every other layer), by sliding_window or GEMMA_WINDOW.
    """

    arch: str = "llama"
    preset: str = "tiny"
    seed: int = 0
    num_kv_heads: int | None = None
    head_dim: int | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # llama and qwen3; qwen2 always has q/k/v bias
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 4.0
    original_max_position_embeddings: int = 16  # llama3 only
    max_position_embeddings: int = 2048
    rope_keys: str = "legacy"
    num_shards: int = 1
    dtype: str = "float32"
    vocab_size: int | None = None
    padding_head_scale: float = 1.0
    sliding_window: int | None = None  # None: no window (gemma: GEMMA_WINDOW)
    max_window_layers: int = 0
    rope_local_theta: float = 1000.0  # gemma3_text's sliding layers (rope_local_base_freq)
    partial_rotary_factor: float = 1.0  # phi3 only (Phi-4-mini: 0.75)
    # qwen3_moe only: the expert layout (shared.model.moe.MoeConfig), HF key names.
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in _ARCH_BY_NAME:
            raise ValueError(f"arch must be one of {', '.join(_ARCH_BY_NAME)}, got {self.arch!r}")
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        if self.rope_type not in ("default", "linear", "dynamic", "llama3"):
            raise ValueError(f"unsupported rope_type {self.rope_type!r}")
        if self.rope_keys not in ("legacy", "v5"):
            raise ValueError(f"rope_keys must be legacy or v5, got {self.rope_keys!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.partial_rotary_factor != 1.0 and self.arch != "phi3":
            raise ValueError("partial_rotary_factor is a phi3 setting")
        if self.num_shards < 1:
            raise ValueError("num_shards must be >= 1")
        if self.sliding_window is not None and (self.arch == "llama" or self.sliding_window < 1):
            raise ValueError("sliding_window must be >= 1, and llama has no sliding window")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if self.padding_head_scale != 1.0 and (self.tie_word_embeddings
                                               or self.rows <= VOCAB_SIZE):
            raise ValueError("padding_head_scale needs an untied LM head with vocab_size > "
                             f"{VOCAB_SIZE} (rows past the tokenizer)")

    @property
    def rows(self) -> int:
        """Embedding / LM-head rows."""
        return self.vocab_size or VOCAB_SIZE


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """The config.json dict HF transformers would write for this spec."""
    geometry = dict(PRESETS[spec.preset])
    if spec.num_kv_heads is not None:
        geometry["num_key_value_heads"] = spec.num_kv_heads
    cfg: dict[str, Any] = {
        "architectures": [_ARCH_BY_NAME[spec.arch]],
        "model_type": spec.arch,
        "vocab_size": spec.rows,
        **geometry,
        "head_dim": spec.head_dim or geometry["hidden_size"] // geometry["num_attention_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": spec.dtype,
    }
    if spec.arch == "llama":
        cfg.update(attention_bias=spec.attention_bias, mlp_bias=False)
    if spec.arch in ("qwen3", "qwen3_moe"):
        cfg.update(attention_bias=spec.attention_bias)
    if spec.arch == "qwen3_moe":
        cfg.update(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                   moe_intermediate_size=spec.moe_intermediate_size,
                   norm_topk_prob=spec.norm_topk_prob,
                   decoder_sparse_step=spec.decoder_sparse_step,
                   mlp_only_layers=list(spec.mlp_only_layers))
    if spec.partial_rotary_factor != 1.0:
        cfg["partial_rotary_factor"] = spec.partial_rotary_factor
    if spec.arch in ("qwen2", "mistral", "qwen3", "qwen3_moe"):
        cfg.update(sliding_window=spec.sliding_window,
                   use_sliding_window=spec.sliding_window is not None)
    if spec.arch in ("qwen2", "qwen3"):
        cfg.update(max_window_layers=spec.max_window_layers)
    if spec.arch == "phi3":
        cfg.update(sliding_window=spec.sliding_window)
    if spec.arch in ("gemma2", "gemma3_text"):
        _gemma_keys(spec, cfg)
    scaling = _rope_scaling(spec)
    if spec.rope_keys == "legacy":
        cfg["rope_theta"] = spec.rope_theta
        cfg["rope_scaling"] = scaling
    else:
        cfg["rope_parameters"] = {"rope_theta": spec.rope_theta, "rope_type": "default",
                                  **(scaling or {})}
    if spec.arch == "gemma3_text" and spec.rope_keys == "v5":  # one block per layer type
        cfg["rope_parameters"] = {
            "full_attention": cfg["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": spec.rope_local_theta}}
    return cfg


def _gemma_keys(spec: ModelSpec, cfg: dict[str, Any]) -> None:
    """Gemma's own keys. Soft-caps (Gemma 2) small enough that tanh bends random scores; a
    query scale that is not head_dim ** -0.5; every layer kind present in two layers."""
    del cfg["hidden_act"]
    layers = cfg["num_hidden_layers"]
    cfg.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=cfg["head_dim"] // 2,
               sliding_window=spec.sliding_window or GEMMA_WINDOW, attention_bias=False,
               layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(layers)])
    if spec.arch == "gemma2":
        cfg.update(attn_logit_softcapping=10.0, final_logit_softcapping=15.0)
    elif spec.rope_keys == "legacy":
        cfg["rope_local_base_freq"] = spec.rope_local_theta


def _rope_scaling(spec: ModelSpec) -> dict[str, Any] | None:
    if spec.rope_type == "default":
        return None
    out: dict[str, Any] = {"rope_type": spec.rope_type, "factor": spec.rope_factor}
    if spec.rope_type == "llama3":
        out.update(low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=spec.original_max_position_embeddings)
    return out


def random_weights(spec: ModelSpec, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """HF-named random tensors for `cfg`, deterministic in `spec.seed`."""
    gen = torch.Generator().manual_seed(spec.seed)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def proj(out_f: int, in_f: int) -> torch.Tensor:
        return normal(out_f, in_f, std=in_f ** -0.5)

    rows = spec.rows
    gemma = spec.arch in ("gemma2", "gemma3_text")
    # Gemma scales embeddings by sqrt(hidden) and its norms by (1 + w): keep both O(1).
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(rows, hidden, std=hidden ** -0.5 if gemma else 1.0)}
    norm_one = 0.0 if gemma else 1.0
    own_bias = spec.arch in ("llama", "qwen3", "qwen3_moe") and spec.attention_bias
    qkv_bias = spec.arch == "qwen2" or own_bias
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        if gemma:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for norm in norms:
            w[p + f"{norm}.weight"] = norm_one + normal(hidden, std=0.1)
        for name, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            w[p + f"self_attn.{name}.weight"] = proj(size, hidden)
            if qkv_bias:
                w[p + f"self_attn.{name}.bias"] = normal(size, std=0.5)
        if spec.arch in ("qwen3", "qwen3_moe", "gemma3_text"):
            for name in ("q_norm", "k_norm"):
                w[p + f"self_attn.{name}.weight"] = norm_one + normal(cfg["head_dim"], std=0.1)
        w[p + "self_attn.o_proj.weight"] = proj(hidden, q)
        if own_bias:
            w[p + "self_attn.o_proj.bias"] = normal(hidden, std=0.1)
        sparse = spec.arch == "qwen3_moe" and _is_sparse(spec, i)
        mlps = ([(f"mlp.experts.{e}.", spec.moe_intermediate_size)
                 for e in range(spec.num_experts)] if sparse else [("mlp.", inter)])
        for prefix, width in mlps:
            w[p + prefix + "gate_proj.weight"] = proj(width, hidden)
            w[p + prefix + "up_proj.weight"] = proj(width, hidden)
            w[p + prefix + "down_proj.weight"] = proj(hidden, width)
        if sparse:  # router logits of std ~2: routing varies from token to token
            w[p + "mlp.gate.weight"] = normal(spec.num_experts, hidden, std=2 * hidden ** -0.5)
    w["model.norm.weight"] = norm_one + normal(hidden, std=0.1)
    if spec.arch == "phi3":
        _fuse_phi3(w, cfg["num_hidden_layers"])
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = proj(rows, hidden)
        w["lm_head.weight"][VOCAB_SIZE:] *= spec.padding_head_scale
    dtype = torch.float32 if spec.dtype == "float32" else torch.bfloat16
    return {k: v.to(dtype).contiguous() for k, v in w.items()}


def _is_sparse(spec: ModelSpec, layer: int) -> bool:
    """HF Qwen3MoeDecoderLayer's rule (shared.model.moe.MoeConfig.is_sparse)."""
    return layer not in spec.mlp_only_layers and (layer + 1) % spec.decoder_sparse_step == 0


def _fuse_phi3(w: dict[str, torch.Tensor], layers: int) -> None:
    """Phi-3 stores [q; k; v] as qkv_proj and [gate; up] as gate_up_proj (in place)."""
    for i in range(layers):
        p = f"model.layers.{i}."
        for fused, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))):
            w[p + fused + ".weight"] = torch.cat([w.pop(p + part + ".weight") for part in parts])


def write_checkpoint(out_dir: Path, spec: ModelSpec, tokenizer_dir: Path | None) -> Path:
    """Write the checkpoint into `out_dir` (created); tokenizer files copied from tokenizer_dir.

    tokenizer_dir None writes weights and configs only (enough for model-level tests).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(spec)
    weights = random_weights(spec, cfg)
    _write_json(out_dir / "config.json", cfg)
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID})
    _write_weights(out_dir, weights, spec.num_shards)
    if tokenizer_dir is not None:
        copy_tokenizer(Path(tokenizer_dir), out_dir)
    return out_dir


def copy_tokenizer(src: Path, out_dir: Path) -> None:
    """Copy SmolLM2's tokenizer files; tokenizer.json is required, the rest when present."""
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {src}")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out_dir / name)


def _write_weights(out_dir: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    meta = {"format": "pt"}
    if num_shards == 1:
        save_file(weights, str(out_dir / "model.safetensors"), metadata=meta)
        return
    names = list(weights)
    weight_map: dict[str, str] = {}
    for s in range(num_shards):
        shard = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::num_shards]}
        save_file(part, str(out_dir / shard), metadata=meta)
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(out_dir / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
