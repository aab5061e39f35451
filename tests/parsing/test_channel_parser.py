"""The channel parser, rule by rule (vLLM #51655's format): segment into bodies, then select.

Each rule is checked on the complete text and streamed one character at a time (the two must
agree); the expected messages are written by hand.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from shared.parsing import ChannelParser, ExtractedMessage
from tests.parsing.fixtures import TOOLS
from tests.parsing.streams import summary

SELF = "<|start|>assistant to=self<|message|>"
USER = "<|start|>assistant to=user<|message|>"


def tool(name: str) -> str:
    return f"<|start|>assistant to={name}<|message|>"


def invoke(name: str, **params: str) -> str:
    body = "".join(f'<atem:parameter name="{k}">{v}</atem:parameter>' for k, v in params.items())
    return f'<atem:function_calls><atem:invoke name="{name}">{body}</atem:invoke>' \
           '</atem:function_calls>'


def parse(text: str, tools: list[dict[str, Any]] | None = None) -> tuple[Any, ...]:
    """The complete parse, checked equal to a character-by-character stream."""
    parser = ChannelParser(TOOLS if tools is None else tools)
    whole = summary(parser.parse(text))
    deltas = [parser.feed(c) for c in text] + [parser.finish()]
    assert summary(ExtractedMessage.join(deltas)) == whole
    return whole


def test_reasoning_tool_and_answer_bodies_are_routed_by_recipient() -> None:
    text = (f"{SELF}Think.<|eom|>{tool('get_current_time')}"
            f"{invoke('get_current_time', timezone='UTC')}<|eom|>{USER}Answer.<|eot|>")
    assert parse(text) == ("Answer.", "Think.", (("get_current_time", {"timezone": "UTC"}),))


def test_a_bare_header_is_the_answer() -> None:
    assert parse("<|start|>assistant<|message|>Hello.<|eot|>") == ("Hello.", None, ())
    assert parse("<|message|>Hello.<|eot|>") == ("Hello.", None, ())  # prompt said assistant


def test_a_missing_eom_cannot_swallow_the_next_tool_message() -> None:
    text = (f"{SELF}Two calls.{tool('get_current_time')}"
            f"{invoke('get_current_time', timezone='UTC')}"  # no <|eom|>
            f"{tool('get_weather')}{invoke('get_weather', location='Oslo')}<|eom|>")
    assert parse(text) == (None, "Two calls.", (("get_current_time", {"timezone": "UTC"}),
                                                ("get_weather", {"location": "Oslo"})))


def test_a_stray_start_cuts_the_body() -> None:
    text = f"{SELF}thinking<|start|>assistant to=user<|message|>answer<|eot|>"
    assert parse(text) == ("answer", "thinking", ())


def test_a_body_ends_at_eot_and_text_after_the_turn_is_an_unframed_answer() -> None:
    text = f"{USER}first<|eot|>second"
    assert parse(text) == ("first\n\nsecond", None, ())


def test_a_header_written_without_closing_the_body_switches_message() -> None:
    text = " to=self<|message|>I know it. to=user<|message|>It is 4.<|eot|>"
    assert parse(text) == ("It is 4.", "I know it.", ())


def test_a_stray_message_token_in_a_body_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert parse(f"{USER}a<|message|>b<|eot|>") == ("ab", None, ())
    assert "stray" in caplog.text


def test_tool_bodies_are_joined_in_order_and_cut_invokes_never_stitch(
        caplog: pytest.LogCaptureFixture) -> None:
    """An invoke cut by the next header is dropped: it must not merge with the next body's."""
    text = (f"{tool('get_weather')}<atem:function_calls><atem:invoke name=\"get_weather\">"
            f'<atem:parameter name="location">Par'  # cut here
            f"{tool('get_weather')}{invoke('get_weather', location='Rome')}<|eom|>"
            f"{tool('get_current_time')}{invoke('get_current_time', timezone='UTC')}<|eom|>")
    with caplog.at_level(logging.WARNING):
        assert parse(text) == (None, None, (("get_weather", {"location": "Rome"}),
                                            ("get_current_time", {"timezone": "UTC"})))
    assert "never closed" in caplog.text


def test_calls_stream_whole_with_indices_in_order() -> None:
    text = (f"{tool('get_weather')}{invoke('get_weather', location='A')}"
            f"{invoke('get_weather', location='B')}<|eom|>"
            f"{tool('search')}{invoke('search', query='q')}<|eom|>")
    parser = ChannelParser(TOOLS)
    calls = [c for ch in text for c in parser.feed(ch).tool_calls] + list(
        parser.finish().tool_calls)
    assert [c.index for c in calls] == [0, 1, 2]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"location": "A"}), ("get_weather", {"location": "B"}),
        ("search", {"query": "q"})]


def test_a_call_is_released_the_moment_its_invoke_closes() -> None:
    parser = ChannelParser(TOOLS)
    text = tool("get_current_time") + invoke("get_current_time", timezone="UTC")
    cut = text.index("</atem:invoke>") + len("</atem:invoke>")
    assert not parser.feed(text[:cut - 1]).tool_calls
    assert len(parser.feed(text[cut - 1]).tool_calls) == 1


def test_markup_without_framing_is_scanned_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """skip_special_tokens stripped the control tokens: the whole text is scanned."""
    text = "Checking. " + invoke("get_weather", location="Oslo") + " Done."
    with caplog.at_level(logging.WARNING):
        assert parse(text) == ("Checking.  Done.", None, (("get_weather", {"location": "Oslo"}),))
    assert "skip_special_tokens" in caplog.text
    assert ChannelParser.requires_special_tokens  # which is why the parser asks to keep them


def test_plain_text_without_framing_is_content_without_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert parse("Just an answer, 1 < 2.") == ("Just an answer, 1 < 2.", None, ())
    assert not caplog.text


@pytest.mark.parametrize(("written", "offered", "called"), [
    ("get_weather.get_weather", "get_weather", "get_weather"),  # doubled x.x collapses
    ("calendar.get.calendar.get", "calendar.get", "calendar.get"),
    ("weather.get", "calendar.get", "weather.get"),  # never by suffix
    ("get.get", "calendar.get", "get.get"),  # a doubled name not offered stays
    ("ns.get_weather", "get_weather", "ns.get_weather"),  # no prefix stripping either
])
def test_name_normalisation_only_collapses_a_doubled_name(written: str, offered: str,
                                                          called: str) -> None:
    tools = [{"name": offered, "parameters": {}}]
    text = tool("x") + invoke(written, a="1")
    assert parse(text, tools) == (None, None, ((called, {"a": 1}),))


def test_unknown_names_are_kept_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert parse(tool("x") + invoke("weather.get"), TOOLS) == (
            None, None, (("weather.get", {}),))
    assert "did not offer" in caplog.text


def test_declared_strings_stay_strings_and_other_values_decode_as_json() -> None:
    text = tool("search") + invoke("search", query='{"a": 1}', filters='{"b": [1, 2]}',
                                   limit="10", extra="[1, 2]", other="not json", nan="NaN")
    assert parse(text) == (None, None, (("search", {
        "query": '{"a": 1}', "filters": {"b": [1, 2]}, "limit": 10, "extra": [1, 2],
        "other": "not json", "nan": "NaN"}),))


def test_a_string_parameter_keeps_its_text_verbatim() -> None:
    text = tool("search") + invoke("search", query=' 42 \n"quoted" ')
    assert parse(text) == (None, None, (("search", {"query": ' 42 \n"quoted" '}),))


def test_a_swallowed_parameter_opening_tag_still_yields_the_argument() -> None:
    text = (tool("get_weather") + '<atem:function_calls><atem:invoke name="get_weather">'
            'name="location">Oslo</atem:parameter>'
            '<atem:parameter name="days">3</atem:parameter></atem:invoke></atem:function_calls>')
    assert parse(text) == (None, None, (("get_weather", {"location": "Oslo", "days": 3}),))


def test_a_tool_channel_without_a_complete_invoke_gives_content_only(
        caplog: pytest.LogCaptureFixture) -> None:
    text = (f"{SELF}Call it.<|eom|>{tool('get_weather')}<atem:function_calls>"
            f'<atem:invoke name="get_weather"><atem:parameter name="location">Os<|eom|>'
            f"{USER}Sorry, no call.<|eot|>")
    with caplog.at_level(logging.WARNING):
        assert parse(text) == ("Sorry, no call.", "Call it.", ())
    assert "without a complete invoke" in caplog.text


def test_a_truncated_invoke_at_the_end_emits_no_half_call() -> None:
    parser = ChannelParser(TOOLS)
    text = tool("get_weather") + invoke("get_weather", location="Oslo")
    cut = text.index("</atem:invoke>")
    assert parser.feed(text[:cut]) == parser.finish() == type(parser.finish())()


@pytest.mark.parametrize("partial", ["<atem:func", "</atem:inv", "<atem:parameter na"[:12]])
def test_an_open_body_holds_back_partial_function_call_tags(partial: str) -> None:
    """vLLM #55395: fragments of ATEM tags leaked into content while the tag was split."""
    parser = ChannelParser(TOOLS)
    assert parser.feed(f"{USER}Answer {partial}").content == "Answer"
    assert parser.feed("x").content == f" {partial}x"


def test_an_open_body_holds_back_a_trailing_recipient() -> None:
    parser = ChannelParser(TOOLS)
    assert parser.feed(" to=self<|message|>Let me think to=get_wea").reasoning == "Let me think"
    assert parser.feed("ther").reasoning == ""
    assert parser.feed(" more").reasoning == " to=get_weather more"


def test_a_closed_body_ending_in_a_partial_tag_is_not_held_forever() -> None:
    parser = ChannelParser(TOOLS)
    first = parser.feed(f"{USER}1 <")
    assert first.content == "1"
    assert parser.feed("<|eot|>").content == " <"  # the body closed: nothing is held any more


def test_reasoning_ended_follows_the_open_body() -> None:
    parser = ChannelParser(TOOLS)
    states = []
    for piece in [" to=self", "<|message|>", "hm", "<|eom|>", "<|start|>assistant to=user",
                  "<|message|>", "ok", "<|eot|>"]:
        parser.feed(piece)
        states.append(parser.reasoning_ended)
    assert states == [True, False, False, True, True, True, True, True]


def test_invoke_interrupted_by_another_invoke_is_dropped() -> None:
    text = (tool("get_weather") + '<atem:function_calls><atem:invoke name="get_weather">'
            '<atem:parameter name="location">X</atem:parameter>'
            + invoke("get_weather", location="Y")[len("<atem:function_calls>"):])
    assert parse(text) == (None, None, (("get_weather", {"location": "Y"}),))


def test_a_prompt_that_opened_the_reasoning_body_starts_inside_it() -> None:
    prompt = "<|start|>user<|message|>Hi<|eot|><|start|>assistant to=self<|message|>"
    parser = ChannelParser(TOOLS, prompt=prompt)
    assert not parser.reasoning_ended
    text = f"Thinking.<|eom|>{USER}Hello.<|eot|>"
    assert summary(parser.parse(text)) == ("Hello.", "Thinking.", ())
    deltas = [parser.feed(c) for c in text] + [parser.finish()]
    assert summary(ExtractedMessage.join(deltas)) == ("Hello.", "Thinking.", ())
    usual = ChannelParser(TOOLS, prompt="<|start|>user<|message|>Hi<|eot|><|start|>assistant")
    assert summary(usual.parse(f" to=self<|message|>T.<|eom|>{USER}H.")) == ("H.", "T.", ())
