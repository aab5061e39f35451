"""Tiny models written twice, as an HF safetensors checkpoint and as a GGUF file, same weights.

The HF side is what a user would download: config.json (shared.model.make_model), random
weights, and a small byte-level BPE tokenizer trained here with `tokenizers` (Qwen2's or
Llama 3's pre-tokenizer, their kind of special tokens and chat template) saved through
transformers. The GGUF side is what llama.cpp's convert_hf_to_gguf.py would write from it, done
independently of pdmesh's importer with `gguf.GGUFWriter`: `<arch>.*` hyper-parameters, llama.cpp
tensor names, Q/K rows permuted (`LlamaModel.permute`) for llama only, tokenizer metadata
(tokens, token types, merges, pre, special ids, chat template).

Quantised types: each weight matrix is quantised (row blocks, so row permutation commutes with
it) and the HF side gets `gguf.quants.dequantize` of the same blocks, so both sides hold
identical float32 weights. gguf-py (0.19) implements `quantize` for F16, BF16, Q8_0, Q4_0,
Q4_1, Q5_0 and Q5_1, but not for the K-quants (Q4_K, Q5_K, Q6_K raise NotImplementedError), so
for those `k_quant_blocks` writes valid blocks directly: random quant bytes and sub-block scales,
with finite fp16 super-block scales sized for weights of about the wanted standard deviation.
1-D tensors (norms, biases) stay F32, as llama.cpp keeps them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre
from tokenizers.trainers import BpeTrainer
from transformers import PreTrainedTokenizerFast

from shared.model.make_model import ModelSpec, hf_config, random_weights

Q = GGMLQuantizationType
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_CHAT = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
               "'<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
               "<|end_header_id|>\n\n' }}{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs.",
    "def add(a, b):\n    return a + b\n\nprint(add(12, 345))\n",
    "In 2024 there were 1,234,567 visitors; prices rose 3.5% to $99.99.",
    "Hello, world! How are you today? I'm fine, thanks. We'll see what they've done.",
    "Café, naïve, Straße, 日本語, русский текст, emoji 🤗 and tabs\tand  double  spaces.",
] * 4


@dataclass(frozen=True)
class Case:
    """One architecture's test model: tokenizer style, geometry, embeddings tied or not."""

    arch: str
    pre: str  # tokenizer.ggml.pre
    head_dim: int
    tied: bool


# Every quantised row (hidden 256, q_size, intermediate 512) is a multiple of 256 (K-quants).
# qwen3 has head_dim 128 != hidden / heads (64): only attention.key_length can tell.
CASES = {
    "llama": Case("llama", "llama-bpe", 64, tied=True),
    "qwen2": Case("qwen2", "qwen2", 64, tied=True),
    "qwen3": Case("qwen3", "qwen2", 128, tied=False),
    "phi3": Case("phi3", "qwen2", 64, tied=False),  # fused qkv / gate_up, longrope, 3/4 rotary
    # Sandwich norms stored as (1 + w), soft-caps, windows, Gemma 3's QK-norm and local RoPE.
    "gemma2": Case("gemma2", "qwen2", 64, tied=True),
    "gemma3": Case("gemma3", "llama-bpe", 128, tied=True),
}
HF_TYPE = {"gemma3": "gemma3_text"}  # GGUF architecture -> make_model / HF model_type
PHI3_ORIG_CONTEXT = 128  # < max_position_embeddings: longrope's two factor sets both matter
GEOMETRY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}


def train_tokenizer(style: str) -> PreTrainedTokenizerFast:
    """A ~400-token byte-level BPE with Qwen2's ("qwen2") or Llama 3's ("llama-bpe") pipeline."""
    if style == "qwen2":
        specials, extra, bos, eos = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], \
            ["<think>", "</think>"], None, "<|im_end|>"
    else:
        specials, extra, bos, eos = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
                                     "<|start_header_id|>", "<|end_header_id|>"], [], \
            "<|begin_of_text|>", "<|eot_id|>"
    tok = Tokenizer(models.BPE())
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre.Sequence([
        pre.Split(Regex(QWEN2_REGEX if style == "qwen2" else LLAMA3_REGEX), behavior="isolated"),
        pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    post: processors.PostProcessor = processors.ByteLevel(trim_offsets=False)
    if bos is not None:
        post = processors.Sequence([post, processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
            special_tokens=[(bos, tok.token_to_id(bos))])])
    tok.post_processor = post
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=specials[0],
        chat_template=CHATML if style == "qwen2" else LLAMA3_CHAT)


def tokenizer_metadata(w: GGUFWriter, hf: PreTrainedTokenizerFast, pre_name: str,
                       model: str = "gpt2") -> None:
    """The tokenizer keys llama.cpp's converter writes for a byte-level BPE (`_set_vocab_gpt2`);
    `model` other than gpt2 only to test refusals."""
    backend = hf.backend_tokenizer
    n = backend.get_vocab_size(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    tokens = [backend.id_to_token(i) for i in range(n)]
    types = [TokenType.NORMAL if i not in added else
             TokenType.CONTROL if added[i].special else TokenType.USER_DEFINED for i in range(n)]
    merges = json.loads(backend.to_str())["model"]["merges"]
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre_name)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    if hf.bos_token_id is not None:
        w.add_bos_token_id(hf.bos_token_id)
    w.add_add_bos_token(hf.bos_token_id is not None)
    w.add_eos_token_id(hf.eos_token_id)
    w.add_pad_token_id(hf.pad_token_id)
    if pre_name == "llama-bpe":
        w.add_eot_token_id(hf.convert_tokens_to_ids("<|eot_id|>"))
    w.add_chat_template(hf.chat_template)


def k_quant_blocks(qtype: Q, rows: int, cols: int, std: float,
                   rng: np.random.Generator) -> np.ndarray:
    """Valid Q4_K / Q5_K / Q6_K blocks [rows, bytes]: random quants and sub-block scales, fp16
    super-block scales (d, and dmin for Q4_K/Q5_K) chosen so that values are about +-std.

    ggml layouts (ggml-common.h): block_q4_K = d, dmin, scales[12], qs[128]; block_q5_K = d,
    dmin, scales[12], qh[32], qs[128] (value d*sc*q - dmin*m, 6-bit sc, m); block_q6_K =
    ql[128], qh[64], scales[16] (int8), d (value d*sc*(q - 32)).
    """
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    half = np.float16
    if qtype == Q.Q6_K:
        raw[..., 208:210] = np.full((rows, cols // block, 1), std / 1000, half).view(np.uint8)
    else:
        qmax = 15 if qtype == Q.Q4_K else 31
        d = std / (31.5 * qmax * 0.6)
        raw[..., 0:2] = np.full((rows, cols // block, 1), d, half).view(np.uint8)
        raw[..., 2:4] = np.full((rows, cols // block, 1), d * qmax / 2, half).view(np.uint8)
    return raw.reshape(rows, -1)


def quantised(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(what the GGUF stores, its dequantised float32 values) for one 2-D weight."""
    if qtype == Q.F32:
        return w, w
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        stored = k_quant_blocks(qtype, w.shape[0], w.shape[1], float(w.std()), rng)
    else:
        stored = quantize(w, qtype)
    return stored, np.asarray(dequantize(stored, qtype), dtype=np.float32)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py `LlamaModel.permute` (rows only: works on quantised byte rows)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
          "mlp.gate_up_proj": "ffn_up"}  # phi3: gguf-py's TensorNameMap maps gate_up to ffn_up


_GEMMA_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """HF parameter name -> llama.cpp tensor name (gguf-py's TensorNameMap, for these models)."""
    base, kind = hf_name.rsplit(".", 1)
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    _, _, layer, module = base.split(".", 3)
    names = _GEMMA_LAYER if arch.startswith("gemma") else _LAYER
    return f"blk.{layer}.{names[module]}.{kind}"


def model_config(case: Case, hf_tok: PreTrainedTokenizerFast, seed: int) -> tuple[ModelSpec, dict]:
    spec = ModelSpec(arch=HF_TYPE.get(case.arch, case.arch), vocab_size=len(hf_tok),
                     tie_word_embeddings=case.tied, seed=seed)
    cfg = hf_config(spec) | GEOMETRY | {
        "head_dim": case.head_dim, "bos_token_id": hf_tok.bos_token_id,
        "eos_token_id": hf_tok.eos_token_id, "max_position_embeddings": 512,
        # exact in float32, as GGUF stores it: no rounding gap between the two sides
        "rms_norm_eps": 2.0 ** -16, "rope_theta": 10000.0}
    if case.arch == "phi3":
        half = int(case.head_dim * 0.75) // 2
        cfg.update(partial_rotary_factor=0.75, sliding_window=None,
                   original_max_position_embeddings=PHI3_ORIG_CONTEXT,
                   rope_scaling={"type": "longrope",
                                 "long_factor": [1.0 + 0.25 * i for i in range(half)],
                                 "short_factor": [1.0 + 0.0625 * i for i in range(half)]})
    if case.arch.startswith("gemma"):  # what llama.cpp derives rather than stores
        pattern = 2 if case.arch == "gemma2" else 6
        cfg.update(query_pre_attn_scalar=case.head_dim,
                   layer_types=["sliding_attention" if i % pattern < pattern - 1
                                else "full_attention" for i in range(cfg["num_hidden_layers"])])
    if case.arch == "gemma3":
        cfg.update(rope_theta=1_000_000.0, rope_local_base_freq=10000.0)
    return spec, cfg


def write_hyper(w: GGUFWriter, cfg: dict) -> None:
    """`<arch>.*` keys as convert_hf_to_gguf.py writes them (key_length only where needed)."""
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg["head_dim"] != cfg["hidden_size"] // cfg["num_attention_heads"]:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if cfg["model_type"] == "llama":
        w.add_rope_dimension_count(cfg["head_dim"])
        w.add_vocab_size(cfg["vocab_size"])
    if cfg["model_type"] in ("gemma2", "gemma3_text"):  # Gemma2Model / Gemma3Model
        if cfg["head_dim"] == cfg["hidden_size"] // cfg["num_attention_heads"]:  # else above
            w.add_key_length(cfg["head_dim"])
            w.add_value_length(cfg["head_dim"])
        w.add_sliding_window(cfg["sliding_window"])
    if cfg["model_type"] == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if cfg["model_type"] == "phi3":  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        w.add_rope_dimension_count(
            int(cfg["partial_rotary_factor"] * cfg["hidden_size"]) // cfg["num_attention_heads"])
        w.add_sliding_window(cfg["sliding_window"] or 0)
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        scale = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(cfg["original_max_position_embeddings"])))
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight",
                         np.asarray(cfg["rope_scaling"][f"{kind}_factor"], dtype=np.float32))


def write_pair(root: Path, case: Case, qtype: Q, hf_tok: PreTrainedTokenizerFast,
               seed: int = 0) -> tuple[Path, Path]:
    """(HF checkpoint dir, GGUF file) under `root`, holding the same float32 weights."""
    spec, cfg = model_config(case, hf_tok, seed)
    rng = np.random.default_rng(seed)
    hf_dir, gguf_path = root / "hf", root / f"{case.arch}-{qtype.name}.gguf"
    hf_dir.mkdir(parents=True)
    writer = GGUFWriter(str(gguf_path), case.arch)
    write_hyper(writer, cfg)
    tokenizer_metadata(writer, hf_tok, case.pre)
    ref: dict[str, torch.Tensor] = {}
    for name, tensor in random_weights(spec, cfg).items():
        w = tensor.numpy()
        stored, values = quantised(w, qtype, rng) if w.ndim == 2 else (w, w)
        if case.arch.startswith("gemma") and name.endswith("norm.weight"):
            stored = w + np.float32(1.0)  # llama.cpp stores Gemma's (1 + w) ...
            values = stored - np.float32(1.0)  # ... which import turns back, in float32
        if case.arch == "llama" and ".q_proj." in name:
            stored = llama_cpp_permute(stored, cfg["num_attention_heads"])
        elif case.arch == "llama" and ".k_proj." in name:
            stored = llama_cpp_permute(stored, cfg["num_key_value_heads"])
        raw = qtype if stored.dtype == np.uint8 else None
        writer.add_tensor(gguf_name(name, case.arch), np.ascontiguousarray(stored),
                          raw_dtype=raw)
        ref[name] = torch.from_numpy(np.array(values, dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file,
                  writer.write_tensors_to_file, writer.close):
        write()
    save_file(ref, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    (hf_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}))
    hf_tok.save_pretrained(str(hf_dir))
    return hf_dir, gguf_path


def write_minimal_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q | None]],
                       hf_tok: PreTrainedTokenizerFast, cfg: dict, pre_name: str = "qwen2",
                       tokenizer_model: str = "gpt2") -> Path:
    """A GGUF of architecture `arch` with these raw tensors (for refusals)."""
    writer = GGUFWriter(str(path), arch)
    write_hyper(writer, cfg)
    tokenizer_metadata(writer, hf_tok, pre_name, tokenizer_model)
    for name, (data, raw) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file,
                  writer.write_tensors_to_file, writer.close):
        write()
    return path
