"""One-time conversion of a llama-architecture GGUF into a Hugging Face-format model directory.

The output directory holds config.json (LlamaForCausalLM), model.safetensors (float32: the GGUF's
Q4_1/Q8_0 blocks dequantised once; 135M params -> ~0.5 GB, and fp32 keeps the dequantised values
exact so our engine and HF transformers see bit-identical weights), tokenizer.json,
tokenizer_config.json, chat_template.jinja, generation_config.json and a marker file written last.

The directory is built in a temp sibling and renamed into place, under a file lock, so a crash or a
concurrent converter never leaves (or reads) a half-written directory. A later run reuses it when
the marker's converter version and source file size match.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gguf import GGUFReader

    from shared.model.gguf_tokenizer import GgufVocab

CONVERTER_VERSION = 1
MARKER_FILE = "pdmesh-import.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_DTYPE = "float32"

_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_TENSOR_RE = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.weight$")


def hf_tensor_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF Llama parameter name; raises for tensors we do not understand."""
    m = _TENSOR_RE.match(gguf_name)
    if m is not None:
        layer, base = m.groups()
        if layer is None and base in _TOP_NAMES:
            return f"{_TOP_NAMES[base]}.weight"
        if layer is not None and base in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[base]}.weight"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} (only plain llama architecture is handled)")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` of a Q or K projection (convert_hf_to_gguf.py).

    HF stores each head's rows as [first half | second half] of the rotary dim (rotate_half
    RoPE); llama.cpp interleaves them as pairs (GPT-J style). Its converter does
    `w.reshape(n_heads, 2, hd // 2, in).swapaxes(1, 2)`; the inverse swaps the same two axes
    back from the (n_heads, hd // 2, 2, in) view. `n_heads` is the KV head count for K.
    w: [n_heads * head_dim, in_features] -> same shape.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot unpermute {rows} rows over {n_heads} heads")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _scalar(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def build_config(reader: GGUFReader, vocab: GgufVocab) -> dict[str, Any]:
    """config.json for LlamaForCausalLM from the GGUF's `llama.*` hyper-parameters.

    vocab_size is the embedding's row count (it may exceed the tokenizer's); embeddings are tied
    when the file has no separate `output.weight`.
    """
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF has no token_embd.weight")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes are (cols, rows)
    tied = "output.weight" not in tensors
    arch = _scalar(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, got {arch!r}")
    hidden = int(_scalar(reader, "llama.embedding_length"))
    heads = int(_scalar(reader, "llama.attention.head_count"))
    head_dim = int(_scalar(reader, "llama.attention.key_length", hidden // heads))
    if int(_scalar(reader, "llama.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    if _scalar(reader, "llama.rope.scaling.type", "none") not in ("none", None):
        raise ValueError("GGUF rope scaling is not supported")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_scalar(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_scalar(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(_scalar(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_scalar(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(_scalar(reader, "llama.context_length", 2048)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": vocab.bos_token_id,
        "eos_token_id": vocab.eos_token_id,
        "pad_token_id": vocab.pad_token_id,
        "torch_dtype": WEIGHTS_DTYPE,
        "use_cache": True,
    }


def _dequantised_tensors(reader: GGUFReader, config: dict[str, Any], progress: bool) -> dict[str, np.ndarray]:
    """All weights as contiguous float32 arrays under HF names, Q/K rows back in HF order."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    out: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="pdmesh: importing GGUF", unit="tensor", disable=not progress):
        name = hf_tensor_name(t.name)
        # dequantize returns numpy order [rows, cols] = HF [out_features, in_features].
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    _check_shapes(out, config)
    return out


def _check_shapes(tensors: dict[str, np.ndarray], c: dict[str, Any]) -> None:
    h, kv = c["hidden_size"], c["num_key_value_heads"] * c["head_dim"]
    q, ffn = c["num_attention_heads"] * c["head_dim"], c["intermediate_size"]
    expected = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    if not c["tie_word_embeddings"]:
        expected["lm_head.weight"] = (c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        expected.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn), p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != expected:
        bad = sorted(set(got.items()) ^ set(expected.items()))[:6]
        raise ValueError(f"GGUF tensors do not form a llama checkpoint; mismatches: {bad}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_model_dir(gguf_path: Path, dest: Path, progress: bool) -> None:
    """Write every file of the converted model into the (empty, private) directory `dest`."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    from shared.model.gguf_tokenizer import read_vocab, write_tokenizer_files

    reader = GGUFReader(str(gguf_path))
    vocab = read_vocab(reader)
    config = build_config(reader, vocab)
    save_file(_dequantised_tensors(reader, config, progress), str(dest / WEIGHTS_FILE),
              metadata={"format": "pt"})
    os.chmod(dest / WEIGHTS_FILE, 0o644)  # safetensors creates it 0600; the cache may be shared
    _write_json(dest / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    _write_json(dest / "generation_config.json", generation)
    write_tokenizer_files(vocab, dest, config["max_position_embeddings"])
    marker = {
        "converter_version": CONVERTER_VERSION,
        "source": str(gguf_path.resolve()),
        "source_size": gguf_path.stat().st_size,
        "source_sha256": _sha256(gguf_path),
        "weights_dtype": WEIGHTS_DTYPE,
    }
    _write_json(dest / MARKER_FILE, marker)  # last: its presence means "complete"


def read_marker(model_dir: Path) -> dict[str, Any] | None:
    """The import marker of a converted directory, or None when absent or unreadable."""
    try:
        return json.loads((model_dir / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_converted(model_dir: Path, gguf_path: Path) -> bool:
    """True when `model_dir` is a complete conversion of `gguf_path` by this converter version."""
    marker = read_marker(model_dir)
    return (
        marker is not None
        and marker.get("converter_version") == CONVERTER_VERSION
        and marker.get("source_size") == gguf_path.stat().st_size
        and (model_dir / WEIGHTS_FILE).is_file()
        and (model_dir / "tokenizer.json").is_file()
    )


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Convert `gguf_path` into `out_dir` unless a current conversion is already there.

    Safe against crashes (temp dir + rename) and against concurrent callers (a lock file next to
    `out_dir`; the second caller waits, then reuses the first one's result). Returns `out_dir`.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if is_converted(out_dir, gguf_path):  # lock-free fast path (works on a read-only cache too)
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out_dir.parent / f".{out_dir.name}.lock"):
        if is_converted(out_dir, gguf_path):
            return out_dir
        for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):  # a crashed converter's
            shutil.rmtree(stale, ignore_errors=True)
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            _write_model_dir(gguf_path, tmp, progress)
            if out_dir.exists():  # stale or partial leftovers from an older converter
                trash = tmp.with_name(tmp.name + "-old")
                out_dir.rename(trash)
                shutil.rmtree(trash, ignore_errors=True)
            tmp.rename(out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir
