"""Tool parsers off the happy path: malformed, truncated, unknown, unsafe, look-alike input.

The policy under test: a structure that closed but is not a call stays content, verbatim; one
still open at the end of the stream is dropped (never half a call); a call to a tool the
request did not offer is kept, with a warning (vLLM's choice).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from shared.parsing import (
    ExtractedMessage,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    ToolParser,
    ToolSpec,
)
from tests.parsing.fixtures import TOOLS
from tests.parsing.streams import summary


def parse(parser: ToolParser, text: str) -> tuple[Any, ...]:
    """The complete parse, checked equal to a character-by-character stream."""
    whole = summary(parser.parse(text))
    fresh = parser.fresh()
    deltas = [fresh.feed(c) for c in text] + [fresh.finish()]
    assert summary(ExtractedMessage.join(deltas)) == whole
    return whole


def hermes(text: str) -> tuple[Any, ...]:
    return parse(HermesToolParser(TOOLS), text)


def test_hermes_malformed_body_stays_content(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert hermes("a <tool_call>{not json}</tool_call> b") == (
            "a <tool_call>{not json}</tool_call> b", None, ())
    assert "not a call" in caplog.text


def test_hermes_truncated_call_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert hermes('Hi <tool_call>{"name": "get_weather", "argu') == ("Hi", None, ())
    assert "unfinished" in caplog.text


def test_hermes_complete_call_missing_only_its_closing_tag_counts() -> None:
    assert hermes('<tool_call>{"name": "get_weather", "arguments": {}}') == (
        None, None, (("get_weather", {}),))


def test_hermes_accepts_parameters_and_double_encoded_arguments() -> None:
    assert hermes('<tool_call>{"name": "search", "parameters": {"query": "x"}}</tool_call>'
                  '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"y\\"}"}'
                  "</tool_call>") == (None, None, (("search", {"query": "x"}),
                                                    ("search", {"query": "y"})))


def test_hermes_stray_closing_tag_is_dropped() -> None:
    assert hermes("a</tool_call>b") == ("ab", None, ())


def test_hermes_unclosed_call_followed_by_another() -> None:
    assert hermes('<tool_call>{"name": "x", "arguments": {}}<tool_call>'
                  '{"name": "search", "arguments": {}}</tool_call>') == (
        None, None, (("x", {}), ("search", {})))


def test_unknown_tool_is_kept_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert hermes('<tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call>') \
            == (None, None, (("rm_rf", {"path": "/"}),))
    assert "did not offer" in caplog.text


def test_argument_type_mismatch_is_warned_not_rewritten(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        got = hermes('<tool_call>{"name": "get_weather", "arguments": '
                     '{"days": "3", "detailed": 1, "location": "Oslo"}}</tool_call>')
    assert got == (None, None, (("get_weather", {"days": "3", "detailed": 1,
                                                 "location": "Oslo"}),))
    assert "'days' is str" in caplog.text and "'detailed' is int" in caplog.text


def test_llama3_text_then_python_tag_call_and_trailing_text() -> None:
    text = ('Sure.<|python_tag|>{"name": "search", "parameters": {"query": "q"}} '
            "and that is all")
    assert parse(Llama3JsonToolParser(TOOLS), text) == (
        "Sure. and that is all", None, (("search", {"query": "q"}),))


def test_llama3_unclosed_object_is_dropped() -> None:
    assert parse(Llama3JsonToolParser(TOOLS), '{"name": "search", "parameters": {"q') == (
        None, None, ())


def test_llama3_braces_inside_strings_do_not_end_the_object() -> None:
    text = '{"name": "search", "parameters": {"query": "} {\\" }"}}'
    assert parse(Llama3JsonToolParser(TOOLS), text) == (
        None, None, (("search", {"query": '} {" }'}),))


@pytest.mark.parametrize(("text", "expected"), [
    ('[TOOL_CALLS]{"name": "search", "arguments": {"query": "q"}}',
     (None, None, (("search", {"query": "q"}),))),
    ('[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{"query": "q"}',
     (None, None, (("search", {"query": "q"}),))),
    ('[TOOL_CALLS][{"name": "search", "arguments": {}}, {"oops": 1}]',
     ('[TOOL_CALLS][{"name": "search", "arguments": {}}, {"oops": 1}]', None, ())),
    ("[TOOL_CALLS]not a name[ARGS]{}", ("[TOOL_CALLS]not a name[ARGS]{}", None, ())),
    ('[TOOL_CALLS]search[ARGS]{"query": "q', (None, None, ())),
    ('[TOOL_CALLS]search[ARGS] \n{"query": "q"} done', ("done", None, (("search",
                                                                        {"query": "q"}),))),
])
def test_mistral_layouts_and_failures(text: str, expected: tuple[Any, ...]) -> None:
    assert parse(MistralToolParser(TOOLS), text) == expected


@pytest.mark.parametrize("text", [
    '[os.system("rm -rf /")]',  # positional argument
    '[f(a=__import__("os").system("x"))]',  # a call as a value: never evaluated
    "[f(a=1 + 2)]",  # an operator
    "[f(**kwargs)]",
    "[f(a={1, 2})]",  # a set is not JSON
    "[]",
    "[1, 2, 3]",
    "[f(a=1), 2]",
])
def test_pythonic_accepts_literal_keyword_calls_only(text: str) -> None:
    assert parse(PythonicToolParser(TOOLS), text) == (text, None, ())


def test_pythonic_unclosed_list_is_dropped() -> None:
    assert parse(PythonicToolParser(TOOLS), '[get_weather(location="Os') == (None, None, ())


def test_pythonic_prose_is_released_before_the_list_closes() -> None:
    parser = PythonicToolParser(TOOLS)
    assert parser.feed("[Note: this is a long remark").content == "[Note: this is a long remark"


def test_tool_specs_are_validated() -> None:
    assert ToolSpec.from_openai({"name": "f"}) == ToolSpec("f", {})
    for bad in ({"function": {"name": ""}}, {"function": "f"}, {"name": "f", "parameters": 1}):
        with pytest.raises(ValueError):
            ToolSpec.from_openai(bad)


def test_feeding_after_finish_is_refused() -> None:
    parser = HermesToolParser(TOOLS)
    parser.finish()
    assert parser.finish() == type(parser.finish())()  # idempotent
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_arguments_are_serialised_as_json_with_unicode_kept() -> None:
    (call,) = HermesToolParser(TOOLS).parse(
        '<tool_call>{"name": "search", "arguments": {"query": "Zürich ☀"}}</tool_call>'
    ).tool_calls
    assert call.arguments == json.dumps({"query": "Zürich ☀"}, ensure_ascii=False)
