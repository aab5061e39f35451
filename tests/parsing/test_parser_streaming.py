"""Streaming adds up to the complete parse however the text is split, and never leaks markup.

Every fixture is fed split at every boundary (two pieces), in chunks of 1 to 64 characters,
and in random chunkings (hypothesis); the deltas must add up to the hand-written message.
Fed character by character, what was released after each step must be a prefix of the final
content / reasoning / calls (released text only grows) and hold no marker text; and a parser
fed only a prefix of the text must not have released any marker text either.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.parsing import DeltaMessage, ExtractedMessage
from tests.parsing.fixtures import ALL, LEAK_MARKERS, Fixture
from tests.parsing.streams import build, chunked, expected, stream, summary

IDS = {"ids": lambda f: f.id}


def _leaks(text: str) -> list[str]:
    return [m for m in LEAK_MARKERS if m in text]


@pytest.mark.parametrize("fixture", ALL, **IDS)
def test_every_two_piece_split_gives_the_same_message(fixture: Fixture) -> None:
    text = fixture.text
    for cut in range(len(text) + 1):
        got = summary(stream(build(fixture), [text[:cut], text[cut:]]))
        assert got == expected(fixture), f"split at {cut}: {text[:cut]!r} | {text[cut:]!r}"


@pytest.mark.parametrize("fixture", ALL, **IDS)
def test_every_chunk_size_gives_the_same_message(fixture: Fixture) -> None:
    for size in range(1, 65):
        got = summary(stream(build(fixture), chunked(fixture.text, size)))
        assert got == expected(fixture), f"chunks of {size}"


@pytest.mark.parametrize("fixture", ALL, **IDS)
def test_released_text_only_grows_and_never_holds_markup(fixture: Fixture) -> None:
    content, reasoning, calls = expected(fixture)
    parser = build(fixture)
    deltas: list[DeltaMessage] = []
    for i, char in enumerate(fixture.text):
        deltas.append(parser.feed(char))
        got = ExtractedMessage.join(deltas)
        seen = fixture.text[:i + 1]
        assert (content or "").startswith(got.content or ""), seen
        assert (reasoning or "").startswith(got.reasoning or ""), seen
        assert summary(got)[2] == calls[:len(got.tool_calls)], seen
        assert not _leaks((got.content or "") + (got.reasoning or "")), seen


@pytest.mark.parametrize("fixture", ALL, **IDS)
def test_a_truncated_stream_releases_no_markup(fixture: Fixture) -> None:
    """A parser fed only a prefix (as when the length limit cuts the text) has released no
    marker text: not before finish, nor after it (partial markers are dropped at the end)."""
    for cut in range(len(fixture.text) + 1):
        parser = build(fixture)
        before = parser.feed(fixture.text[:cut])
        assert not _leaks(before.content + before.reasoning), fixture.text[:cut]
        after = parser.finish()
        assert not _leaks(before.content + after.content + before.reasoning + after.reasoning)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_chunkings_give_the_same_message(data: st.DataObject) -> None:
    fixture = data.draw(st.sampled_from(ALL))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(fixture.text)), max_size=12)))
    pieces = [fixture.text[a:b] for a, b in zip([0, *cuts], [*cuts, len(fixture.text)],
                                                  strict=True)]
    assert summary(stream(build(fixture), pieces)) == expected(fixture)
