"""The router's own prompt tokenisation (services/router/tokens.py), used for routing decisions:
a chat request renders with the options the worker will use, so prefix-aware routing and the
disaggregation threshold see the prompt the worker computes."""

from __future__ import annotations

import pytest

from services.router.tokens import _encode_local
from shared.protocol.pd import ApiKind
from tests.support.fake_engine import FakeTokenizer

MESSAGES = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Once"}]


def _worker_ids(**options: object) -> list[int]:
    tok = FakeTokenizer()
    return tok.encode(tok.apply_chat_template(MESSAGES, **options), False)


def test_chat_renders_with_the_requests_template_options() -> None:
    tok = FakeTokenizer()
    assert _encode_local(tok, ApiKind.CHAT, {"messages": MESSAGES}) == _worker_ids()
    body = {"messages": MESSAGES, "add_generation_prompt": False,
            "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}}
    assert _encode_local(tok, ApiKind.CHAT, body) == _worker_ids(
        add_generation_prompt=False, continue_final_message=True, enable_thinking=False)
    assert _encode_local(tok, ApiKind.CHAT, {**body, "chat_template_kwargs": "odd"}) == (
        _worker_ids(add_generation_prompt=False, continue_final_message=True))


def test_a_clashing_template_variable_raises_for_the_caller_to_drop() -> None:
    """The caller routes without token ids then; the worker's 400 names the field."""
    body = {"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}}
    with pytest.raises(TypeError):
        _encode_local(FakeTokenizer(), ApiKind.CHAT, body)
