"""WorkerConfig: built once from command-line flags and the environment, then passed down.

This module and `services/commands/serve.py` are the only places that look at `os.environ`
(through the `environ` mapping handed to `from_args`, which passes it on to the `from_args` of
the sub-configurations: KV transfer, chat-output parsers).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from kernels.tier import TIER_CHOICES
from services.common import tls
from services.common.limits import ServerLimits
from services.common.tls import TLSFiles
from services.common.units import parse_size
from services.kv_transfer.config import KVTransferConfig
from services.kv_transfer.config import add_arguments as add_kv_arguments
from services.worker import parsers_config
from services.worker.generation_defaults import GenerationConfigMode
from services.worker.parsers_config import ParsersConfig
from shared.config import (
    DEFAULT_MODEL,
    DTYPE_CHOICES,
    KERNEL_TIER_ENV,
    QUANT_ACTIVATION_CHOICES,
    QUANTIZE_METHOD_CHOICES,
    EngineConfig,
    auto_dtype,
    hf_hub_cache_from_env,
    kernel_tier_from_env,
)
from shared.pipeline import config as pipeline_config
from shared.pipeline.config import PipelineConfig
from shared.protocol.pd import Role
from shared.speculative_config import SpeculativeConfig

API_KEY_ENV = "PDMESH_API_KEY"
SPECULATIVE_CONFIG_ENV = "PDMESH_SPECULATIVE_CONFIG"
DEFAULT_MAX_BODY_SIZE = 4 * 1024 * 1024


SUPPORTED_ROLES = tuple(Role)


class KVLoadFailurePolicy(StrEnum):
    """What a decode does when the remote KV cannot be loaded: answer with an error (the
    default), or compute the prompt itself."""

    FAIL = "fail"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker process needs: its engine, HTTP surface and limits.

    `max_queue` bounds admission: at most `engine.max_num_seqs + max_queue` engine sequences
    (an n=4 request counts 4) may be in flight; beyond that requests get 429.
    `served_model_names` are the names clients may send as `model` (empty: `engine.model`);
    the first one is reported back in responses. `kv` is the KV-transfer service of a prefill
    or decode worker (None for mixed); its role always equals `role`, and its `pp_size` is
    the pipeline's (a PP prefill's KV service declares each stage's layers in the handshake).
    `parsers` are the tool-call and reasoning parsers its chat output is read with.
    `tls`: HTTPS for the API when it has a certificate (the KV listener reuses the files).
    A request head must arrive within `header_timeout_s`, its body within `body_timeout_s`
    (`limits`; bodies over `max_body_size` get 413 from Content-Length). `api_keys` never
    appear in repr (nor does the KV secret).
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    role: Role = Role.MIXED
    host: str = "127.0.0.1"
    port: int = 8100
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_body_size: int = DEFAULT_MAX_BODY_SIZE
    header_timeout_s: float = 60.0
    body_timeout_s: float = 60.0
    max_queue: int = 256
    drain_grace_seconds: float = 30.0
    # After an engine failure: in-flight requests get this long to be answered, then the
    # process exits non-zero (for its supervisor to restart it).
    engine_failure_drain_seconds: float = 5.0
    # /health answers 503 model_degraded for this long after the model produced NaN/inf
    # logits (unless a later step sampled cleanly): load balancers move traffic away, and the
    # worker is tried again after it (a one-off overflow must not take it out for good).
    degraded_hold_seconds: float = 30.0
    served_model_names: tuple[str, ...] = ()
    kv: KVTransferConfig | None = None
    kv_load_failure_policy: KVLoadFailurePolicy = KVLoadFailurePolicy.FAIL
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    parsers: ParsersConfig = field(default_factory=ParsersConfig)
    tls: TLSFiles = field(default_factory=TLSFiles)
    generation_config: GenerationConfigMode = GenerationConfigMode.AUTO

    def __post_init__(self) -> None:
        if self.pipeline.enabled and self.engine.speculative_config is not None:
            raise ValueError("--speculative-config is not supported with --pp-size > 1 (the "
                             "pipeline's last stage samples without the scheduler's drafts)")
        if self.pipeline.enabled and self.role is Role.DECODE:
            raise ValueError("--pp-size > 1 works for the mixed and prefill roles, not decode")
        if self.kv is not None:
            # The KV service declares one layer range per stage (the handshake checks them).
            object.__setattr__(self, "kv", dataclasses.replace(
                self.kv, pp_size=self.pipeline.pp_size,
                layer_partition=self.pipeline.layer_partition))
        if (self.kv is None) != (self.role is Role.MIXED):
            need = "needs" if self.kv is None else "has no"
            raise ValueError(f"a {self.role.value} worker {need} KV-transfer settings")
        if self.kv is not None and self.kv.role != self.role.value:
            raise ValueError(f"KV role {self.kv.role!r} differs from the worker role "
                             f"{self.role.value!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_size < 1024:
            raise ValueError(f"max_body_size must be >= 1 KiB, got {self.max_body_size}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.drain_grace_seconds < 0:
            raise ValueError("drain_grace_seconds must be >= 0")
        if self.engine_failure_drain_seconds < 0:
            raise ValueError("engine_failure_drain_seconds must be >= 0")
        if self.degraded_hold_seconds < 0:
            raise ValueError("degraded_hold_seconds must be >= 0")
        if any(not key for key in self.api_keys):
            raise ValueError("API keys must be non-empty")
        ServerLimits(self.max_body_size, self.header_timeout_s, self.body_timeout_s)

    @property
    def limits(self) -> ServerLimits:
        return ServerLimits(self.max_body_size, self.header_timeout_s, self.body_timeout_s)

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.engine.model,)

    @property
    def served_model_name(self) -> str:
        return self.model_names[0]

    @property
    def admission_capacity(self) -> int:
        return self.engine.max_num_seqs + self.max_queue

    @property
    def transfer_mode(self) -> str | None:
        return self.kv.mode if self.kv is not None else None

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> WorkerConfig:
        """Flags win; `PDMESH_API_KEY` (comma separated) is used only when no --api-key is given,
        `PDMESH_KERNEL_TIER` only when no --kernel-tier is, `PDMESH_SPECULATIVE_CONFIG` (compose
        passes it to the decode workers; empty: off) only when no --speculative-config is. `PDMESH_KV_SECRET` is read by
        KVTransferConfig.from_args from the same mapping, the parser variables by
        ParsersConfig.from_args, and the Hugging Face cache of an org/name --model
        (HF_HUB_CACHE, HF_HOME...) by hf_hub_cache_from_env."""
        keys = tuple(args.api_key or ())
        if not keys:
            keys = tuple(k.strip() for k in environ.get(API_KEY_ENV, "").split(",") if k.strip())
        pipeline = pipeline_config.from_args(args)
        engine = _engine_config(args, environ, pipeline.enabled)
        role = Role(args.role)
        tls_files = tls.from_args(args)
        kv = (None if role is Role.MIXED
              else KVTransferConfig.from_args(args, role.value, environ, tls_files))
        return cls(
            engine=engine,
            role=role,
            kv=kv,
            kv_load_failure_policy=KVLoadFailurePolicy(args.kv_load_failure_policy),
            host=args.host,
            port=args.port,
            api_keys=keys,
            max_body_size=parse_size(args.max_body_size),
            header_timeout_s=args.header_timeout_seconds,
            body_timeout_s=args.body_timeout_seconds,
            max_queue=args.max_queue,
            drain_grace_seconds=args.drain_grace_seconds,
            engine_failure_drain_seconds=args.engine_failure_drain_seconds,
            degraded_hold_seconds=args.degraded_hold_seconds,
            served_model_names=tuple(args.served_model_name or ()),
            generation_config=GenerationConfigMode(args.generation_config),
            pipeline=pipeline,
            parsers=ParsersConfig.from_args(args, environ),
            tls=tls_files,
        )


def _engine_config(args: argparse.Namespace, environ: Mapping[str, str],
                   pipelined: bool) -> EngineConfig:
    """The EngineConfig part of WorkerConfig.from_args (see there for the environment)."""
    kernel_tier = (args.kernel_tier if args.kernel_tier is not None
                   else kernel_tier_from_env(environ))
    # auto: the faster dtype on this CPU; pipeline stages run no native kernels (fp32).
    dtype = (auto_dtype(kernel_tier, native_decode=not pipelined)
             if args.dtype == "auto" else args.dtype)
    return EngineConfig(
        model=args.model,
        revision=args.revision,
        hf_hub_cache=hf_hub_cache_from_env(environ),
        dtype=dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory_bytes=parse_size(args.kv_cache_memory),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        num_threads=args.threads,
        core_share=getattr(args, "core_share", None),
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
        quant_encoder=args.quant_encoder,
        quant_activations=args.quant_activations,
        greedy_screen=not args.no_greedy_screen,
        seed=args.seed,
        kernel_tier=kernel_tier,
        speculative_config=SpeculativeConfig.parse(  # typed here; EngineConfig re-parses
            getattr(args, "speculative_config", None)
            or environ.get(SPECULATIVE_CONFIG_ENV) or None),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdmesh serve` / `python -m services.worker`."""
    pipeline_config.add_arguments(parser)
    # kernel_tier given: the defaults shown in --help must not depend on (or fail with) the env.
    d = EngineConfig(kernel_tier="auto")
    w = WorkerConfig(engine=d)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="model name, HF directory, GGUF file or org/name from the local "
                             "Hugging Face cache ($HF_HUB_CACHE, else $HF_HOME/hub; never "
                             "downloaded)")
    parser.add_argument("--revision", default=None,
                        help="with an org/name --model: branch, tag or full commit hash in the "
                             "Hugging Face cache (default: main)")
    parser.add_argument("--role", default="mixed", choices=[r.value for r in Role],
                        help="mixed (whole requests), prefill or decode (P/D legs + KV service)")
    parser.add_argument("--host", default=w.host)
    parser.add_argument("--port", type=int, default=w.port)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="names accepted as 'model' (default: --model); the first is reported")
    parser.add_argument("--generation-config", default=w.generation_config.value,
                        choices=[m.value for m in GenerationConfigMode],
                        help="auto: the model's generation_config.json sets the defaults of "
                             "temperature, top_p, top_k, min_p, repetition_penalty and "
                             "max_tokens (as vLLM); vllm: ignore it")
    parser.add_argument("--api-key", action="append", default=None,
                        help=f"accepted bearer key, repeatable (default: ${API_KEY_ENV}, comma separated)")
    parser.add_argument("--max-body-size", default=str(w.max_body_size),
                        help="e.g. 4MiB; a larger Content-Length gets 413 before any byte of "
                             "the body is read")
    parser.add_argument("--header-timeout-seconds", type=float, default=w.header_timeout_s,
                        help="close a connection whose request head is not complete after "
                             "this long (or that stays idle this long)")
    parser.add_argument("--body-timeout-seconds", type=float, default=w.body_timeout_s,
                        help="close a connection whose request body is not complete this long "
                             "after its head")
    parser.add_argument("--max-queue", type=int, default=w.max_queue,
                        help="sequences allowed beyond --max-num-seqs before answering 429")
    parser.add_argument("--drain-grace-seconds", type=float, default=w.drain_grace_seconds)
    tls.add_arguments(parser.add_argument_group("TLS (the API and KV listeners, KV clients)"))
    parser.add_argument("--engine-failure-drain-seconds", type=float,
                        default=w.engine_failure_drain_seconds,
                        help="after an engine failure: seconds to answer in-flight requests "
                             "before exiting non-zero")
    parser.add_argument("--degraded-hold-seconds", type=float, default=w.degraded_hold_seconds,
                        help="after NaN/inf logits: seconds /health answers 503 model_degraded")
    _add_engine_arguments(parser, d)
    parsers_config.add_arguments(parser)
    add_kv_arguments(parser)
    parser.add_argument("--kv-load-failure-policy", default=KVLoadFailurePolicy.FAIL.value,
                        choices=[p.value for p in KVLoadFailurePolicy],
                        help="decode: error out (fail) or recompute the prompt when the "
                             "remote KV cannot be loaded")


def _add_engine_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    """The `engine` group: dtype, cache and batch sizes, threads, quantisation, kernel tier."""
    eng = parser.add_argument_group("engine")
    eng.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                     help="auto (default): bfloat16 where a native kernel tier (avx2 and up) "
                          "runs the decode, else float32; see `pdmesh doctor`")
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--block-size", type=int, default=d.block_size)
    eng.add_argument("--kv-cache-memory", default="256MiB", help="KV-cache budget, e.g. 256MiB")
    eng.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    eng.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    eng.add_argument("--no-prefix-caching", action="store_true")
    eng.add_argument("--no-chunked-prefill", action="store_true")
    eng.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    eng.add_argument("--core-share", type=Path, default=None, metavar="FILE",
                     help="a core ledger shared with sibling workers on this host (`pdmesh up` "
                          "makes one): each step runs on --threads plus the threads of the "
                          "siblings idle at that moment")
    eng.add_argument("--quantization", default=None, choices=["mxfp4"])
    eng.add_argument("--quantize-lm-head", action="store_true",
                     help="with --quantization: the (tied) LM head too (faster decode, higher "
                          "perplexity; see kernels/README.md)")
    eng.add_argument("--quant-encoder", default=None, choices=QUANTIZE_METHOD_CHOICES,
                     help="with --quantization: how block exponents are picked (ocp: the OCP "
                          "rule; mse: least squared error per block; default mse); gptq is "
                          "refused here: it needs calibration (`pdmesh quantize --method gptq`)")
    eng.add_argument("--quant-activations", default="float", choices=QUANT_ACTIVATION_CHOICES,
                     help="with --quantization: how decode rows enter the MXFP4 linears (float: "
                          "as they are; int8: quantised per 32-block, integer products, W4A8 "
                          "as llama.cpp's Q4 types; faster on AVX2-only CPUs)")
    eng.add_argument("--no-greedy-screen", action="store_true",
                     help="greedy rows read the whole LM head (default: an int8 screen of it "
                          "plus the few rows that could win; the same tokens, fewer bytes per "
                          "step, half the head's size in memory)")
    eng.add_argument("--seed", type=int, default=d.seed)
    eng.add_argument("--kernel-tier", default=None, choices=TIER_CHOICES,
                     help=f"highest native kernel tier to use (default: ${KERNEL_TIER_ENV}, "
                          "else auto: the fastest this CPU runs); see `pdmesh doctor`")
    eng.add_argument("--speculative-config", default=None, metavar="JSON",
                     help='speculative decoding, as vLLM takes it, e.g. \'{"method": "ngram", '
                          '"num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                          '"prompt_lookup_max": 5, "disable_by_batch_size": 4}\' (decode and '
                          'mixed workers; default: off)')
