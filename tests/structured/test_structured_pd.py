"""Structured output survives the P/D hand-off: with a json_schema (and a named tool), pull
and push legs give the mixed worker's tokens, greedy and seeded, and hold no block after."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import jsonschema
import pytest

from tests.support.pd import dispatch_pull, dispatch_push, metadata, post, settle_to_zero
from tests.support.pd_mesh import MODEL
from tests.support.worker import WorkerThread

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 12},
    "score": {"type": "integer", "minimum": 1, "maximum": 5},
    "labels": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1,
               "maxItems": 3}},
    "required": ["title", "score", "labels"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA}}
CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Review it."}],
                              "response_format": FORMAT}),
    ("/v1/completions", {"prompt": "A review: " * 20, "guided_json": SCHEMA}),
]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}],
                         ids=["greedy", "seeded"])
async def test_pd_equals_mixed_with_a_json_schema(workers: dict[str, WorkerThread],
                                                  sampling: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as s:
        push_meta = await metadata(s, workers["push_prefill"].url)
        for path, extra in CASES:
            body = {"model": MODEL, "max_tokens": 100, "return_token_ids": True,
                    **sampling, **extra}
            ref = await post(s, workers["mixed"].url + path, body)
            assert ref.status == 200, ref.body
            jsonschema.validate(json.loads(ref.text), SCHEMA)
            pulled = await dispatch_pull(s, workers["prefill"].url, workers["decode"].url,
                                         path, body)
            pushed = await dispatch_push(s, workers["push_prefill"].url,
                                         workers["push_decode"].url, path, body, push_meta)
            for got in (pulled, pushed):
                assert got.status == 200, got.body
                assert got.token_ids == ref.token_ids and got.text == ref.text
        await settle_to_zero(s, *(workers[k].url for k in ("prefill", "decode",
                                                            "push_prefill", "push_decode")))


async def test_pd_stream_with_a_named_tool(workers: dict[str, WorkerThread]) -> None:
    tool = {"type": "function", "function": {"name": "rate", "parameters": SCHEMA}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Rate it."}],
            "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "rate"}},
            "max_tokens": 100, "temperature": 0, "return_token_ids": True}
    async with aiohttp.ClientSession() as s:
        ref = await post(s, workers["mixed"].url + "/v1/chat/completions", body)
        got = await dispatch_pull(s, workers["prefill"].url, workers["decode"].url,
                                  "/v1/chat/completions", {**body, "stream": True})
        assert ref.status == got.status == 200, (ref.body, got.chunks)
        assert got.token_ids == ref.token_ids
        # The grammar's JSON comes back as the call's arguments, streamed whole at the end.
        (call,) = ref.body["choices"][0]["message"]["tool_calls"]
        (streamed,) = [c for chunk in got.chunks for ch in chunk.get("choices", [])
                       for c in (ch.get("delta") or {}).get("tool_calls") or []]
        assert streamed["function"] == call["function"] and call["function"]["name"] == "rate"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
        await settle_to_zero(s, workers["prefill"].url, workers["decode"].url)
