"""The `<think>` reasoning parser: where reasoning starts and ends, and the reasoning-token
count a caller derives from `reasoning_ended`."""

from __future__ import annotations

import pytest

from shared.parsing import ExtractedMessage, ThinkParser, get_reasoning_parser
from shared.parsing import prompt_opens_reasoning as opens


def both(parser: ThinkParser, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of the complete parse, checked equal to a 1-char stream."""
    whole = parser.parse(text)
    fresh = parser.fresh()
    streamed = ExtractedMessage.join([fresh.feed(c) for c in text] + [fresh.finish()])
    assert streamed == whole
    return whole.reasoning, whole.content


def test_prompt_opens_reasoning_reads_the_last_think_tag() -> None:
    assert opens("<|im_start|>assistant\n<think>\n")
    assert not opens("<|im_start|>assistant\n")
    assert not opens("<think>\n\n</think>\n\n")  # Qwen3 with enable_thinking=False


@pytest.mark.parametrize(("name", "prompt", "text", "expected"), [
    ("qwen3", None, "<think>a</think>b", ("a", "b")),
    ("qwen3", None, "plain", (None, "plain")),
    ("qwen3", "<think>\n", "a</think>b", ("a", "b")),  # the template opened it
    ("deepseek_r1", None, "a</think>b", ("a", "b")),
    ("deepseek_r1", None, "<think>\na</think>b", ("a", "b")),  # R1 before 0528 writes it
    ("deepseek_r1", None, "still thinking", ("still thinking", None)),
    ("deepseek_r1", "no think tag here", "plain", (None, "plain")),
    ("think", None, "</think>b", (None, "b")),  # an empty block the template opened
])
def test_which_text_is_reasoning(name: str, prompt: str | None, text: str,
                                 expected: tuple[str | None, str | None]) -> None:
    parser = get_reasoning_parser(name)(prompt=prompt)
    assert isinstance(parser, ThinkParser)
    assert both(parser, text) == expected


def test_markers_after_the_reasoning_ended_are_content_verbatim() -> None:
    assert both(ThinkParser(), "<think>r</think>c <think>x</think>") == (
        "r", "c <think>x</think>")


def test_a_look_alike_tag_does_not_end_reasoning() -> None:
    assert both(ThinkParser(), "<think>see </thinking> and </th>.</think>ok") == (
        "see </thinking> and </th>.", "ok")


def test_whitespace_at_the_edges_is_trimmed_but_kept_inside() -> None:
    assert both(ThinkParser(), "\n<think>\n\na\n\nb \n</think>\n\n c \n") == ("a\n\nb", "c")


def test_a_partial_end_tag_at_the_end_is_dropped_a_lone_bracket_kept() -> None:
    assert both(ThinkParser(starts_in_reasoning=True), "x </thi") == ("x", None)
    assert both(ThinkParser(starts_in_reasoning=True), "x <") == ("x <", None)
    assert both(ThinkParser(), "<thi") == (None, None)


def test_reasoning_tokens_are_those_fed_before_reasoning_ended() -> None:
    """The caller feeds each token's text and counts it as reasoning while not ended."""
    tokens = ["<think>", "\n", "Two", " plus", " two", ".\n", "</think>", "\n\n", "4", "."]
    parser = ThinkParser()
    counted = 0
    for token in tokens:
        parser.feed(token)
        counted += not parser.reasoning_ended
    assert counted == 6  # <think> .. ".\n"; the closing tag and the answer are not


def test_a_template_opened_reasoning_counts_from_the_first_token() -> None:
    parser = ThinkParser(starts_in_reasoning=True)
    assert not parser.reasoning_ended
    parser.feed("ok")
    assert not parser.reasoning_ended
    parser.feed("</think>")
    assert parser.reasoning_ended


def test_each_step_only_looks_at_a_short_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The end check is incremental: each feed scans held tail + delta, never the whole text,
    however long the reasoning grows (upstream re-decoded everything every step)."""
    import shared.parsing.think as think

    scanned: list[int] = []
    real = think.partial_suffix_len
    monkeypatch.setattr(think, "partial_suffix_len",
                        lambda text, markers: scanned.append(len(text)) or real(text, markers))
    parser = ThinkParser()
    parser.feed("<think>")
    for _ in range(5000):
        parser.feed("abc <")
    assert max(scanned) <= len("abc <") + len("</think>")
