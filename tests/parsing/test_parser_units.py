"""The building blocks: marker splitting, bracket ends, edge trimming, channel headers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.parsing.brackets import BracketScanner
from shared.parsing.markers import MarkerSplitter, cut_at, partial_suffix_len
from shared.parsing.recipient import (
    Recipient,
    could_be_header,
    held_len,
    opened_message,
    recipient_of,
)
from shared.parsing.tools import ToolSet
from shared.parsing.trimmed_text import TrimmedText


def test_partial_suffix_len() -> None:
    assert partial_suffix_len("abc <tool_c", ["<tool_call>"]) == 7
    assert partial_suffix_len("abc <tool_call>", ["<tool_call>"]) == 0  # whole: not partial
    assert partial_suffix_len("abc", ["<x>"]) == 0


def test_marker_splitter_holds_a_split_marker() -> None:
    splitter = MarkerSplitter(["<|eom|>", "<|eot|>"])
    assert splitter.feed("a<|e") == [("a", None)]
    assert splitter.held == "<|e"
    assert splitter.feed("om|>b<|x") == [("", "<|eom|>"), ("b<|x", None)]
    assert splitter.feed("<|") == []
    assert splitter.finish() == ""  # a partial marker of 2+ chars is dropped at the end
    with pytest.raises(ValueError):
        MarkerSplitter([""])


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet="<|eomt>ab", max_size=40), data=st.data())
def test_marker_splitter_is_independent_of_chunking(text: str, data: st.DataObject) -> None:
    def run(pieces: list[str]) -> list[tuple[str, str | None]]:
        splitter = MarkerSplitter(["<|eom|>", "<|eot|>", "<|e"[:2] + "x"])
        found = [p for piece in pieces for p in splitter.feed(piece)]
        found.append((splitter.finish(), None))
        merged: list[tuple[str, str | None]] = []
        for piece, marker in found:  # adjacent texts merge: only the sequence matters
            if merged and merged[-1][1] is None:
                merged[-1] = (merged[-1][0] + piece, marker)
            else:
                merged.append((piece, marker))
        return merged

    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert run(pieces) == run([text])


def test_cut_at_finds_the_earliest_marker() -> None:
    assert cut_at("a[ARGS]b[TOOL_CALLS]", ["[TOOL_CALLS]", "[ARGS]"]) == ("a", "[ARGS]",
                                                                          "b[TOOL_CALLS]")
    assert cut_at("ab[TOO", ["[TOOL_CALLS]"]) == ("ab", None, "[TOO")


@pytest.mark.parametrize(("pieces", "end"), [
    (['{"a": {"b": "}"}}', " tail"], (0, 17)),
    (['{"a": "\\', '"}"}'], (1, 4)),  # an escape split across deltas
    (["[f(a='])'), g()]"], (0, 16)),
    (['{"a": [1, 2'], None),
])
def test_bracket_scanner_finds_the_end(pieces: list[str], end: tuple[int, int] | None) -> None:
    scanner = BracketScanner(quotes="\"'")
    found = None
    for i, piece in enumerate(pieces):
        at = scanner.feed(piece)
        if at >= 0:
            found = (i, at)
            break
    assert found == end


def test_trimmed_text_trims_edges_and_keeps_inner_whitespace() -> None:
    trimmed = TrimmedText()
    assert [trimmed.push(t) for t in ["\n ", "a", " \n", "b", "  "]] == ["", "a", "", " \nb", ""]
    trimmed.edge("\n\n")
    assert [trimmed.push(t) for t in [" ", "c"]] == ["", "\n\nc"]
    fresh = TrimmedText()
    fresh.edge("\n\n")  # nothing released yet: no separator
    assert fresh.push("x") == "x"


@pytest.mark.parametrize(("header", "recipient"), [
    ("assistant to=self", (Recipient.REASONING, "self")),
    (" to=user", (Recipient.ANSWER, "user")),
    ("assistant", (Recipient.ANSWER, "")),
    ("", (Recipient.ANSWER, "")),
    ("assistant to=functions.get_weather ", (Recipient.TOOL, "functions.get_weather")),
])
def test_recipient_of(header: str, recipient: tuple[Recipient, str]) -> None:
    assert recipient_of(header) == recipient


@pytest.mark.parametrize(("text", "could"), [
    ("", True), ("  assis", True), ("assistant to", True), ("assistant to=get_w", True),
    (" to=self ", True), ("Hello", False), ("assistant hi", False), ("to=a b", False),
    ("to=" + "x" * 300, False),
])
def test_could_be_header(text: str, could: bool) -> None:
    assert could_be_header(text) is could


@pytest.mark.parametrize(("window", "held"), [
    ("abc", ""), ("abc ", " "), ("abc <atem:in", " <atem:in"), ("abc  to=get_w", "  to=get_w"),
    ("abc to=x ", " to=x "), ("cat", "t"), ("abc to=x y", ""), ("a <b>", ""),
])
def test_held_len(window: str, held: str) -> None:
    assert window[len(window) - held_len(window):] == held


def test_resolve_only_collapses_doubled_offered_names() -> None:
    tools = ToolSet([{"name": "a.b", "parameters": {}}, {"name": "c", "parameters": {}}])
    assert tools.resolve("a.b.a.b") == "a.b"
    assert tools.resolve("c.c") == "c"
    assert tools.resolve("x.c") == "x.c"
    assert tools.resolve("b") == "b"
    assert tools.resolve("d.d") == "d.d"


@pytest.mark.parametrize(("prompt", "opened"), [
    ("<|start|>user<|message|>Hi<|eot|><|start|>assistant", None),
    ("<|eot|><|start|>assistant to=self<|message|>", (Recipient.REASONING, "self")),
    ("<|start|>assistant<|message|>\n", (Recipient.ANSWER, "")),
    ("<|start|>user<|message|>", None),  # not an assistant header
    ("", None),
])
def test_opened_message(prompt: str, opened: tuple[Recipient, str] | None) -> None:
    assert opened_message(prompt) == opened
