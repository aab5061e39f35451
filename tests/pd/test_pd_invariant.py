"""The P/D invariant: prefill -> KV transfer -> decode gives the mixed worker's output, token
for token, in pull and push mode, with prefix caching on on both sides.

The reference is a `--role mixed` worker on the same checkpoint. The decode's answer alone is
the whole completion (it starts with the prefill's first token), and `return_token_ids` works
on both legs.
"""

from __future__ import annotations

import random
import re

import aiohttp
import pytest

from tests.support.pd import Answer, dispatch_pull, dispatch_push, metadata, post, settle_to_zero
from tests.support.pd_mesh import MODEL, Mesh

LENGTHS = (1, 15, 16, 17, 200, 2000)
BLOCK = 16
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def prompt(length: int, salt: int = 0) -> list[int]:
    rng = random.Random(length * 7919 + salt)
    return [rng.randrange(100, 40000) for _ in range(length)]


async def dispatch(session: aiohttp.ClientSession, mesh: Mesh, mode: str, path: str,
                   body: dict) -> Answer:
    if mode == "pull":
        return await dispatch_pull(session, mesh.prefill.url, mesh.decode.url, path, body)
    meta = await metadata(session, mesh.push_prefill.url)
    return await dispatch_push(session, mesh.push_prefill.url, mesh.push_decode.url, path, body,
                               meta)


def legs(mesh: Mesh, mode: str) -> tuple[str, str]:
    if mode == "pull":
        return mesh.prefill.url, mesh.decode.url
    return mesh.push_prefill.url, mesh.push_decode.url


async def prefix_cache_hits(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    match = re.search(r'^pdmesh:prefix_cache_hits_total\{model_name="tiny"\} (\S+)$', text, re.M)
    assert match, "prefix-cache counter missing"
    return float(match.group(1))


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_greedy_pd_equals_mixed_for_every_prompt_length(mesh: Mesh, mode: str) -> None:
    prefill_url, decode_url = legs(mesh, mode)
    async with aiohttp.ClientSession() as s:
        for length in LENGTHS:
            body = {"model": MODEL, "prompt": prompt(length), "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            ref = await post(s, mesh.mixed.url + COMPLETIONS, body)
            assert ref.status == 200, ref.body
            assert len(set(ref.token_ids)) > 3  # a model whose output depends on its input
            for attempt in range(2):  # the second run hits the prefill's prefix cache
                got = await dispatch(s, mesh, mode, COMPLETIONS, body)
                assert got.status == 200, got.body
                assert got.token_ids == ref.token_ids, (mode, length, attempt)
                assert got.phases["kv_recomputed"] is False and got.phases["kv_bytes"] > 0
                assert got.text == ref.text and got.body["usage"] == ref.body["usage"]
                choice, pre = got.body["choices"][0], got.prefill["choices"][0]
                assert choice["prompt_token_ids"] == pre["prompt_token_ids"] == prompt(length)
                assert pre["token_ids"] == ref.token_ids[:1]
                cached = got.prefill["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached == (attempt * ((length - 1) // BLOCK) * BLOCK)
                if mode == "push":  # blocks written while the prompt computed, then the rest
                    overlap = got.prefill["kv_transfer_params"]["push_overlap"]
                    assert overlap["blocks"] == -(-length // BLOCK)
                    assert 0 <= overlap["early_blocks"] < overlap["blocks"]
            # The transferred blocks entered the decode's own prefix cache with the right KV: a
            # plain request there reuses them and still gives the mixed output.
            hits = await prefix_cache_hits(s, decode_url)
            plain = await post(s, decode_url + COMPLETIONS, body)
            assert plain.token_ids == ref.token_ids
            assert await prefix_cache_hits(s, decode_url) - hits == (length - 1) // BLOCK * BLOCK
        await settle_to_zero(s, prefill_url, decode_url)


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_seeded_sampling_pd_equals_mixed(mesh: Mesh, mode: str) -> None:
    async with aiohttp.ClientSession() as s:
        for length, seed in ((1, 7), (17, 1234), (200, 99)):
            body = {"model": MODEL, "prompt": prompt(length, salt=1), "max_tokens": 10,
                    "temperature": 0.8, "seed": seed, "ignore_eos": True,
                    "return_token_ids": True}
            ref = await post(s, mesh.mixed.url + COMPLETIONS, body)
            other = await post(s, mesh.mixed.url + COMPLETIONS, {**body, "seed": seed + 1})
            assert other.token_ids != ref.token_ids  # the seed matters: a real sampling check
            got = await dispatch(s, mesh, mode, COMPLETIONS, body)
            assert got.status == 200, got.body
            assert got.token_ids == ref.token_ids, (mode, length)
        await settle_to_zero(s, *legs(mesh, mode))


def _logprob_rows(answer: Answer) -> list[tuple[str, float, list[str]]]:
    if answer.chunks:
        content = [e for c in answer.chunks for ch in c["choices"]
                   for e in (ch.get("logprobs") or {}).get("content") or []]
    else:
        content = answer.body["choices"][0]["logprobs"]["content"]
    return [(e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]]) for e in content]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("stream", [False, True])
async def test_chat_with_logprobs_streamed_or_not(mesh: Mesh, mode: str, stream: bool) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about KV caches."}],
            "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "return_token_ids": True}
    async with aiohttp.ClientSession() as s:
        ref = await post(s, mesh.mixed.url + CHAT, body)
        got = await dispatch(s, mesh, mode, CHAT, {**body, "stream": stream})
        assert got.status == 200, got.body
        assert got.token_ids == ref.token_ids and got.text == ref.text
        mine, theirs = _logprob_rows(got), _logprob_rows(ref)
        assert [(t, top) for t, _, top in mine] == [(t, top) for t, _, top in theirs]
        assert [lp for _, lp, _ in mine] == pytest.approx([lp for _, lp, _ in theirs], abs=1e-4)
        if stream:  # the decode's stream starts with the role, then the prefill's first token
            assert got.chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            first_text = got.prefill["choices"][0]["message"]["content"]
            assert got.chunks[1]["choices"][0]["delta"]["content"] == first_text
        await settle_to_zero(s, *legs(mesh, mode))


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_decode_stream_usage_counts_the_prefills_token(mesh: Mesh, mode: str) -> None:
    """With continuous usage the decode's stream, which starts with the prefill's first token,
    reports the mixed worker's counts chunk for chunk (the router's early chunks, checked in
    tests/router/test_router_api_parity.py, stand in for its first ones)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count the tokens."}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with aiohttp.ClientSession() as s:
        ref = await post(s, mesh.mixed.url + CHAT, body)
        got = await dispatch(s, mesh, mode, CHAT, body)
        assert got.status == ref.status == 200, got.body
        assert [c["usage"] for c in got.chunks] == [c["usage"] for c in ref.chunks]
        counts = [c["usage"]["completion_tokens"] for c in got.chunks if c["choices"]]
        assert counts[:3] == [0, 1, 2] and counts[-1] == got.chunks[-1]["usage"][
            "completion_tokens"] == 6
        await settle_to_zero(s, *legs(mesh, mode))


async def test_one_token_completion_is_just_the_prefills_token(mesh: Mesh) -> None:
    body = {"model": MODEL, "prompt": prompt(33), "max_tokens": 1, "temperature": 0,
            "return_token_ids": True}
    async with aiohttp.ClientSession() as s:
        ref = await post(s, mesh.mixed.url + COMPLETIONS, body)
        for mode in ("pull", "push"):
            got = await dispatch(s, mesh, mode, COMPLETIONS, body)
            assert got.status == 200 and got.token_ids == ref.token_ids
            assert got.body["choices"][0]["finish_reason"] == "length"
        await settle_to_zero(s, *legs(mesh, "pull"), *legs(mesh, "push"))


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_logit_bias_applies_on_both_legs(mesh: Mesh, mode: str) -> None:
    """The prefill samples the first token and the decode the rest: both apply logit_bias, so
    P/D still gives the mixed output, and the bias really moved it (it bans the unbiased first
    and second tokens)."""
    body = {"model": MODEL, "prompt": prompt(40, salt=3), "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    async with aiohttp.ClientSession() as s:
        plain = await post(s, mesh.mixed.url + COMPLETIONS, body)
        banned = {str(t): -100 for t in plain.token_ids[:2]}
        biased = {**body, "logit_bias": banned}
        ref = await post(s, mesh.mixed.url + COMPLETIONS, biased)
        assert ref.status == 200, ref.body
        assert not set(ref.token_ids) & set(plain.token_ids[:2])
        got = await dispatch(s, mesh, mode, COMPLETIONS, biased)
        assert got.status == 200, got.body
        assert got.token_ids == ref.token_ids
        assert got.prefill["choices"][0]["token_ids"] == ref.token_ids[:1]
        await settle_to_zero(s, *legs(mesh, mode))
