"""One-time conversion of a GGUF file (llama, qwen2, qwen3, phi3, gemma2/3) into an HF directory.

The output directory holds config.json (see `shared.model.gguf_arch` for the per-architecture
mapping), float32 safetensors (every tensor dequantised once with `gguf.quants.dequantize`;
float32 keeps the dequantised values exact, so our engine and HF transformers see bit-identical
weights, and the loader casts them to the serving dtype, or MXFP4-quantises them, at load),
tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json and a marker
file written last. Weights above `SHARD_BYTES` are split into shards with an index, so the
conversion holds at most one shard of float32 in memory.

The directory is built in a temp sibling and renamed into place, under a file lock, so a crash or a
concurrent converter never leaves (or reads) a half-written directory. A later run reuses it when
the marker's converter version, source file size and (when recorded) mtime match.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.model.gguf_arch import (
    GEMMA_ARCHS,
    PERMUTED_QK,
    ROPE_FACTOR_TENSORS,
    WEIGHTS_DTYPE,
    build_config,
    check_shapes,
    check_single_file,
    check_tensor_types,
    gguf_architecture,
    hf_tensor_name,
)

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor

    from shared.model.gguf_tokenizer import GgufVocab

__all__ = ["CONVERTER_VERSION", "MARKER_FILE", "WEIGHTS_FILE", "build_config", "convert_gguf",
           "hf_tensor_name", "inspect_gguf", "is_converted", "read_marker", "unpermute_rope_rows"]

CONVERTER_VERSION = 1  # phi3 added without a bump: llama/qwen2/qwen3 output is unchanged
MARKER_FILE = "pdmesh-import.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_BYTES = 2 << 30  # float32 bytes per safetensors shard


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` of a Q or K projection (convert_hf_to_gguf.py).

    HF stores each head's rows as [first half | second half] of the rotary dim (rotate_half
    RoPE); llama.cpp interleaves them as pairs (GPT-J style). Its converter does
    `w.reshape(n_heads, 2, hd // 2, in).swapaxes(1, 2)`; the inverse swaps the same two axes
    back from the (n_heads, hd // 2, 2, in) view. `n_heads` is the KV head count for K.
    w: [n_heads * head_dim, in_features] (or a [n_heads * head_dim] bias) -> same shape.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot unpermute {rows} rows over {n_heads} heads")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantised(t: ReaderTensor, name: str, arch: str, config: dict[str, Any]) -> np.ndarray:
    """One tensor as a contiguous float32 array in HF layout, Q/K rows back in HF order."""
    from gguf.quants import dequantize

    # dequantize returns numpy order [rows, cols] = HF [out_features, in_features].
    w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    if arch in GEMMA_ARCHS and name.endswith("norm.weight"):
        w = w - np.float32(1.0)  # llama.cpp stores Gemma's (1 + weight); HF stores the weight
    if arch in PERMUTED_QK:
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rope_rows(w, config["num_attention_heads"])
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rope_rows(w, config["num_key_value_heads"])
    return np.ascontiguousarray(w)


def _shard_plan(tensors: list[ReaderTensor]) -> list[list[ReaderTensor]]:
    """Tensors grouped, in file order, into shards of at most SHARD_BYTES of float32."""
    shards: list[list[ReaderTensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = 4 * int(np.prod([int(d) for d in t.shape]))
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def _write_weights(reader: GGUFReader, dest: Path, config: dict[str, Any],
                   progress: bool) -> None:
    """model.safetensors, or shards plus model.safetensors.index.json for big models."""
    from safetensors.numpy import save_file
    from tqdm import tqdm

    arch = gguf_architecture(reader)  # the GGUF name (gemma3, not gemma3_text)
    weights = [t for t in reader.tensors if t.name not in ROPE_FACTOR_TENSORS]  # in config.json
    plan = _shard_plan(weights)
    weight_map: dict[str, str] = {}
    bar = tqdm(total=len(weights), desc="pdmesh: importing GGUF", unit="tensor",
               disable=not progress)
    for i, shard in enumerate(plan):
        file = (WEIGHTS_FILE if len(plan) == 1
                else f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors")
        out: dict[str, np.ndarray] = {}
        for t in shard:
            name = hf_tensor_name(t.name, arch)
            out[name] = _dequantised(t, name, arch, config)
            weight_map[name] = file
            bar.update()
        save_file(out, str(dest / file), metadata={"format": "pt"})
        os.chmod(dest / file, 0o644)  # safetensors creates it 0600; the cache may be shared
    bar.close()
    if len(plan) > 1:
        total = sum(4 * int(np.prod([int(d) for d in t.shape])) for t in weights)
        _write_json(dest / INDEX_FILE, {"metadata": {"total_size": total},
                                        "weight_map": weight_map})


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def inspect_gguf(reader: GGUFReader) -> tuple[dict[str, Any], GgufVocab]:
    """(config.json, tokenizer metadata) of the model in an open GGUF, from its header only;
    raises UnsupportedGgufError (naming the architecture, tensor, type or tokenizer) for a file
    we would refuse to convert."""
    from shared.model.gguf_tokenizer import check_vocab, read_vocab

    gguf_architecture(reader)
    check_single_file(reader)
    check_tensor_types(reader)
    vocab = read_vocab(reader)
    check_vocab(vocab)
    config = build_config(reader, vocab)
    check_shapes(reader, config)
    return config, vocab


def _write_model_dir(gguf_path: Path, dest: Path, progress: bool) -> None:
    """Write every file of the converted model into the (empty, private) directory `dest`."""
    from gguf import GGUFReader

    from shared.model.gguf_tokenizer import eos_token_ids, write_tokenizer_files

    reader = GGUFReader(str(gguf_path))
    config, vocab = inspect_gguf(reader)  # everything refused before any tensor is dequantised
    _write_weights(reader, dest, config, progress)
    _write_json(dest / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    eos = eos_token_ids(vocab)
    if len(eos) > 1:  # llama.cpp's eot / eom ids end a turn too
        generation["eos_token_id"] = eos
    _write_json(dest / "generation_config.json", generation)
    write_tokenizer_files(vocab, dest, config["max_position_embeddings"])
    stat = gguf_path.stat()
    marker = {
        "converter_version": CONVERTER_VERSION,
        "source": str(gguf_path.resolve()),
        "source_size": stat.st_size,
        "source_mtime_ns": stat.st_mtime_ns,
        "source_sha256": _sha256(gguf_path),
        "architecture": config["model_type"],
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
    """True when `model_dir` is a complete conversion of `gguf_path` by this converter version
    (same size, and same mtime where the marker records one)."""
    marker = read_marker(model_dir)
    if marker is None:
        return False
    stat = gguf_path.stat()
    return (
        marker.get("converter_version") == CONVERTER_VERSION
        and marker.get("source_size") == stat.st_size
        and marker.get("source_mtime_ns", stat.st_mtime_ns) == stat.st_mtime_ns
        and ((model_dir / WEIGHTS_FILE).is_file() or (model_dir / INDEX_FILE).is_file())
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
