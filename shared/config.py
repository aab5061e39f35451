"""Engine configuration: frozen dataclasses built once (from CLI flags or kwargs) and passed down.

Nothing below `services/*/__main__` or `services/cli` reads environment variables; they are
folded in here by `EngineConfig.from_env_defaults` and by the CLI parsers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


def default_cache_dir() -> Path:
    """`PDMESH_CACHE`, else ~/.cache/pdmesh. Read here, at configuration time only."""
    return Path(os.environ.get("PDMESH_CACHE") or Path.home() / ".cache" / "pdmesh")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine instance needs; one per worker (or per pipeline stage).

    kv_cache_memory_bytes is the KV-cache budget; the number of blocks is derived from it and
    the model geometry. max_model_len None means the checkpoint's own limit.
    """

    model: str = DEFAULT_MODEL
    dtype: str = "float32"  # "float32" | "bfloat16"
    kv_cache_dtype: str = "auto"  # "auto" follows dtype
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_threads: int | None = None
    quantization: str | None = None  # None | "mxfp4"
    quantize_lm_head: bool = False  # with quantization: the (tied) LM head too
    seed: int = 0
    cache_dir: Path | None = None  # None: default_cache_dir()

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"kv_cache_dtype must be auto, float32 or bfloat16, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.quantization not in (None, "mxfp4"):
            raise ValueError(f"quantization must be mxfp4 or unset, got {self.quantization!r}")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head needs quantization (mxfp4)")

    @property
    def resolved_kv_dtype(self) -> str:
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def resolved_cache_dir(self) -> Path:
        return self.cache_dir or default_cache_dir()
