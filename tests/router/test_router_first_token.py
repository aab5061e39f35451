"""Early first-token chunks and cutting that token out of the decode's stream (pure)."""

from __future__ import annotations

import copy

from services.common.stream_usage import StreamUsage
from services.router.first_token import FirstTokenSkipper, early_chunks
from services.router.legs import can_stream_first_token_early, decode_body, prefill_body
from shared.protocol.pd import ApiKind

CHAT_PREFILL = {"id": "p1", "created": 1, "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "Hel"}, "finish_reason": "length",
     "logprobs": {"content": [{"token": "Hel", "logprob": -0.1}]}, "token_ids": [7]}]}


def _delta(content, role=None, lp=None, ids=None, finish=None, index=0):
    delta = {"content": content}
    if role:
        delta["role"] = role
    choice = {"index": index, "delta": delta, "finish_reason": finish,
              "logprobs": {"content": lp} if lp is not None else None}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "d1", "choices": [choice]}


def test_chat_early_chunks_are_role_then_first_token():
    chunks = early_chunks(ApiKind.CHAT, CHAT_PREFILL, StreamUsage(include_usage=True))
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "Hel"}]
    assert chunks[1]["choices"][0]["token_ids"] == [7]
    assert all(c["usage"] is None and c["id"] == "p1" for c in chunks)


def test_early_chunks_carry_continuous_usage_as_a_mixed_worker_counts():
    """The role chunk counts no output (as vLLM), the first token's chunk one; the prompt's
    count is the prefill's. Without include_usage, continuous_usage_stats is ignored."""
    usage = StreamUsage.of(include_usage=True, continuous_usage_stats=True)
    chunks = early_chunks(ApiKind.CHAT, CHAT_PREFILL, usage, num_prompt_tokens=11)
    assert [c["usage"] for c in chunks] == [
        {"prompt_tokens": 11, "completion_tokens": 0, "total_tokens": 11},
        {"prompt_tokens": 11, "completion_tokens": 1, "total_tokens": 12}]
    completion = {**CHAT_PREFILL, "choices": [{"index": 0, "text": "Hel", "logprobs": None}]}
    [chunk] = early_chunks(ApiKind.COMPLETIONS, completion, usage, num_prompt_tokens=3)
    assert chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    ignored = StreamUsage.of(include_usage=False, continuous_usage_stats=True)
    assert not ignored.continuous
    assert all("usage" not in c for c in early_chunks(ApiKind.CHAT, CHAT_PREFILL, ignored, 11))
    assert StreamUsage.from_body({"stream_options": {"include_usage": True,
                                                     "continuous_usage_stats": True}}) == usage
    assert StreamUsage.from_body({"stream_options": {"continuous_usage_stats": True}}) == ignored


def test_skipper_drops_the_decodes_copies_even_with_continuous_usage():
    """The decode's role and first-token chunks carry usage too; cut to nothing they are
    dropped (the client got those counts early), not sent on as choice-less usage chunks."""
    skip = FirstTokenSkipper(ApiKind.CHAT, CHAT_PREFILL)
    role = _delta("", role="assistant", lp=[], ids=[])
    role["usage"] = {"prompt_tokens": 11, "completion_tokens": 0, "total_tokens": 11}
    assert skip.apply(role) is None
    first = _delta("Hel", lp=[{"token": "Hel"}], ids=[7])
    first["usage"] = {"prompt_tokens": 11, "completion_tokens": 1, "total_tokens": 12}
    assert skip.apply(first) is None and skip.done


def test_skipper_cuts_text_logprobs_and_ids_of_the_first_token_only():
    skip = FirstTokenSkipper(ApiKind.CHAT, CHAT_PREFILL)
    assert skip.apply(_delta("", role="assistant", lp=[], ids=[])) is None
    first = skip.apply(_delta("Hel", lp=[{"token": "Hel"}], ids=[7]))
    assert first is None and skip.done
    nxt = _delta("lo", lp=[{"token": "lo"}], ids=[8])
    assert skip.apply(copy.deepcopy(nxt)) == nxt


def test_skipper_splits_a_chunk_that_carries_more_than_the_first_token():
    skip = FirstTokenSkipper(ApiKind.COMPLETIONS, {"choices": [{"index": 0, "text": "ab"}]})
    out = skip.apply({"choices": [{"index": 0, "text": "abcd", "finish_reason": None}]})
    assert out["choices"][0]["text"] == "cd" and skip.done


def test_skipper_keeps_a_finish_chunk_and_usage_and_other_choices():
    prefill = {"choices": [{"index": 0, "text": "x"}, {"index": 1, "text": "y"}]}
    skip = FirstTokenSkipper(ApiKind.COMPLETIONS, prefill)
    out = skip.apply({"choices": [{"index": 0, "text": "x", "finish_reason": "stop"},
                                  {"index": 1, "text": "y"}]})
    assert out["choices"] == [{"index": 0, "text": "", "finish_reason": "stop"}]
    assert skip.done
    usage = {"choices": [], "usage": {"prompt_tokens": 1}}
    assert skip.apply(dict(usage)) == usage


def test_completion_logprob_lists_are_cut_in_parallel():
    prefill = {"choices": [{"index": 0, "text": "a", "logprobs": {"tokens": ["a"]}}]}
    skip = FirstTokenSkipper(ApiKind.COMPLETIONS, prefill)
    out = skip.apply({"choices": [{"index": 0, "text": "ab", "logprobs": {
        "tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "top_logprobs": [{}, {}],
        "text_offset": [0, 1]}}]})
    assert out["choices"][0]["logprobs"] == {"tokens": ["b"], "token_logprobs": [-2.0],
                                             "top_logprobs": [{}], "text_offset": [1]}


def test_prefill_and_decode_bodies():
    body = {"prompt": "p", "max_tokens": 9, "max_completion_tokens": 9, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 2,
            "min_completion_tokens": 2, "nested": {"a": 1}}
    pre = prefill_body(body, {"do_remote_decode": True})
    assert pre == {"prompt": "p", "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                   "nested": {"a": 1}, "kv_transfer_params": {"do_remote_decode": True}}
    assert body["max_tokens"] == 9 and "kv_transfer_params" not in body  # not mutated
    assert decode_body(body, {"k": 1}) == {**body, "kv_transfer_params": {"k": 1}}
    assert decode_body(body, None) == body
    assert can_stream_first_token_early(body)
    assert not can_stream_first_token_early({**body, "stop": ["x"]})
    assert not can_stream_first_token_early({**body, "echo": True})
