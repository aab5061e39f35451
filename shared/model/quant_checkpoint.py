"""Writing a pre-quantised MXFP4 checkpoint from a dense HF checkpoint (`pdmesh quantize`).

Every decoder linear weight `X.weight` [out, in] becomes `X.weight_blocks` uint8
[out, in/32, 16] and `X.weight_scales` uint8 [out, in/32] (naming in shared.model.quant);
everything else (embeddings, norms, biases) is copied unchanged, in its stored dtype. With
quantize_lm_head the head is packed too: an untied `lm_head.weight` is replaced, and with
tied embeddings `lm_head.weight_*` is added beside the dense embedding. Quantisation uses
the stored tensor itself (not a dtype-converted copy), exactly as on-the-fly loading does,
so both give bit-identical packed weights (with the same encoder). A `packer` replaces the
encoder (GPTQ: shared.model.gptq.GptqEncoder.pack, bytes computed beforehand from the whole
model); the format is the same. `dense` replaces copied tensors by HF name (the norm weights
into which GPTQ's activation-aware scales were folded), cast to the stored dtype. Tensors are
streamed one at a time and written in shards of at most max_shard_bytes.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from kernels import mxfp4
from shared.model.loader import INDEX_FILE, iter_weights, open_checkpoint, read_json
from shared.model.quant import QuantConfig, packed_names

# Decoder linears quantised by the engine (HF names, any multimodal prefix), Qwen3-MoE experts
# included; an MoE router (`mlp.gate.weight`) stays dense, as the engine keeps it.
_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?"
                     r"(gate|up|down)_proj)\.weight$")
_EMBED = re.compile(r"(^|\.)embed_tokens\.weight$")
_WEIGHT_FILES = re.compile(r".*\.safetensors$")
DEFAULT_SHARD_BYTES = 2 << 30
# (HF weight name, stored tensor [out, in]) -> (blocks uint8 [out, in/32, 16], scales [out, in/32])
Packer = Callable[[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class QuantizeReport:
    """What `write_quantized_checkpoint` wrote."""

    out_dir: Path
    num_quantized: int  # dense weights replaced by a packed pair (a tied head counts once)
    num_copied: int
    dense_bytes: int  # bytes of the quantised weights as they were stored
    packed_bytes: int  # bytes of their blocks + scales
    files: tuple[str, ...]


@dataclass
class _Tally:
    quantized: int = 0
    copied: int = 0
    dense_bytes: int = 0
    packed_bytes: int = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pack(name: str, tensor: torch.Tensor, quant: QuantConfig, tally: _Tally,
          packer: Packer | None) -> Iterator[tuple[str, torch.Tensor]]:
    """`name` [out, in] -> (`name`_blocks, blocks), (`name`_scales, scales)."""
    if tensor.dim() != 2 or tensor.shape[-1] % 32:
        raise ValueError(f"cannot quantise {name!r} {tuple(tensor.shape)}: MXFP4 needs a 2-D "
                         "weight with in_features a multiple of 32")
    packed = (packer(name, tensor) if packer is not None
              else mxfp4.quantize(tensor, backend=quant.backend, encoder=quant.encoder))
    tally.quantized += 1
    tally.dense_bytes += _nbytes(tensor)
    tally.packed_bytes += sum(_nbytes(t) for t in packed)
    yield from zip(packed_names(name), packed, strict=True)


def _converted(model_dir: Path, quant: QuantConfig, tied: bool, tally: _Tally,
               packer: Packer | None, dense: Mapping[str, torch.Tensor],
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the output checkpoint, one source tensor at a time."""
    for name, tensor in iter_weights(open_checkpoint(model_dir).weight_files):
        if name in dense:
            if dense[name].shape != tensor.shape:
                raise ValueError(f"replacement for {name!r} is {tuple(dense[name].shape)}, "
                                 f"stored {tuple(tensor.shape)}")
            tensor = dense[name].to(tensor.dtype)
        head = name.endswith("lm_head.weight")
        if tied and head:
            continue  # HF ignores a stored head when tied; a packed one is derived below
        if _LINEAR.search(name) or (head and quant.lm_head):
            yield from _pack(name, tensor, quant, tally, packer)
            continue
        tally.copied += 1
        yield name, tensor
        if tied and quant.lm_head and _EMBED.search(name):
            yield from _pack("lm_head.weight", tensor, quant, tally, packer)


def check_paths(in_dir: Path, out_dir: Path) -> None:
    """Raise unless in_dir is a dense checkpoint we load and out_dir is absent or empty
    (callers with a long preparation, such as GPTQ calibration, check first)."""
    raw_config = read_json(Path(in_dir) / "config.json")
    if raw_config.get("quantization_config") is not None:
        raise ValueError(f"{in_dir} is already quantised ({raw_config['quantization_config']})")
    if Path(out_dir).exists() and any(Path(out_dir).iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    open_checkpoint(Path(in_dir))  # validates the architecture before any work


def write_quantized_checkpoint(in_dir: Path, out_dir: Path, quant: QuantConfig,
                               max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                               packer: Packer | None = None,
                               dense: Mapping[str, torch.Tensor] | None = None,
                               ) -> QuantizeReport:
    """Write in_dir's checkpoint, MXFP4-quantised, to out_dir (which must not hold files);
    packer, when given, packs every quantised weight instead of quant.encoder; dense (HF
    name -> tensor) replaces those stored tensors that are copied."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    check_paths(in_dir, out_dir)
    raw_config = read_json(in_dir / "config.json")
    config = open_checkpoint(in_dir).config
    out_dir.mkdir(parents=True, exist_ok=True)
    tally = _Tally()
    writer = _ShardWriter(out_dir, max_shard_bytes)
    for name, tensor in _converted(in_dir, quant, config.tie_word_embeddings, tally, packer,
                                   dense or {}):
        writer.add(name, tensor)
    files = writer.close()
    raw_config["quantization_config"] = quant.to_hf()
    (out_dir / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n", encoding="utf-8")
    _copy_other_files(in_dir, out_dir)
    return QuantizeReport(out_dir, tally.quantized, tally.copied, tally.dense_bytes,
                          tally.packed_bytes, files)


class _ShardWriter:
    """Buffers tensors up to max_bytes per shard; `model.safetensors` if one shard, else
    HF-style `model-0000i-of-0000N.safetensors` plus the index."""

    def __init__(self, out_dir: Path, max_bytes: int) -> None:
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = self.total_bytes = 0
        self.written: list[list[str]] = []  # tensor names of each flushed shard

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.current and self.current_bytes + _nbytes(tensor) > self.max_bytes:
            self._flush()
        self.current[name] = tensor.contiguous()
        self.current_bytes += _nbytes(tensor)
        self.total_bytes += _nbytes(tensor)

    def _flush(self) -> None:
        # Temporary name: the final one needs the shard count.
        save_file(self.current, str(self.out_dir / f"shard-{len(self.written):05d}.tmp"),
                  metadata={"format": "pt"})
        self.written.append(list(self.current))
        self.current, self.current_bytes = {}, 0

    def close(self) -> tuple[str, ...]:
        if not self.written:
            save_file(self.current, str(self.out_dir / "model.safetensors"),
                      metadata={"format": "pt"})
            return ("model.safetensors",)
        if self.current:
            self._flush()
        total = len(self.written)
        weight_map: dict[str, str] = {}
        for i, names in enumerate(self.written):
            final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            (self.out_dir / f"shard-{i:05d}.tmp").rename(self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n",
                                               encoding="utf-8")
        return (*sorted(set(weight_map.values())), INDEX_FILE)


def _copy_other_files(in_dir: Path, out_dir: Path) -> None:
    """Tokenizer, chat template, generation config...: every top-level non-weight file."""
    for path in sorted(in_dir.iterdir()):
        if (path.is_file() and not _WEIGHT_FILES.match(path.name)
                and path.name not in ("config.json", INDEX_FILE)):
            shutil.copy2(path, out_dir / path.name)
