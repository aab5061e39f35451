"""Every fixture parses, complete, to the message written by hand beside it."""

from __future__ import annotations

import json
import re

import pytest

from tests.parsing.fixtures import ALL, Fixture
from tests.parsing.streams import build, expected, stream, summary

ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")


@pytest.mark.parametrize("fixture", ALL, ids=lambda f: f.id)
def test_complete_text_parses_to_the_expected_message(fixture: Fixture) -> None:
    assert summary(build(fixture).parse(fixture.text)) == expected(fixture)


@pytest.mark.parametrize("fixture", [f for f in ALL if f.calls], ids=lambda f: f.id)
def test_calls_have_fresh_ids_and_json_object_arguments(fixture: Fixture) -> None:
    parser = build(fixture)
    first = parser.parse(fixture.text).tool_calls
    again = parser.parse(fixture.text).tool_calls
    ids = [c.id for c in first + again]
    assert all(ID.fullmatch(i) for i in ids)
    assert len(set(ids)) == len(ids)  # fresh per call and per parse
    assert all(isinstance(json.loads(c.arguments), dict) for c in first)


@pytest.mark.parametrize("fixture", ALL, ids=lambda f: f.id)
def test_parse_leaves_the_stream_state_alone(fixture: Fixture) -> None:
    """parse() works on fresh parsers: the same object can still stream the request."""
    parser = build(fixture)
    parser.parse(fixture.text)
    assert summary(stream(parser, [fixture.text])) == expected(fixture)
