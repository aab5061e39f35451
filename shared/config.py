"""Engine configuration: frozen dataclasses built once (from CLI flags or kwargs) and passed down.

Nothing below `services/*/__main__` or `services/cli` reads environment variables; they are
read here (`PDMESH_CACHE`, `PDMESH_KERNEL_TIER`, the Hugging Face cache's `HF_HUB_CACHE`,
`HF_HOME`...), at configuration time, and by the CLI parsers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kernels.tier import Tier
from shared.speculative_config import SpeculativeConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
KERNEL_TIER_ENV = "PDMESH_KERNEL_TIER"
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
# kernels.mxfp4.Encoder's values (tests/quant/test_quant_encoder.py keeps them equal); this
# module stays free of torch.
QUANT_ENCODER_CHOICES = ("ocp", "mse")
# `pdmesh quantize --method`: the encoders, plus GPTQ (shared/model/gptq.py), which needs
# calibration text and so only writes pre-quantised checkpoints.
GPTQ_METHOD = "gptq"
QUANTIZE_METHOD_CHOICES = (*QUANT_ENCODER_CHOICES, GPTQ_METHOD)
# kernels.mxfp4.Activations' values (tests/quant/test_mxfp4_a8.py keeps them equal).
QUANT_ACTIVATION_CHOICES = ("float", "int8")


def default_cache_dir() -> Path:
    """`PDMESH_CACHE`, else ~/.cache/pdmesh. Read here, at configuration time only."""
    return Path(os.environ.get("PDMESH_CACHE") or Path.home() / ".cache" / "pdmesh")


# Where huggingface_hub keeps downloaded repositories, by precedence (its `constants.py`):
# HF_HUB_CACHE, the legacy HUGGINGFACE_HUB_CACHE, $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub,
# ~/.cache/huggingface/hub.
HF_HUB_CACHE_ENV = "HF_HUB_CACHE"
HF_HUB_CACHE_ENVS = (HF_HUB_CACHE_ENV, "HUGGINGFACE_HUB_CACHE")
HF_HOME_ENV = "HF_HOME"


def _expand(value: str, env: Mapping[str, str]) -> Path:
    """`~` and `$VAR` / `${VAR}` expanded as huggingface_hub does (os.path.expanduser and
    expandvars), the variables taken from `env`; unknown ones are left as they are."""
    expanded = re.sub(r"\$(\w+)|\$\{(\w+)\}",
                      lambda m: env.get(m.group(1) or m.group(2), m.group(0)), value)
    return Path(expanded).expanduser()


def hf_hub_cache_from_env(environ: Mapping[str, str] | None = None) -> Path:
    """The local Hugging Face hub cache, found as huggingface_hub finds it (`environ` defaults
    to os.environ): HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub. An empty variable counts
    as unset. Read here, at configuration time only; pdmesh only reads this cache."""
    env = os.environ if environ is None else environ
    for name in HF_HUB_CACHE_ENVS:
        if env.get(name):
            return _expand(env[name], env)
    if env.get(HF_HOME_ENV):
        return _expand(env[HF_HOME_ENV], env) / "hub"
    xdg = env.get("XDG_CACHE_HOME")
    return (_expand(xdg, env) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def parse_kernel_tier(name: str) -> str:
    """'auto' or a kernels.tier.Tier label, normalised ('AVX2 ' -> 'avx2'); ValueError naming
    the choices (kernels.tier.TIER_CHOICES) for anything else."""
    name = name.strip().lower()
    return "auto" if name == "auto" else Tier.parse(name).label


def kernel_tier_from_env(environ: Mapping[str, str] | None = None) -> str:
    """`PDMESH_KERNEL_TIER` (default os.environ), normalised; 'auto' when unset or empty.

    The cap on the kernel tier (kernels/tier.py): a machine of one CPU kind runs the code paths
    of lower kinds with it. An invalid value raises ValueError naming the variable and choices.
    """
    raw = (os.environ if environ is None else environ).get(KERNEL_TIER_ENV, "")
    if not raw.strip():
        return "auto"
    try:
        return parse_kernel_tier(raw)
    except ValueError as exc:
        raise ValueError(f"{KERNEL_TIER_ENV}={raw!r}: {exc}") from None


def auto_dtype(kernel_tier: str, *, native_decode: bool = True, cpu: Tier | None = None) -> str:
    """The dtype `auto` stands for: the faster of bf16 and fp32 decode on this CPU, measured.

    bfloat16 wherever a native dense tier (avx2 and up, within the kernel_tier cap) runs the
    decode: every step streams all weights once, bf16 halves those bytes, and the kernels do
    the math in fp32 (with bf16 dot products where the CPU has them). AMD Zen 3, 1 thread,
    paired in one process: bf16 on the avx2 tier 13.6 tok/s, fp32 4.6, bf16 on plain torch 5.6
    (the avx512 tiers: 3.46x HF bf16, README). float32 where plain torch would run everything
    (the reference or portable tier, or native_decode=False: a pipeline stage), torch's bf16
    matmul being no faster there and fp32 the exact choice. `cpu` defaults to this CPU's tier.
    """
    from shared.kernel_tiers import cpu_tier

    cap = Tier.AVX512_BF16 if kernel_tier == "auto" else Tier.parse(kernel_tier)
    usable = min(cpu if cpu is not None else cpu_tier(), cap)
    return "bfloat16" if native_decode and usable >= Tier.AVX2 else "float32"


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine instance needs; one per worker (or per pipeline stage).

    kv_cache_memory_bytes is the KV-cache budget; the number of blocks is derived from it and
    the model geometry. max_model_len None means the checkpoint's own limit. dtype "auto" is
    resolved at construction (auto_dtype: the fastest on this CPU at this kernel tier); the
    field then holds the concrete dtype. A `model` of the form org/name that is no local
    directory is read from the Hugging Face cache `hf_hub_cache` at `revision` (a branch or
    tag under refs/, or a full commit hash; None: "main"), never downloaded
    (shared.model.registry.resolve_model).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "float32"  # "float32" | "bfloat16" | "auto" (services default to auto)
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
    # With quantization: how block exponents are chosen ("ocp" | "mse"; None: the default,
    # shared.model.quant.DEFAULT_ENCODER). A run-time weight transform, so it is hashed.
    quant_encoder: str | None = None
    # With quantization: how a decode step's activations enter the MXFP4 linears: "float" (as
    # they are) or "int8" (quantised per 32-block, integer products: W4A8, as llama.cpp's Q4
    # types run; kernels/mxfp4/csrc/avx2_a8.cpp). Changes the numbers, so it is hashed.
    quant_activations: str = "float"
    # Greedy rows take their token from the LM head's int8 screen plus the few head rows that
    # could win (kernels/dense/greedy_head.py): the same token, fewer bytes read per step,
    # half the head's size in memory. Off: every row reads the whole head.
    greedy_screen: bool = True
    seed: int = 0
    cache_dir: Path | None = None  # None: default_cache_dir()
    # The highest kernel tier automatic dispatch may pick ("auto": the CPU's best). Defaults to
    # PDMESH_KERNEL_TIER so that every engine of the process (serve, LLM, benchmarks) honours it.
    kernel_tier: str = field(default_factory=kernel_tier_from_env)
    # An org/name model from the local Hugging Face cache: its revision (None: "main") and the
    # cache directory (defaults to HF_HUB_CACHE, HF_HOME... like huggingface_hub).
    revision: str | None = None
    hf_hub_cache: Path = field(default_factory=hf_hub_cache_from_env)
    # Structured output: compiled grammars kept (LRU, by spec), and how long a request's
    # grammar may take to compile before the request is refused (400).
    grammar_cache_size: int = 128
    grammar_compile_timeout_s: float = 10.0
    # Speculative decoding (None: off). A JSON string or a mapping is parsed here, once.
    speculative_config: SpeculativeConfig | None = None
    # A core ledger shared with sibling engines on this host (shared/engine/core_share.py):
    # each step runs on num_threads plus the threads of the siblings idle at that moment.
    core_share: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel_tier", parse_kernel_tier(self.kernel_tier))
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))
        if self.revision is not None and not self.revision.strip():
            raise ValueError("revision must be a branch, tag or commit hash, got an empty one")
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", auto_dtype(self.kernel_tier))
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
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
        if self.quant_encoder == GPTQ_METHOD:
            raise ValueError("quant_encoder gptq needs calibration text, so it cannot run while "
                             "loading: write a GPTQ checkpoint with `pdmesh quantize IN OUT "
                             "--method gptq` and serve that directory (no --quantization)")
        if self.quant_encoder not in (None, *QUANT_ENCODER_CHOICES):
            raise ValueError(f"quant_encoder must be one of {', '.join(QUANT_ENCODER_CHOICES)}, "
                             f"got {self.quant_encoder!r}")
        if self.quant_activations not in QUANT_ACTIVATION_CHOICES:
            raise ValueError(f"quant_activations must be one of "
                             f"{', '.join(QUANT_ACTIVATION_CHOICES)}, got {self.quant_activations!r}")
        if self.quant_activations != "float" and self.quantization is None:
            raise ValueError("quant_activations int8 needs quantization (mxfp4)")
        if self.grammar_cache_size < 1 or not self.grammar_compile_timeout_s > 0:
            raise ValueError("grammar_cache_size must be >= 1 and grammar_compile_timeout_s > 0")

    @property
    def resolved_kv_dtype(self) -> str:
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def resolved_cache_dir(self) -> Path:
        return self.cache_dir or default_cache_dir()
