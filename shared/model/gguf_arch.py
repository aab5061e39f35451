"""What pdmesh knows about each GGUF architecture: metadata keys -> HF config.json, tensor names.

llama.cpp's converter (convert_hf_to_gguf.py) writes a model's hyper-parameters under
`<arch>.*` keys and renames its tensors (`blk.N.attn_q.weight`...). This module maps both back
to what HF transformers would have written, for the architectures the engine runs: `llama`
(also what the converter calls Mistral and SmolLM), `qwen2`, `qwen3`, `phi3` (Phi-3, Phi-3.5
and Phi-4-mini), `gemma2` and `gemma3` (text). Everything here reads the GGUF header only (metadata and tensor infos), except
Phi-3's two small `rope_factors_*` tensors, which hold longrope's per-frequency factors and so
belong in config.json, not among the weights.

Q/K row order: the converter permutes the Q and K projections of its Llama family
(`LlamaModel.permute`, for GPT-J style pairwise RoPE in llama.cpp) and of nothing else; Qwen2 and
Qwen3 and Phi-3 are written in HF order (llama.cpp runs them with NEOX RoPE). `PERMUTED_QK` lists the
architectures whose Q/K weights (and biases) are un-permuted on import.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor

    from shared.model.gguf_tokenizer import GgufVocab

WEIGHTS_DTYPE = "float32"
HF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# GGUF architecture -> HF model_type where the names differ.
HF_MODEL_TYPES = {"gemma3": "gemma3_text"}
GEMMA_ARCHS = frozenset({"gemma2", "gemma3"})
PERMUTED_QK = frozenset({"llama"})
# GGMLQuantizationType names dequantised on import (with gguf.quants.dequantize), each tested.
# (Names, so that importing this module, and the registry, does not import gguf.)
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K",
                          "Q5_K", "Q6_K")
# HF defaults where a GGUF omits a key (llama.cpp's converter writes them all in practice).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"context_length": 2048, "rms_eps": 1e-5},
    "qwen2": {"context_length": 32768, "rms_eps": 1e-6},
    "qwen3": {"context_length": 32768, "rms_eps": 1e-6},
    "phi3": {"context_length": 4096, "rms_eps": 1e-5},
    "gemma2": {"context_length": 8192, "rms_eps": 1e-6},
    "gemma3": {"context_length": 131072, "rms_eps": 1e-6},
}

_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: [q; k; v] in one matrix
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Phi-3's `ffn_up` holds [gate; up] (HF gate_up_proj); llama.cpp splits it at run time.
# Gemma's sandwich norms: llama.cpp's `ffn_norm` is the pre-feed-forward norm there.
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_BLOCK_NAMES: dict[str, dict[str, str]] = {"phi3": {"ffn_up": "mlp.gate_up_proj"},
                                                "gemma2": _GEMMA_NORMS, "gemma3": _GEMMA_NORMS}
# longrope factors (phi3): config.json rope_scaling keys, not weights.
ROPE_FACTOR_TENSORS = {"rope_factors_long.weight": "long_factor",
                       "rope_factors_short.weight": "short_factor"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_TENSOR_RE = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)$")


class UnsupportedGgufError(ValueError):
    """A GGUF file pdmesh refuses: its architecture, a tensor, a type or a tokenizer."""


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """GGUF tensor name -> HF parameter name; raises for tensors we do not understand."""
    m = _TENSOR_RE.match(gguf_name)
    if m is not None:
        layer, base, kind = m.groups()
        if layer is None and base in _TOP_NAMES:
            return f"{_TOP_NAMES[base]}.{kind}"
        block_names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
        if layer is not None and base in block_names:
            return f"model.layers.{layer}.{block_names[base]}.{kind}"
    hint = " (llama3 rope scaling)" if gguf_name == "rope_freqs.weight" else ""
    raise UnsupportedGgufError(f"unsupported GGUF tensor {gguf_name!r}{hint}")


def field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python value, or `default` when the key is absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_architecture(reader: GGUFReader) -> str:
    """`general.architecture`, refused unless the engine runs it."""
    arch = field(reader, "general.architecture")
    if arch not in HF_ARCHITECTURES:
        raise UnsupportedGgufError(
            f"GGUF architecture {arch!r} is not supported by the engine "
            f"(supported GGUF architectures: {', '.join(HF_ARCHITECTURES)})")
    return str(arch)


def check_single_file(reader: GGUFReader) -> None:
    """Refuse one part of a split GGUF (llama-gguf-split): its tensors are spread over files."""
    count = int(field(reader, "split.count", 1))
    if count > 1:
        raise UnsupportedGgufError(
            f"this GGUF is one of {count} split parts; merge them into one file first "
            "(llama-gguf-split --merge FIRST_PART OUT.gguf)")


def check_tensor_types(reader: GGUFReader) -> None:
    """Refuse the first tensor whose type we do not dequantise, naming tensor and type."""
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            names = ", ".join(SUPPORTED_TENSOR_TYPES)
            raise UnsupportedGgufError(
                f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which pdmesh cannot "
                f"load (supported: {names})")


def _hyper(reader: GGUFReader, arch: str) -> dict[str, Any]:
    """The `<arch>.*` hyper-parameters the engine needs, refusing what it cannot run."""
    def get(key: str, default: Any = None) -> Any:
        value = field(reader, f"{arch}.{key}", default)
        if value is None:
            raise UnsupportedGgufError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedGgufError("GGUF attention.value_length != key_length is not supported")
    rope_dims = int(get("rope.dimension_count", head_dim))
    if rope_dims != head_dim and arch != "phi3":
        raise UnsupportedGgufError(f"partial rotary embeddings are not supported for {arch}")
    scaling = get("rope.scaling.type", "none")
    if scaling != "none" and not (arch == "gemma3" and scaling == "linear"):
        raise UnsupportedGgufError(f"GGUF rope scaling {scaling!r} is not supported for {arch}")
    defaults = _DEFAULTS[arch]
    return {
        "hidden": hidden, "heads": heads, "head_dim": head_dim,
        "ffn": int(get("feed_forward_length")), "layers": int(get("block_count")),
        "kv_heads": int(get("attention.head_count_kv", heads)),
        "rms_eps": float(get("attention.layer_norm_rms_epsilon", defaults["rms_eps"])),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "context": int(get("context_length", defaults["context_length"])),
        "rope_dims": rope_dims,
    }


def build_config(reader: GGUFReader, vocab: GgufVocab) -> dict[str, Any]:
    """config.json (as HF transformers writes it) from the GGUF's `<arch>.*` hyper-parameters.

    vocab_size is the embedding's row count (it may exceed the tokenizer's); embeddings are tied
    when the file has no separate `output.weight`; llama and qwen3 carry attention biases (q, k,
    v and o) when the file has `blk.0.attn_q.bias` (qwen2 always has q/k/v biases).
    """
    arch = gguf_architecture(reader)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise UnsupportedGgufError("GGUF has no token_embd.weight")
    h = _hyper(reader, arch)
    config: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[arch]],
        "model_type": HF_MODEL_TYPES.get(arch, arch),
        "hidden_size": h["hidden"],
        "intermediate_size": h["ffn"],
        "num_hidden_layers": h["layers"],
        "num_attention_heads": h["heads"],
        "num_key_value_heads": h["kv_heads"],
        "head_dim": h["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": h["rms_eps"],
        "rope_theta": h["rope_theta"],
        "rope_scaling": None,
        "max_position_embeddings": h["context"],
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),  # GGUF shapes are (cols, rows)
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "llama":
        config["mlp_bias"] = False
    elif arch == "phi3":
        config.update(_phi3_config(reader, h, tensors))
    elif arch in GEMMA_ARCHS:
        del config["hidden_act"]
        config.update(_gemma_config(reader, arch, h))
    else:
        config.update(sliding_window=None, use_sliding_window=False)
    config.update({
        "bos_token_id": vocab.bos_token_id,
        "eos_token_id": vocab.eos_token_id,
        "pad_token_id": vocab.pad_token_id,
        "torch_dtype": WEIGHTS_DTYPE,
        "use_cache": True,
    })
    return config


def _phi3_config(reader: GGUFReader, h: dict[str, Any],
                 tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    """Phi-3's extra config.json keys: window, partial rotary, longrope.

    convert_hf_to_gguf.py writes `rope.dimension_count` = int(partial_rotary_factor * hidden) //
    heads, a sliding window of 0 for "none" (Phi-4-mini), and for long-context models the long
    and short factors as F32 tensors plus the original context and the attention factor. HF
    derives that factor from the two context lengths; it is written out only where it differs.
    """
    out: dict[str, Any] = {"rope_scaling": None}
    window = int(field(reader, "phi3.attention.sliding_window", 0) or 0)
    out["sliding_window"] = window or None
    if h["rope_dims"] != h["head_dim"]:
        out["partial_rotary_factor"] = h["rope_dims"] / h["head_dim"]
    orig = field(reader, "phi3.rope.scaling.original_context_length")
    if orig is not None:
        out["original_max_position_embeddings"] = int(orig)
    factors = {key: [float(v) for v in np.asarray(tensors[name].data, dtype=np.float32)]
               for name, key in ROPE_FACTOR_TENSORS.items() if name in tensors}
    if not factors:
        return out
    if len(factors) != 2 or orig is None:
        raise UnsupportedGgufError("GGUF longrope needs rope_factors_long, rope_factors_short "
                                   "and phi3.rope.scaling.original_context_length")
    if any(len(f) * 2 != h["rope_dims"] for f in factors.values()):
        raise UnsupportedGgufError(f"GGUF rope factors must have {h['rope_dims'] // 2} entries")
    scaling: dict[str, Any] = {"type": "longrope", **factors}
    scale = h["context"] / int(orig)
    derived = math.sqrt(1 + math.log(scale) / math.log(int(orig))) if scale > 1 else 1.0
    attn = field(reader, "phi3.rope.scaling.attn_factor")
    if attn is not None and abs(float(attn) - derived) > 1e-6:
        scaling["attention_factor"] = float(attn)
    out["rope_scaling"] = scaling
    return out


def _gemma_config(reader: GGUFReader, arch: str, h: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3 keys, as llama.cpp reads them back (llama-model.cpp).

    The converter stores the window and the soft-caps; llama.cpp hard-codes the rest, and so
    does this: sliding layers every other layer (Gemma 2) or five in six (Gemma 3), the sliding
    layers' RoPE base 10,000 (Gemma 3), and the query scale: 1/sqrt(hidden / heads) for the 27B
    models (46 layers for Gemma 2, 62 for Gemma 3), else 1/sqrt(head_dim).
    """
    window = field(reader, f"{arch}.attention.sliding_window")
    pattern = 2 if arch == "gemma2" else 6
    big = h["layers"] == (46 if arch == "gemma2" else 62)
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
        "query_pre_attn_scalar": h["hidden"] // h["heads"] if big else h["head_dim"],
        "sliding_window": None if window is None else int(window),
        "layer_types": ["sliding_attention" if window is not None and i % pattern < pattern - 1
                        else "full_attention" for i in range(h["layers"])],
        "attn_logit_softcapping": _opt(field(reader, f"{arch}.attn_logit_softcapping")),
        "final_logit_softcapping": _opt(field(reader, f"{arch}.final_logit_softcapping")),
    }
    if arch == "gemma3":
        out["rope_local_base_freq"] = 10000.0
        if field(reader, "gemma3.rope.scaling.type", "none") == "linear":
            out["rope_scaling"] = {"rope_type": "linear",
                                   "factor": float(field(reader, "gemma3.rope.scaling.factor"))}
    return out


def _opt(value: Any) -> float | None:
    return None if value is None else float(value)


def expected_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a checkpoint with config.json `c` stores."""
    h, kv = c["hidden_size"], c["num_key_value_heads"] * c["head_dim"]
    q, ffn = c["num_attention_heads"] * c["head_dim"], c["intermediate_size"]
    qkv_bias = c["model_type"] == "qwen2" or c.get("attention_bias", False)
    gemma = c["model_type"] in ("gemma2", "gemma3_text")
    norms = ["input_layernorm", "post_attention_layernorm"]
    if gemma:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.o_proj.weight": (h, q), p + "mlp.down_proj.weight": (h, ffn)})
        out.update({p + f"{norm}.weight": (h,) for norm in norms})
        if c["model_type"] == "phi3":
            out.update({p + "self_attn.qkv_proj.weight": (q + 2 * kv, h),
                        p + "mlp.gate_up_proj.weight": (2 * ffn, h)})
        else:
            out.update({
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "mlp.gate_proj.weight": (ffn, h),
                p + "mlp.up_proj.weight": (ffn, h),
            })
        if qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
        if c.get("attention_bias", False):
            out[p + "self_attn.o_proj.bias"] = (h,)
        if c["model_type"] in ("qwen3", "gemma3_text"):
            out.update({p + "self_attn.q_norm.weight": (c["head_dim"],),
                        p + "self_attn.k_norm.weight": (c["head_dim"],)})
    return out


def check_shapes(reader: GGUFReader, config: dict[str, Any]) -> None:
    """Refuse a file whose tensors (names and shapes, from the header) do not form the model
    config.json describes: a missing, extra or misshapen tensor is named."""
    arch = gguf_architecture(reader)
    got = {hf_tensor_name(t.name, arch): tuple(int(d) for d in reversed(t.shape.tolist()))
           for t in reader.tensors if t.name not in ROPE_FACTOR_TENSORS}
    expected = expected_shapes(config)
    if got != expected:
        bad = sorted(set(got.items()) ^ set(expected.items()))[:6]
        raise UnsupportedGgufError(
            f"GGUF tensors do not form a {config['model_type']} checkpoint; mismatches "
            f"(name, shape): {bad}")
