"""Checkpoint loading: shards, fingerprint, pipeline stages, weight-name checks, bf16."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from shared.model.attention import AttentionMetadata
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import (
    iter_weights,
    load_model,
    open_checkpoint,
    release_freed_heap,
    weight_files,
    weights_fingerprint,
)
from tests.support.model import PagedRunner, random_ids


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def run_full(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    return PagedRunner(model).step([("s", ids)])["s"]


def test_sharded_equals_single_file(make_checkpoint) -> None:
    single, sharded = make_checkpoint(seed=5), make_checkpoint(seed=5, num_shards=3)
    assert len(weight_files(sharded)) == 3 and (sharded / "model.safetensors.index.json").is_file()
    a, _ = load_model(single, torch.float32)
    b, _ = load_model(sharded, "float32")
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=0, rtol=0)
    assert weights_fingerprint(weight_files(single)) == weights_fingerprint(weight_files(sharded))


def test_fingerprint_tracks_weights(make_checkpoint, tmp_path: Path) -> None:
    base = make_checkpoint(seed=6)
    fp = open_checkpoint(base).fingerprint()
    assert fp == open_checkpoint(base).fingerprint() and len(fp) == 64
    assert open_checkpoint(make_checkpoint(seed=7)).fingerprint() != fp
    assert open_checkpoint(make_checkpoint(seed=6, dtype="bfloat16")).fingerprint() != fp
    # One small tensor (a norm, hashed whole) and one large one (sampled) changed materially.
    for name in ("model.layers.1.input_layernorm.weight", "model.layers.0.mlp.up_proj.weight"):
        edited = tmp_path / name
        shutil.copytree(base, edited)
        tensors = load_file(str(edited / "model.safetensors"))
        tensors[name] = tensors[name] * 1.01
        save_file(tensors, str(edited / "model.safetensors"), metadata={"format": "pt"})
        assert open_checkpoint(edited).fingerprint() != fp


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_stages_chain_to_the_full_model(make_checkpoint, tied: bool) -> None:
    path = make_checkpoint(preset="small", tie_word_embeddings=tied)  # 4 layers
    full, cfg = load_model(path, torch.float32)
    stages = [load_model(path, torch.float32, r)[0] for r in ((0, 1), (1, 3), (3, 4))]
    assert [s.num_local_layers for s in stages] == [1, 2, 1]
    assert stages[0].lm_head is None and stages[1].embed_tokens is None and stages[2].norm is not None
    ids = random_ids(10, seed=8)
    meta = AttentionMetadata.build([0], [10], [[3, 1, 2]], 4)
    h = torch.tensor(ids)
    for stage in stages:
        kv = torch.zeros(stage.num_local_layers, 2, 4, 4, cfg.num_kv_heads, cfg.head_dim)
        h = stage(h, torch.arange(10), meta, kv)
    torch.testing.assert_close(stages[-1].compute_logits(h), run_full(full, ids), atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError):
        stages[0].compute_logits(h)


def test_stage_reads_only_its_tensors(make_checkpoint) -> None:
    path = make_checkpoint(preset="small")
    stage = LlamaForCausalLM(open_checkpoint(path).config, (1, 3))
    names = [n for n, _ in iter_weights(weight_files(path), keep=stage.wants_weight)]
    assert names and all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in names)


def test_bad_checkpoints_are_refused(make_checkpoint, tmp_path: Path) -> None:
    path = make_checkpoint(seed=9)
    model, cfg = load_model(path, torch.float32)
    weights = dict(iter_weights(weight_files(path)))
    fresh = LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="missing weights: model.layers.1.mlp.gate_proj.weight$"):
        fresh.load_weights((k, v) for k, v in weights.items() if k != "model.layers.1.mlp.gate_proj.weight")
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.mlp.extra.weight'"):
        fresh.load_weights([("model.layers.0.mlp.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.self_attn.q_proj.bias'"):
        fresh.load_weights([("model.layers.0.self_attn.q_proj.bias", torch.zeros(64))])  # no bias here
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.2.mlp.up_proj.weight'"):
        fresh.load_weights([("model.layers.2.mlp.up_proj.weight", torch.zeros(1))])  # 2 layers only
    with pytest.raises(ValueError, match="has shape"):
        fresh.load_weights([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="dtype"):
        load_model(path, torch.float16)
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path, torch.float32)


def test_multimodal_prefixed_checkpoint(make_checkpoint, tmp_path: Path) -> None:
    """text_config nesting plus `model.language_model.` names load like the flat checkpoint."""
    flat = make_checkpoint(seed=10, tie_word_embeddings=False)
    cfg = json.loads((flat / "config.json").read_text())
    wrapped = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
               "text_config": {k: v for k, v in cfg.items() if k != "architectures"}}
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(str(flat / "model.safetensors")).items()}
    tensors["model.vision_tower.patch.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ids = random_ids(7, seed=11)
    ours, mcfg = load_model(tmp_path, torch.float32)
    assert mcfg.architecture == "LlamaForCausalLM"
    torch.testing.assert_close(run_full(ours, ids), run_full(load_model(flat, torch.float32)[0], ids),
                               atol=0, rtol=0)


def test_generation_config_eos_is_merged(make_checkpoint, tmp_path: Path) -> None:
    shutil.copytree(make_checkpoint(seed=12), tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ckpt = open_checkpoint(tmp_path / "m")
    assert ckpt.generation_config == {"eos_token_id": [2, 0]}
    assert ckpt.eos_token_ids == (2, 0)


def test_bfloat16_is_as_close_to_fp32_as_hf_bf16(make_checkpoint) -> None:
    """bf16 weights, fp32 logits; our bf16 error stays within 2x HF's own bf16 error."""
    path = make_checkpoint(seed=13, tie_word_embeddings=False)
    ours, _ = load_model(path, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ids = random_ids(12, seed=14)
    got = run_full(ours, ids)
    assert got.dtype == torch.float32
    with torch.no_grad():
        ref32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(torch.tensor([ids])).logits[0]
        ref16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)(torch.tensor([ids])).logits[0]
    hf_err = (ref16.float() - ref32).abs().max()
    assert (got - ref32).abs().max() <= 2 * hf_err


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_freed_heap_returns_freed_arena_pages() -> None:
    """Freed small blocks under a live one stay resident (an arena shrinks only from its top)
    until release_freed_heap; plain libc malloc/free is the reference, not torch."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def rss_mib() -> float:
        pages = int(Path(f"/proc/{os.getpid()}/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20

    size, count = 64 << 10, 2048  # 128 MiB of blocks below the mmap threshold: heap pages
    blocks = [libc.malloc(size) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks[:-1]:  # the last one pins the arena's top
        libc.free(b)
    before = rss_mib()
    assert release_freed_heap()
    assert before - rss_mib() > 64
    libc.free(blocks[-1])
