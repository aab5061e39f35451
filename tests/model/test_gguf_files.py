"""`--model path/to/file.gguf` (llama, qwen2, qwen3, phi3, gemma2, gemma3) against the same weights as safetensors.

Each case writes a tiny random checkpoint twice (tests/model/gguf_fixtures.py: an HF directory,
and a GGUF written independently of pdmesh with gguf.GGUFWriter the way llama.cpp's converter
lays it out), in every supported tensor type, the HF side holding gguf's own dequantisation of
the GGUF's blocks. The converted GGUF must then hold bit-identical float32 weights and the same
config, produce the same greedy tokens through the engine (also under --quantization mxfp4),
and tokenize and render chat prompts as the HF tokenizer it was made from. Refusals name what
is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter, TokenType
from safetensors.numpy import load_file
from tokenizers import Tokenizer, models
from tokenizers import pre_tokenizers as pre
from tokenizers.trainers import BpeTrainer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.model.gguf_arch import UnsupportedGgufError
from shared.model.gguf_tokenizer import read_vocab, write_tokenizer_files
from shared.model.loader import read_config
from shared.model.registry import ModelNotFoundError, gguf_cache_path, resolve_model
from shared.model.tokenizer import Tokenizer as OurTokenizer
from tests.model.gguf_fixtures import (
    CASES,
    CORPUS,
    Q,
    model_config,
    train_tokenizer,
    write_minimal_gguf,
    write_pair,
)

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
PROMPTS = ["Hello, world!", "def add(a, b):", "In 2024 there were 1,234", "Café naïve 🤗 <think>"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
TEXTS = [*CORPUS[:5], "", "  two  leading", "x\r\n\ny\t\tz", "12345678 and 3.14159",
         "<|im_start|>user\nHi<|im_end|>\n", "<think>hmm</think>done", "I'M SURE THEY'LL",
         "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", "e\u0301 vs \u00e9"]


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, PreTrainedTokenizerFast]:
    return {style: train_tokenizer(style) for style in ("qwen2", "llama-bpe")}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, tokenizers: dict[str, PreTrainedTokenizerFast],
         ) -> Callable[[str, Q], tuple[Path, Path]]:
    """pair(arch, qtype) -> (HF dir, GGUF file), written once per module."""
    made: dict[tuple[str, Q], tuple[Path, Path]] = {}

    def build(arch: str, qtype: Q) -> tuple[Path, Path]:
        if (arch, qtype) not in made:
            case = CASES[arch]
            root = tmp_path_factory.mktemp(f"{arch}-{qtype.name}")
            made[arch, qtype] = write_pair(root, case, qtype, tokenizers[case.pre])
        return made[arch, qtype]

    return build


def llm(model: Path, cache: Path, **kw: object) -> LLM:
    return LLM(model=str(model), dtype="float32", cache_dir=cache, num_threads=1, **kw)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("arch", list(CASES))
def test_same_weights_config_and_greedy_tokens(arch: str, qtype: Q, pair, cache: Path) -> None:
    hf_dir, gguf = pair(arch, qtype)
    converted = resolve_model(str(gguf), cache, progress=False)
    ours = load_file(str(converted / "model.safetensors"))
    ref = load_file(str(hf_dir / "model.safetensors"))
    assert sorted(ours) == sorted(ref)
    assert [k for k in ref if not np.array_equal(ours[k], ref[k])] == []
    assert read_config(converted) == read_config(hf_dir)
    a = llm(hf_dir, cache).generate(PROMPTS, GREEDY)
    b = llm(gguf, cache).generate(PROMPTS, GREEDY)
    assert [o.prompt_token_ids for o in b] == [o.prompt_token_ids for o in a]
    assert [o.token_ids for o in b] == [o.token_ids for o in a]
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in b)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mxfp4_on_a_gguf_runs_like_the_safetensors(arch: str, pair, cache: Path) -> None:
    """--quantization mxfp4 quantises the dequantised weights at load, as for safetensors."""
    from shared.model.quant import MXFP4Linear

    hf_dir, gguf = pair(arch, Q.Q4_K)
    a = llm(hf_dir, cache, quantization="mxfp4")
    b = llm(gguf, cache, quantization="mxfp4")
    model = b.engine.runner.model
    assert any(isinstance(m, MXFP4Linear) for m in model.modules())
    assert ([o.token_ids for o in b.generate(PROMPTS, GREEDY)]
            == [o.token_ids for o in a.generate(PROMPTS, GREEDY)])


@pytest.mark.parametrize("arch", list(CASES))
def test_tokenizer_and_chat_template_match_hf(arch: str, pair, tokenizers, cache: Path) -> None:
    hf = tokenizers[CASES[arch].pre]
    converted = resolve_model(str(pair(arch, Q.Q8_0)[1]), cache, progress=False)
    ours = OurTokenizer(converted)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        bare = ours.encode(text, add_special_tokens=False)
        assert bare == hf.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert (ours.decode(ids, skip_special_tokens=skip)
                    == hf.decode(ids, skip_special_tokens=skip))
    assert ours.bos_token_id == hf.bos_token_id and hf.eos_token_id in ours.eos_token_ids
    if CASES[arch].pre == "llama-bpe":  # llama.cpp's eot id ends a turn too
        assert hf.convert_tokens_to_ids("<|eot_id|>") in ours.eos_token_ids
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert (converted / "chat_template.jinja").read_text(encoding="utf-8") == hf.chat_template
    assert ours.apply_chat_template(chat) == hf.apply_chat_template(chat, tokenize=False,
                                                                    add_generation_prompt=True)


def test_sentencepiece_vocabulary_matches_transformers_gguf_loader(tmp_path: Path) -> None:
    """tokenizer.ggml.model "llama" (SentencePiece BPE: pieces, scores, byte pieces, no merges)
    against transformers' own GGUF tokenizer loader on the same file."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.train_from_iterator(CORPUS, BpeTrainer(vocab_size=300, show_progress=False))
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    pieces = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    tokens = ["<unk>", "<s>", "</s>", *byte_pieces, *pieces]
    w = GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_token_types([TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
                      + [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(pieces))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), np.float32))
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file,
                  w.close):
        write()
    out = tmp_path / "tok"
    out.mkdir()
    write_tokenizer_files(read_vocab(GGUFReader(str(tmp_path / "spm.gguf"))), out, 64)
    ours = OurTokenizer(out)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in [*TEXTS, "漢字 ☃ unseen", "<s> inside</s> text"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ids[0] == 1  # llama.cpp adds BOS to a SentencePiece vocabulary by default
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


# ---- refusals, doctor, cache ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gemma", "falcon"])
def test_unsupported_architecture_is_refused_by_name(arch: str, tmp_path: Path, tokenizers,
                                                     cache: Path) -> None:
    _, cfg = model_config(CASES["qwen2"], tokenizers["qwen2"], 0)
    path = write_minimal_gguf(tmp_path / f"{arch}.gguf", arch,
                              {"token_embd.weight": (np.zeros((8, 256), np.float32), None)},
                              tokenizers["qwen2"], cfg)
    with pytest.raises(UnsupportedGgufError, match=rf"'{arch}'.*llama, qwen2, qwen3"):
        resolve_model(str(path), cache, progress=False)
    assert not gguf_cache_path(path, cache).exists()


def test_unsupported_tensor_type_is_refused_naming_tensor_and_type(pair, tmp_path: Path,
                                                                   tokenizers, cache: Path,
                                                                   ) -> None:
    """A Q2_K tensor (gguf can dequantise it, pdmesh does not take it) in an otherwise good file."""
    _, good = pair("qwen2", Q.F16)
    reader = GGUFReader(str(good))
    block, size = GGML_QUANT_SIZES[Q.Q2_K]
    tensors = {t.name: (np.array(t.data), None) for t in reader.tensors}
    rows, cols = tensors["blk.1.ffn_up.weight"][0].shape
    tensors["blk.1.ffn_up.weight"] = (np.zeros((rows, cols // block * size), np.uint8), Q.Q2_K)
    _, cfg = model_config(CASES["qwen2"], tokenizers["qwen2"], 0)
    path = write_minimal_gguf(tmp_path / "q2k.gguf", "qwen2", tensors, tokenizers["qwen2"], cfg)
    with pytest.raises(UnsupportedGgufError, match=r"'blk.1.ffn_up.weight'.*Q2_K"):
        resolve_model(str(path), cache, progress=False)


@pytest.mark.parametrize("model, pre_name, words", [
    ("bert", "qwen2", r"tokenizer model 'bert'.*gpt2.*llama"),
    ("gpt2", "deepseek-coder", r"pre-tokenizer 'deepseek-coder'.*qwen2"),
])
def test_unsupported_tokenizer_is_refused_by_name(model: str, pre_name: str, words: str, pair,
                                                  tokenizers, tmp_path: Path, cache: Path) -> None:
    _, good = pair("qwen2", Q.F32)
    tensors = {t.name: (np.array(t.data), None) for t in GGUFReader(str(good)).tensors}
    _, cfg = model_config(CASES["qwen2"], tokenizers["qwen2"], 0)
    path = write_minimal_gguf(tmp_path / "t.gguf", "qwen2", tensors, tokenizers["qwen2"], cfg,
                              pre_name=pre_name, tokenizer_model=model)
    with pytest.raises(UnsupportedGgufError, match=words):
        resolve_model(str(path), cache, progress=False)


def test_big_models_are_written_in_shards(pair, tmp_path: Path, monkeypatch) -> None:
    """Above SHARD_BYTES of float32 the weights go to shards + index (bounded memory)."""
    from shared.model import gguf_import

    hf_dir, gguf = pair("qwen3", Q.Q8_0)
    monkeypatch.setattr(gguf_import, "SHARD_BYTES", 1 << 20)
    out = resolve_model(str(gguf), tmp_path, progress=False)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == [s.name for s in shards]
    ref = load_file(str(hf_dir / "model.safetensors"))
    ours = {k: v for s in shards for k, v in load_file(str(s)).items()}
    assert sorted(ours) == sorted(ref) and all(np.array_equal(ours[k], ref[k]) for k in ref)
    assert ([o.token_ids for o in llm(gguf, tmp_path).generate(PROMPTS, GREEDY)]
            == [o.token_ids for o in llm(hf_dir, tmp_path).generate(PROMPTS, GREEDY)])


def test_llama_q_k_biases_are_unpermuted_like_weights() -> None:
    """llama.cpp permutes q_proj/k_proj biases with their weights (LlamaModel.modify_tensors)."""
    from shared.model.gguf_import import unpermute_rope_rows
    from tests.model.gguf_fixtures import llama_cpp_permute

    bias = np.arange(4 * 16, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(bias, 4), 4), bias)


def test_doctor_names_the_gguf_architecture_or_the_refusal(pair, tmp_path: Path, tokenizers,
                                                           capsys, monkeypatch) -> None:
    from services.cli import main

    monkeypatch.delenv("PDMESH_TORCH_VARIANT", raising=False)
    monkeypatch.setenv("PDMESH_CACHE", str(tmp_path / "doctor-cache"))
    _, gguf = pair("qwen3", Q.Q6_K)
    main(["doctor", "--skip-components", "--model", str(gguf)])
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("model arch"))
    assert "Qwen3ForCausalLM (qwen3)" in row and "head_dim 128" in row and "Q6_K" in row, row
    assert not (tmp_path / "doctor-cache").exists()  # inspected, not converted
    _, cfg = model_config(CASES["qwen2"], tokenizers["qwen2"], 0)
    gemma = write_minimal_gguf(tmp_path / "g.gguf", "gemma", {}, tokenizers["qwen2"], cfg)
    main(["doctor", "--skip-components", "--model", str(gemma)])
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("model arch"))
    assert "REFUSED" in row and "'gemma'" in row and "qwen3" in row, row


def test_conversion_is_cached_per_file_and_redone_when_it_changes(pair, tmp_path: Path) -> None:
    _, gguf = pair("llama", Q.Q4_0)
    cache = tmp_path / "c"
    out = resolve_model(str(gguf), cache, progress=False)
    assert out == gguf_cache_path(gguf, cache) and out.is_relative_to(cache / "models" / "gguf")
    marker = json.loads((out / "pdmesh-import.json").read_text())
    assert marker["architecture"] == "llama" and marker["source_size"] == gguf.stat().st_size
    weights = out / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert resolve_model(str(gguf), cache, progress=False) == out
    assert weights.stat().st_mtime_ns == before
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert resolve_model(str(gguf), cache, progress=False) == out
    marker = json.loads((out / "pdmesh-import.json").read_text())
    assert marker["source_mtime_ns"] == stat.st_mtime_ns + 10**9


def test_gguf_path_errors(tmp_path: Path, pair) -> None:
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        resolve_model(str(tmp_path / "missing.gguf"), tmp_path)
    with pytest.raises(ModelNotFoundError, match="revision"):
        resolve_model(str(pair("qwen2", Q.F32)[1]), tmp_path, revision="main")
