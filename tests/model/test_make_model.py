"""`pdmesh make-model`: the checkpoint it writes is a valid HF directory with the asked shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from services.cli import main
from shared.model.loader import open_checkpoint
from shared.model.make_model import VOCAB_SIZE
from shared.model.rope import RopeType


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    """Stand-in tokenizer files: make-model only copies them."""
    src = tmp_path / "tok"
    src.mkdir()
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    (src / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    (src / "chat_template.jinja").write_text("{{ messages }}")
    return src


def make(out: Path, tokenizer_dir: Path, *flags: str) -> int:
    return main(["make-model", str(out), "--tokenizer-from", str(tokenizer_dir), *flags])


def test_writes_an_hf_checkpoint(tmp_path: Path, tokenizer_dir: Path) -> None:
    out = tmp_path / "m"
    assert make(out, tokenizer_dir, "--preset", "small", "--arch", "qwen2", "--seed", "3") == 0
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        assert (out / name).is_file()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (tokenizer_dir / name).read_bytes()
    hf = AutoConfig.from_pretrained(out)
    assert hf.architectures == ["Qwen2ForCausalLM"] and hf.vocab_size == VOCAB_SIZE == 49152
    cfg = open_checkpoint(out).config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (4, 128, 4, 2)
    assert (hf.num_hidden_layers, hf.hidden_size) == (cfg.num_layers, cfg.hidden_size)
    assert cfg.attention_bias and json.loads((out / "generation_config.json").read_text())[
        "eos_token_id"] == cfg.eos_token_ids[0]


def test_seed_determines_weights(tmp_path: Path, tokenizer_dir: Path) -> None:
    fps = []
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        assert make(tmp_path / name, tokenizer_dir, "--seed", seed) == 0
        fps.append(open_checkpoint(tmp_path / name).fingerprint())
    assert fps[0] == fps[1] != fps[2]


def test_flags_shape_the_config(tmp_path: Path, tokenizer_dir: Path) -> None:
    out = tmp_path / "m"
    flags = ("--num-kv-heads", "1", "--head-dim", "32", "--untied", "--rope-type", "llama3",
             "--rope-factor", "8", "--rope-keys", "v5", "--num-shards", "2", "--arch", "mistral")
    assert make(out, tokenizer_dir, *flags) == 0
    raw = json.loads((out / "config.json").read_text())
    assert "rope_parameters" in raw and "rope_scaling" not in raw
    ckpt = open_checkpoint(out)
    cfg = ckpt.config
    assert (cfg.architecture, cfg.num_kv_heads, cfg.head_dim) == ("MistralForCausalLM", 1, 32)
    assert not cfg.tie_word_embeddings and len(ckpt.weight_files) == 2
    assert cfg.rope.type is RopeType.LLAMA3 and cfg.rope.factor == 8.0


def test_padded_vocabulary(tmp_path: Path, tokenizer_dir: Path, capsys) -> None:
    """More rows than tokenizer tokens; the scale applies to the LM head's padding rows only."""
    from safetensors.torch import load_file

    rows = VOCAB_SIZE + 64
    plain, padded = tmp_path / "plain", tmp_path / "padded"
    assert make(plain, tokenizer_dir, "--untied", "--vocab-size", str(rows)) == 0
    assert make(padded, tokenizer_dir, "--untied", "--vocab-size", str(rows),
                "--padding-head-scale", "2") == 0
    assert AutoConfig.from_pretrained(padded).vocab_size == rows
    a, b = load_file(plain / "model.safetensors"), load_file(padded / "model.safetensors")
    assert a["model.embed_tokens.weight"].shape == (rows, 64)
    assert b["lm_head.weight"][:VOCAB_SIZE].equal(a["lm_head.weight"][:VOCAB_SIZE])
    assert b["lm_head.weight"][VOCAB_SIZE:].equal(2 * a["lm_head.weight"][VOCAB_SIZE:])
    assert make(tmp_path / "bad", tokenizer_dir, "--padding-head-scale", "2") == 2
    assert "padding_head_scale" in capsys.readouterr().err


def test_bad_spec_exits_nonzero(tmp_path: Path, tokenizer_dir: Path, capsys) -> None:
    assert make(tmp_path / "m", tokenizer_dir, "--num-shards", "0") == 2
    assert "num_shards" in capsys.readouterr().err


@pytest.mark.slow
def test_default_tokenizer_is_smollm2(tmp_path: Path) -> None:
    """Without --tokenizer-from the embedded SmolLM2 model's tokenizer is copied."""
    from tokenizers import Tokenizer

    assert main(["make-model", str(tmp_path / "m")]) == 0
    assert Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json")).get_vocab_size() == VOCAB_SIZE
