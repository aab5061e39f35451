"""The channel format's message headers: who a message is addressed to, and where one starts.

A message is `<|start|>assistant to=RECIPIENT<|message|>BODY`; the generation prompt ends in
`<|start|>assistant`, so the first header arrives as ` to=self<|message|>`. `self` is
reasoning, `user` (or no `to=` at all) the answer, any other name a tool. A model sometimes
switches message without closing the last one, writing ` to=NAME<|message|>` straight after
a body: so a body's trailing ` to=NAME` must be held back until it is known not to be one.
"""

from __future__ import annotations

import re
from enum import Enum

from shared.parsing.atem import ATEM_MARKERS
from shared.parsing.markers import partial_suffix_len

START = "<|start|>"
MESSAGE = "<|message|>"
END_OF_MESSAGE = "<|eom|>"
END_OF_TURN = "<|eot|>"
END_OF_TEXT = "<|end_of_text|>"
CONTROL_TOKENS = (START, MESSAGE, END_OF_MESSAGE, END_OF_TURN, END_OF_TEXT)
MAX_HEADER = 256  # header text longer than this is a body written without a header
_TO = "to="
_ASSISTANT = "assistant"
_HEADER_TAIL = re.compile(r"\s*to=([^\s<>]+)\s*\Z")
_NAME = re.compile(r"[^\s<>]*")
_HELD_MARKERS = (*ATEM_MARKERS, _TO)


class Recipient(Enum):
    """What a message body is, by its header."""

    REASONING = "reasoning"  # to=self
    ANSWER = "answer"  # to=user, or a bare `<|start|>assistant<|message|>`
    TOOL = "tool"  # to=any other name: carries ATEM function calls
    UNFRAMED = "unframed"  # text with no header at all: an answer that may carry calls


def recipient_of(header: str) -> tuple[Recipient, str]:
    """The recipient of a complete header's text (what lay between the control tokens)."""
    rest = header.strip()
    if rest.startswith(_ASSISTANT):
        rest = rest[len(_ASSISTANT):].strip()
    name = rest[len(_TO):].strip() if rest.startswith(_TO) else ""
    if name == "self":
        return Recipient.REASONING, name
    if name in ("", "user"):
        return Recipient.ANSWER, name
    return Recipient.TOOL, name


def opened_message(prompt: str) -> tuple[Recipient, str] | None:
    """The recipient of a message the prompt itself opened (it ends in `…to=X<|message|>`),
    so that the generation starts inside that body; None when it opened none."""
    head = prompt.rstrip()
    if not head.endswith(MESSAGE):
        return None
    head = head[:-len(MESSAGE)]
    after_control = max(head.rfind(t) + len(t) if t in head else 0 for t in CONTROL_TOKENS)
    header = head[after_control:]
    return recipient_of(header) if could_be_header(header) else None


def could_be_header(text: str) -> bool:
    """Whether `text` (after `<|start|>`, an end of message, or the start) can still grow into
    a header `[assistant] [to=NAME]`. Once it cannot, it is a body written without one. Only
    the text seen decides, so a stream and a complete parse decide alike."""
    if len(text) > MAX_HEADER:
        return False
    rest = text.lstrip()
    if _ASSISTANT.startswith(rest):
        return True
    if rest.startswith(_ASSISTANT):
        rest = rest[len(_ASSISTANT):].lstrip()
    if _TO.startswith(rest):
        return True
    return rest.startswith(_TO) and _NAME.fullmatch(rest[len(_TO):].rstrip()) is not None


def header_tail(text: str) -> str | None:
    """The NAME of a ` to=NAME` that ends `text` (a header written without `<|start|>`)."""
    match = _HEADER_TAIL.search(text[-MAX_HEADER:])
    return None if match is None else match.group(1)


def held_len(window: str) -> int:
    """How much of the end of an open body's text to hold back: a partial ATEM tag or a
    ` to=NAME` that may still become structure, with the whitespace in front of it.

    The held suffix is suffix-closed (any part of it that was already present was held
    then), so the caller may pass only its previously held text plus the new delta, and the
    released text only ever grows."""
    n = len(window)
    keep = partial_suffix_len(window, _HELD_MARKERS)
    core = window.rstrip()
    start = len(core)  # the last token: `to=NAME` has no whitespace and no `<` `>` in it
    while start > 0 and not core[start - 1].isspace() and core[start - 1] not in "<>":
        start -= 1
    at = core.find(_TO, start)
    if at >= 0:
        keep = max(keep, n - at)
    elif keep == 0:
        keep = n - len(core)
    begin = n - keep
    while begin > 0 and window[begin - 1].isspace():
        begin -= 1
    return n - begin
