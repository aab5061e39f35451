"""HF checkpoint directories: config, generation config, safetensors weights, fingerprint.

A checkpoint directory holds `config.json`, either one `model.safetensors` or shards listed
by `model.safetensors.index.json`, and optionally `generation_config.json`. Weights are read
through `safetensors.safe_open` (memory-mapped), one tensor at a time, and only the tensors a
pipeline stage needs; each is copied straight into the model's parameter in the target dtype.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shared.model.config import ModelConfig
from shared.model.gemma import GemmaForCausalLM
from shared.model.gpt_oss import GptOssForCausalLM
from shared.model.llama import LlamaForCausalLM
from shared.model.quant import QuantConfig, resolve_quantization

INDEX_FILE = "model.safetensors.index.json"
SUPPORTED_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Fingerprint sampling: tensors up to _WHOLE bytes are hashed whole, larger ones through
# _WINDOWS evenly spaced windows of _WINDOW bytes (first and last bytes included).
_WHOLE = 64 * 1024
_WINDOWS = 16
_WINDOW = 4096


@dataclass(frozen=True)
class Checkpoint:
    """A parsed checkpoint directory: normalised config, generation defaults, weight files.

    `generation_config` is the raw `generation_config.json` (empty when absent).
    """

    model_dir: Path
    config: ModelConfig
    weight_files: tuple[Path, ...]
    generation_config: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from config.json and generation_config.json, in order, deduplicated."""
        gen = self.generation_config.get("eos_token_id")
        gen_ids = [] if gen is None else [gen] if isinstance(gen, int) else list(gen)
        return tuple(dict.fromkeys([*self.config.eos_token_ids, *(int(i) for i in gen_ids)]))

    def fingerprint(self) -> str:
        return weights_fingerprint(self.weight_files)


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """'float32' / 'bfloat16' / torch dtype -> torch dtype; anything else raises."""
    if isinstance(dtype, torch.dtype):
        if dtype in SUPPORTED_DTYPES.values():
            return dtype
    elif dtype in SUPPORTED_DTYPES:
        return SUPPORTED_DTYPES[dtype]
    raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def read_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    return ModelConfig.from_hf(read_json(path))


def read_generation_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "generation_config.json"
    return read_json(path) if path.is_file() else {}


def weight_files(model_dir: Path) -> tuple[Path, ...]:
    """The safetensors files, from the index when there is one; raises if none exist."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = tuple(model_dir / name for name in sorted(set(weight_map.values())))
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists missing shards: {', '.join(absent)}")
        return files
    single = model_dir / "model.safetensors"
    files = (single,) if single.is_file() else tuple(sorted(model_dir.glob("*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def open_checkpoint(model_dir: Path) -> Checkpoint:
    model_dir = Path(model_dir)
    return Checkpoint(model_dir=model_dir, config=read_config(model_dir),
                      weight_files=weight_files(model_dir),
                      generation_config=read_generation_config(model_dir))


def iter_weights(files: tuple[Path, ...], keep: Callable[[str], bool] | None = None,
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every stored tensor `keep` accepts; unwanted ones are never read."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)


def stored_tensor_names(files: tuple[Path, ...]) -> set[str]:
    """Names of every tensor in the safetensors files (headers only, no data read)."""
    return {name for path in files for name in _safetensors_header(path)[1]
            if name != "__metadata__"}


def checkpoint_quantization(ckpt: Checkpoint, requested: QuantConfig | str | None = None,
                            ) -> QuantConfig | None:
    """How to load ckpt: `requested` (EngineConfig.quantization or a QuantConfig) for a dense
    checkpoint; a pre-quantised one (config.json `quantization_config`) loads as stored."""
    hf_quant = read_json(ckpt.model_dir / "config.json").get("quantization_config")
    return resolve_quantization(requested, hf_quant, stored_tensor_names(ckpt.weight_files))


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The decoder class for a config: Llama's, or a family variant built on it."""
    if config.gemma is not None:
        return GemmaForCausalLM
    if config.gpt_oss is not None:
        return GptOssForCausalLM
    return LlamaForCausalLM


def load_model(model_dir: Path, dtype: torch.dtype | str,
               layer_range: tuple[int, int] | None = None,
               quantization: QuantConfig | str | None = None,
               ) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model (or one pipeline stage) in `dtype` and load its weights.

    quantization None | "mxfp4" | QuantConfig quantises the linear layers while loading (see
    shared.model.quant); a pre-quantised checkpoint is always loaded quantised.
    """
    ckpt = open_checkpoint(Path(model_dir))
    quant = checkpoint_quantization(ckpt, quantization)
    model = model_class(ckpt.config)(ckpt.config, layer_range, dtype=resolve_dtype(dtype),
                                     quantization=quant)
    model.load_weights(iter_weights(ckpt.weight_files, keep=model.wants_weight))
    model.eval()
    release_freed_heap()
    return model, ckpt.config


def release_freed_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc `malloc_trim(0)`); False where there is
    no glibc. Call once after loading, never on a hot path (it walks every arena).

    Loading makes transient copies (a tensor read from the file, converted to the serving dtype,
    concatenated into a fused projection, quantised...). They are freed, but glibc keeps the
    pages: after a large mmap'd block is freed its mmap threshold grows (up to 32 MiB), so
    later tensors of that size come from the arenas, and an arena only shrinks from its top.
    On SmolLM2-135M, with the engine's trim after its warm-up step, a worker's idle RSS drops
    from 952 to 863 MB (bf16) and 813 to 717 MB (MXFP4) (benchmarks/memory.py, 2026-12-05).
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim  # glibc only: musl has no malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def weights_fingerprint(files: tuple[Path, ...]) -> str:
    """SHA-256 hex digest identifying a checkpoint's weights, cheaply and deterministically.

    Covers, for every tensor sorted by name (so sharding does not matter): its name, stored
    dtype, shape and byte length, and its raw stored bytes — all of them for tensors up to
    64 KiB (norms, biases), else 16 evenly spaced 4 KiB windows including the first and last
    bytes. Any retraining, fine-tune, re-quantisation, dtype change or reshape changes it;
    it reads about 64 KiB per tensor, whatever the model size. It does NOT cover edits confined
    to unsampled bytes of a large tensor, nor safetensors metadata or non-weight files.
    """
    entries: dict[str, tuple[Path, int, dict[str, Any]]] = {}
    for path in files:
        data_start, header = _safetensors_header(path)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in entries:
                raise ValueError(f"tensor {name!r} is stored in two files")
            entries[name] = (path, data_start, info)
    digest = hashlib.sha256()
    handles: dict[Path, Any] = {}
    try:
        for name in sorted(entries):
            path, data_start, info = entries[name]
            lo, hi = info["data_offsets"]
            meta = json.dumps([name, info["dtype"], info["shape"], hi - lo], separators=(",", ":"))
            digest.update(meta.encode())
            f = handles.setdefault(path, path.open("rb"))
            for offset, size in _sample_windows(hi - lo):
                f.seek(data_start + lo + offset)
                digest.update(f.read(size))
    finally:
        for f in handles.values():
            f.close()
    return digest.hexdigest()


def _safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(absolute offset of the data section, parsed JSON header) of one safetensors file."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} has a corrupt safetensors header") from exc
    return 8 + size, header


def _sample_windows(nbytes: int) -> list[tuple[int, int]]:
    if nbytes <= _WHOLE:
        return [(0, nbytes)]
    step = (nbytes - _WINDOW) / (_WINDOWS - 1)
    return [(round(i * step), _WINDOW) for i in range(_WINDOWS)]
