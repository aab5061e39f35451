"""MXFP4 weight quantisation of a model's linear layers: the config, the module, the swap.

`--quantization mxfp4` replaces the decoder's nn.Linear modules (the fused qkv and gate_up
projections, o_proj, down_proj, and optionally the LM head) by `MXFP4Linear`, which keeps the
weight packed (OCP MX v1.0, see kernels/README.md) and computes with `kernels.mxfp4`. Weights
are quantised one checkpoint tensor at a time while loading, so the dense matrix of the whole
model never exists; a pre-quantised checkpoint is copied in as it is stored.

Pre-quantised checkpoint convention (gpt-oss style): a linear weight `X.weight` [out, in] is
stored as `X.weight_blocks` uint8 [out, in/32, 16] and `X.weight_scales` uint8 [out, in/32],
and config.json carries `"quantization_config": {"quant_method": "mxfp4",
"modules_to_not_convert": [...]}`. Every decoder linear is quantised; the LM head is
quantised iff `lm_head.weight_blocks` is stored (with tied embeddings the embedding stays
dense under `model.embed_tokens.weight` and the packed head is stored beside it).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import mxfp4
from kernels.dense.backend import BF16_GEMM_TIERS, bucketed_linear
from kernels.mxfp4.backend import FUSED_MAX_ROWS
from kernels.mxfp4.build import FULL_NAMESPACE

BLOCK = 32  # elements per MXFP4 block: in_features must be a multiple
PACKED_SUFFIXES = ("weight_blocks", "weight_scales")
# Off by default (`--quantize-lm-head` turns it on), from benchmarks/perplexity.py on
# SmolLM2-135M (521 tokens, bf16): dense 26.9, MXFP4 decoder 43.9 (+64%), MXFP4 decoder + head
# 59.5 (+122%). The head is 21% of the weights and half the bytes a decode step reads with the
# head dense; quantising it gives +26-49% single-stream decode tok/s (benchmarks/llamacpp_decode.py,
# 2026-12-03: 163 vs 130 and 186 vs 125 tok/s), but the quality cost is not a default
# (llama.cpp's Q4_1 file keeps this head at Q8_0).
DEFAULT_QUANTIZE_LM_HEAD = False
# How block exponents are picked when quantising (kernels/mxfp4/encoder.py). MSE by default,
# from benchmarks/perplexity.py on SmolLM2-135M (bf16, LM head dense, 2026-12-05): dense 26.86,
# OCP exponents 43.95, MSE exponents 43.44 (its weight error is 6% lower: a small gain, free).
# GPTQ (`pdmesh quantize --method gptq`, shared/model/gptq.py) does better but needs calibration
# text and minutes, so it is no on-the-fly encoder: EngineConfig refuses quant_encoder="gptq".
DEFAULT_ENCODER = mxfp4.Encoder.MSE
# Largest dequantised weight (bytes) kept in the shared prefill scratch; bigger weights (a
# 49152-row LM head) run the fused kernel over 32-row slices instead of being dequantised.
DEFAULT_SCRATCH_BYTES = 32 << 20


class QuantMethod(StrEnum):
    """A supported weight format (EngineConfig.quantization / config.json quant_method)."""

    MXFP4 = "mxfp4"


@dataclass(frozen=True)
class QuantConfig:
    """How a model's linear layers are quantised.

    quantize_lm_head None means "the default" (DEFAULT_QUANTIZE_LM_HEAD for on-the-fly
    quantisation, what the checkpoint stores for a pre-quantised one). prequantized: the
    checkpoint stores `*_blocks` / `*_scales` for the quantised linears (copied in as they are).
    backend is the kernels.mxfp4 backend (None: the fastest this machine runs). encoder picks
    each block's shared exponent when dense weights are quantised (ignored for prequantized:
    the stored bytes are used as they are).
    """

    method: QuantMethod = QuantMethod.MXFP4
    encoder: mxfp4.Encoder = DEFAULT_ENCODER
    quantize_lm_head: bool | None = None
    prequantized: bool = False
    backend: str | None = None
    # How decode rows enter the quantised linears (mxfp4.Activations): float, or int8 (W4A8).
    activations: mxfp4.Activations = mxfp4.Activations.FLOAT
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES
    # HF module-name patterns left dense (a checkpoint's `modules_to_not_convert`, e.g.
    # gpt-oss's "model.layers.*.self_attn"): a match of the module or one of its parents.
    keep: tuple[str, ...] = ()

    def keeps(self, module_name: str) -> bool:
        """Whether our module `module_name` (e.g. "layers.0.self_attn.qkv_proj") stays dense."""
        hf = module_name if module_name.startswith("lm_head") else "model." + module_name
        return any(fnmatch.fnmatchcase(hf, p) or fnmatch.fnmatchcase(hf, p + ".*")
                   for p in self.keep)

    @property
    def lm_head(self) -> bool:
        return DEFAULT_QUANTIZE_LM_HEAD if self.quantize_lm_head is None else self.quantize_lm_head

    @staticmethod
    def parse(value: QuantConfig | str | None,
              encoder: mxfp4.Encoder | str = DEFAULT_ENCODER,
              activations: mxfp4.Activations | str = mxfp4.Activations.FLOAT,
              ) -> QuantConfig | None:
        """EngineConfig.quantization (None | "mxfp4"), quant_encoder ("ocp" | "mse") and
        quant_activations ("float" | "int8"), or a QuantConfig (taken as it is) ->
        QuantConfig | None."""
        if value is None or isinstance(value, QuantConfig):
            return value
        try:
            method = QuantMethod(value)
        except ValueError:
            raise ValueError(f"unsupported quantization {value!r} (supported: mxfp4)") from None
        return QuantConfig(method=method, encoder=parse_encoder(encoder),
                           activations=mxfp4.Activations(activations))

    def to_hf(self) -> dict[str, Any]:
        """The config.json `quantization_config` entry of a checkpoint written with this."""
        keep = ["model.embed_tokens"] + ([] if self.lm_head else ["lm_head"])
        return {"quant_method": str(self.method), "modules_to_not_convert": keep}


def parse_encoder(value: mxfp4.Encoder | str) -> mxfp4.Encoder:
    """"ocp" | "mse" -> mxfp4.Encoder; raises ValueError naming the choices."""
    try:
        return mxfp4.Encoder(value)
    except ValueError:
        choices = ", ".join(e.value for e in mxfp4.Encoder)
        raise ValueError(f"unsupported MXFP4 encoder {value!r} (supported: {choices})") from None


def resolve_quantization(requested: QuantConfig | str | None, hf_config: Mapping[str, Any] | None,
                         stored_names: Collection[str]) -> QuantConfig | None:
    """The QuantConfig to load a checkpoint with, from the request and what is stored.

    hf_config is config.json's `quantization_config` (None when absent); a checkpoint that has
    one loads pre-quantised whatever was requested (its dense weights do not exist).
    """
    quant = QuantConfig.parse(requested)
    packed = any(n.endswith(PACKED_SUFFIXES) for n in stored_names)
    if hf_config is None:
        if packed:
            raise ValueError("checkpoint stores *_blocks/*_scales tensors but its config.json "
                             "has no quantization_config")
        return quant
    method = hf_config.get("quant_method") if isinstance(hf_config, Mapping) else None
    if method != QuantMethod.MXFP4:
        raise ValueError(f"checkpoint quantization {method!r} is not supported (only mxfp4)")
    stored_head = any(n.endswith("lm_head.weight_blocks") for n in stored_names)
    if quant is not None and quant.quantize_lm_head not in (None, stored_head):
        raise ValueError(f"the checkpoint stores a {'quantised' if stored_head else 'dense'} LM "
                         f"head; quantize_lm_head={quant.quantize_lm_head} needs a re-quantised "
                         "checkpoint")
    keep = tuple(str(p) for p in hf_config.get("modules_to_not_convert") or ())
    return replace(quant or QuantConfig(), prequantized=True, quantize_lm_head=stored_head,
                   keep=keep)



class DequantScratch:
    """One reusable buffer per dtype for prefill, shared by every MXFP4Linear of a model.

    Batches over 32 rows dequantise W into it (`dequantize(out=)`) and call torch's matmul;
    reusing it avoids fresh pages for every call, which are expensive on these VMs. It holds
    at most the largest quantised weight up to max_bytes (a few MiB for SmolLM2). A model is
    run by one thread at a time (as its KV cache is), so no lock.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def fits(self, numel: int, dtype: torch.dtype) -> bool:
        return numel * torch.empty((), dtype=dtype).element_size() <= self.max_bytes

    def view(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous [rows, cols] dtype view of the buffer, grown when too small."""
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < rows * cols:
            buf = torch.empty(rows * cols, dtype=dtype)
            self._buffers[dtype] = buf
        return buf[: rows * cols].view(rows, cols)


class MXFP4Linear(nn.Module):
    """y = x @ W.T + bias with W stored as MXFP4 (blocks, scales), computed by kernels.mxfp4.

    Buffers `weight_blocks` uint8 [out, in/32, 16] and `weight_scales` uint8 [out, in/32];
    `bias` is an fp32 Parameter [out] (exact for any loaded dtype; the C++ op takes fp32).
    Decode batches (2-D x of up to 32 rows, fp32 or bf16) call the fused C++ op directly on the
    packed bytes; larger batches dequantise into the model's shared scratch and use torch's
    matmul (weights too big for the scratch run the fused op over 32-row slices). The output
    has x's dtype; accumulation is fp32.
    """

    # The buffers registered in __init__ (nn.Module.__getattr__ serves them at run time; these
    # annotations give them their type).
    weight_blocks: torch.Tensor
    weight_scales: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 path: mxfp4.KernelPath, scratch: DequantScratch,
                 encoder: mxfp4.Encoder = DEFAULT_ENCODER,
                 activations: mxfp4.Activations = mxfp4.Activations.FLOAT) -> None:
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"MXFP4 needs in_features to be a multiple of {BLOCK}, "
                             f"got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        groups = in_features // BLOCK
        self.register_buffer("weight_blocks", torch.empty(out_features, groups, 16,
                                                          dtype=torch.uint8))
        self.register_buffer("weight_scales", torch.empty(out_features, groups, dtype=torch.uint8))
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False) if bias
                     else None)  # inference only: the C++ op has no autograd
        self.path, self.scratch, self.encoder = path, scratch, encoder
        self.activations = activations  # decode rows only: prefill GEMMs take x as it is
        # The C++ op (None on the reference backend): called without KernelPath's per-call
        # checks, which cost ~10 us against a ~30 us GEMV; forward() vets x instead.
        self._op = None if path.library is None else path.library.ops.linear
        self._path_id = (None if path.library is None
                         else activations.op_path(path.backend.path_id))

    @classmethod
    def like(cls, linear: nn.Linear, path: mxfp4.KernelPath, scratch: DequantScratch,
             encoder: mxfp4.Encoder = DEFAULT_ENCODER,
             activations: mxfp4.Activations = mxfp4.Activations.FLOAT) -> MXFP4Linear:
        return cls(linear.in_features, linear.out_features, linear.bias is not None, path,
                   scratch, encoder, activations)

    def fusable(self, mxfp4_path: int) -> bool:
        """Whether kernels.dense's fused decoder layer, which calls the full library's linear
        op on code path mxfp4_path (NativeDecoder.mxfp4_path), computes exactly what forward()
        does for decode rows: this linear runs that library on that same path."""
        lib = self.path.library
        return (lib is not None and lib.namespace == FULL_NAMESPACE
                and self._path_id == mxfp4_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else -1
        if (0 < rows <= FUSED_MAX_ROWS and self._op is not None
                and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous()):
            return self._op(x, self.weight_blocks, self.weight_scales, self.bias, self._path_id)
        if rows > FUSED_MAX_ROWS and x.dtype in (torch.float32, torch.bfloat16):
            return self._forward_batch(x)
        if 0 < rows <= FUSED_MAX_ROWS:  # decode rows of another dtype or layout
            return self.path.linear(x, self.weight_blocks, self.weight_scales, self.bias,
                                    self.activations)
        return self.path.linear(x, self.weight_blocks, self.weight_scales, self.bias)

    def _forward_batch(self, x: torch.Tensor) -> torch.Tensor:
        """x [T > 32, in] -> [T, out]: dequantise once into the scratch, or slice by 32 rows."""
        if self._op is not None and not self.scratch.fits(self.weight_scales.numel() * BLOCK,
                                                          x.dtype):
            x = x.contiguous()
            step = FUSED_MAX_ROWS
            return torch.cat([self._op(x[i:i + step], self.weight_blocks, self.weight_scales,
                                       self.bias, self._path_id)
                              for i in range(0, x.shape[0], step)])
        # torch's bf16 GEMM is slow without bf16 dot products (kernels/dense/backend.py's
        # prefill_linear): every compiled tier but avx512_bf16 multiplies in fp32 instead.
        gemm = x.dtype
        if x.dtype == torch.bfloat16 and self.path.backend.tier not in BF16_GEMM_TIERS:
            gemm = torch.float32
        w = self.scratch.view(self.out_features, self.in_features, gemm)
        self.path.dequantize(self.weight_blocks, self.weight_scales, out=w)
        bias = None if self.bias is None else self.bias.to(gemm)
        # bf16: rows padded to a bucket, so oneDNN caches a bounded set of GEMM shapes
        linear = bucketed_linear if gemm == torch.bfloat16 else F.linear
        return linear(x.to(gemm), w, bias).to(x.dtype)

    @torch.no_grad()
    def load(self, attr: str, src: torch.Tensor, lo: int, hi: int, name: str) -> None:
        """Fill output rows lo..hi-1 from a checkpoint tensor: a dense `weight` (quantised
        here, from its stored dtype) or a packed `weight_blocks` / `weight_scales`."""
        groups = self.in_features // BLOCK
        expected = {"weight": ((hi - lo, self.in_features), None),
                    "weight_blocks": ((hi - lo, groups, 16), torch.uint8),
                    "weight_scales": ((hi - lo, groups), torch.uint8)}
        if attr not in expected:
            raise ValueError(f"weight {name!r}: MXFP4Linear has no {attr!r}")
        shape, dtype = expected[attr]
        if tuple(src.shape) != shape or (dtype is not None and src.dtype != dtype):
            raise ValueError(f"weight {name!r} is {src.dtype} {tuple(src.shape)}, expected "
                             f"{dtype or 'float'} {shape}")
        if attr == "weight":
            blocks, scales = self.path.quantize(src, self.encoder)
            self.weight_blocks[lo:hi].copy_(blocks)
            self.weight_scales[lo:hi].copy_(scales)
        else:
            getattr(self, attr)[lo:hi].copy_(src)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, backend={self.path.backend}, "
                f"encoder={self.encoder}")


def quantize_linears(model: nn.Module, quant: QuantConfig, lm_head_name: str = "lm_head") -> int:
    """Replace every nn.Linear of model by an (unloaded) MXFP4Linear; returns the count.

    The LM head (`lm_head_name`) is replaced only when quant.lm_head. Call it while the model
    is still on the meta device (before `materialise`), so no dense weight is ever allocated.
    """
    path = mxfp4.kernel_path(quant.backend)  # resolved (and built) outside any meta context
    scratch = DequantScratch(quant.scratch_bytes)
    count = 0
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or (full == lm_head_name and not quant.lm_head):
                continue
            if full != lm_head_name and quant.keeps(full):
                continue
            with child.weight.device:  # meta stays meta: materialise allocates it later
                setattr(parent, child_name,
                        MXFP4Linear.like(child, path, scratch, quant.encoder,
                                         quant.activations))
            count += 1
    return count


def packed_names(weight_name: str) -> tuple[str, str]:
    """`X.weight` -> (`X.weight_blocks`, `X.weight_scales`), the stored names of its packing."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name!r} is not a weight name")
    base = weight_name.removesuffix("weight")
    return base + PACKED_SUFFIXES[0], base + PACKED_SUFFIXES[1]
