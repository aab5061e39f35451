"""API parity of the mesh: the router serves every request a mixed worker serves.

Tiny random models on real in-process workers (tests.support.pd_mesh), a router in front of a
P/D pair alone and of a P/D pair plus a mixed worker, each answer compared with a separate
mixed worker's. Requests no P/D leg can serve (n>1, several prompts) go whole to one worker
(the mixed one, else the pair's decode, which computes the prompt itself); echo, logprobs,
top_logprobs and best_of stay on P/D. Greedy or seeded, so outputs are
deterministic; after each request the prefill and decode hold no KV block.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.router.app import create_app
from services.router.config import RouterConfig
from services.router.legs import SINGLE_N, SINGLE_PROMPTS, needs_single_worker
from shared.protocol.pd import ApiKind
from tests.support.fake_worker import FakeWorker, Fault
from tests.support.pd import Answer, post, settle_to_zero
from tests.support.pd_mesh import MODEL, make_model, worker_config
from tests.support.worker import WorkerThread, start_workers, stop_all

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {"model": MODEL, "max_tokens": 5, "temperature": 0.0}
CHAT_MESSAGES = [{"role": "user", "content": "Name three colours"}]
SEEDED = {"temperature": 0.8, "seed": 7}

# (name, path, body, served whole on one worker?)
CASES = [
    ("n3_seeded", COMPLETIONS, {**BASE, **SEEDED, "prompt": "Once upon a time", "n": 3}, True),
    ("chat_n3_seeded", CHAT, {**BASE, **SEEDED, "messages": CHAT_MESSAGES, "n": 3}, True),
    ("two_prompts", COMPLETIONS, {**BASE, "prompt": ["The sky is", "Rivers run to"]}, True),
    ("two_id_prompts", COMPLETIONS, {**BASE, "prompt": [[40, 41, 42, 43], [50, 51, 52]]}, True),
    ("echo", COMPLETIONS, {**BASE, "prompt": "Once upon a time", "echo": True}, False),
    ("logprobs", COMPLETIONS, {**BASE, "prompt": "Once upon a time", "logprobs": 2}, False),
    ("chat_top_logprobs", CHAT, {**BASE, "messages": CHAT_MESSAGES, "logprobs": True,
                                 "top_logprobs": 2}, False),
    ("chat_continue_final_message", CHAT, {
        **BASE, "messages": [*CHAT_MESSAGES, {"role": "assistant", "content": "Red,"}],
        "add_generation_prompt": False, "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False}}, False),
    # best_of equal to n changes nothing (more than n is refused: below).
    ("best_of_n", COMPLETIONS, {**BASE, **SEEDED, "prompt": "Once upon a time", "best_of": 1},
     False),
]


@dataclass
class Workers:
    reference: WorkerThread  # a mixed worker alone: what every answer must equal
    prefill: WorkerThread
    decode: WorkerThread
    mixed: WorkerThread  # the mesh's own mixed worker (topology "pd+mixed")


@dataclass
class Router:
    """One in-process router and the topology it fronts."""

    client: TestClient
    with_mixed: bool

    @property
    def url(self) -> str:
        return str(self.client.make_url("")).rstrip("/")


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    model = make_model(tmp_path_factory.mktemp("parity") / "tiny", seed=0)
    started = start_workers({name: worker_config(model, role) for name, role in (
        ("reference", "mixed"), ("prefill", "prefill"), ("decode", "decode"),
        ("mixed", "mixed"))})
    try:
        yield Workers(**started)
    finally:
        stop_all(started)


async def _start_router(workers: Workers, with_mixed: bool) -> TestClient:
    """A router whose every worker is healthy (so a mixed worker is known before routing)."""
    config = RouterConfig(prefill_urls=(workers.prefill.url,), decode_urls=(workers.decode.url,),
                          mixed_urls=(workers.mixed.url,) if with_mixed else (), model=MODEL,
                          health_interval_s=0.05, health_timeout_s=2.0)
    client = TestClient(TestServer(create_app(config), host="127.0.0.1"))
    await client.start_server()
    deadline = asyncio.get_running_loop().time() + 30.0
    while True:
        doc = await (await client.get("/v1/router/metadata")).json()
        if doc["workers"] and all(w["health"] == "healthy" for w in doc["workers"]):
            return client
        assert asyncio.get_running_loop().time() < deadline, f"router never ready: {doc}"
        await asyncio.sleep(0.05)


@pytest.fixture(params=["pd", "pd+mixed"])
async def router(request: pytest.FixtureRequest, workers: Workers) -> AsyncIterator[Router]:
    with_mixed = request.param == "pd+mixed"
    client = await _start_router(workers, with_mixed)
    try:
        yield Router(client, with_mixed)
    finally:
        await client.close()


def _without(doc: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in keys}


def _body_view(doc: dict[str, Any], pd: bool) -> dict[str, Any]:
    """A JSON answer minus what differs between any two requests (id, created). Through P/D
    the router also fills usage.prompt_tokens_details from the prefill leg (documented)."""
    view = _without(doc, "id", "created")
    if pd:
        view["usage"] = _without(view["usage"], "prompt_tokens_details")
    return view


def _stream_view(chunks: list[dict[str, Any]], pd: bool) -> dict[tuple[int, ...], list[Any]]:
    """A stream's chunks per choice index, in order. Choices of one request interleave by timing
    (on a mixed worker alone too), so only the order within a choice is compared. The router
    adds usage.pdmesh (its phases) in every topology; through P/D the prefill's early first
    token chunk carries only the choice, so there only choices and usage are compared."""
    out: dict[tuple[int, ...], list[Any]] = {}
    for chunk in chunks:
        view = _without(chunk, "id", "created")
        if isinstance(view.get("usage"), dict):
            view["usage"] = _without(view["usage"], "pdmesh",
                                     *(("prompt_tokens_details",) if pd else ()))
        if pd:
            view = {"choices": view["choices"], "usage": view.get("usage")}
        out.setdefault(tuple(c["index"] for c in view["choices"]), []).append(view)
    return out


def _same(got: Any, want: Any) -> bool:
    """Equal, floats (logprobs) within 1e-5: a prompt prefix cached on one worker and not on
    the other changes the matmul shapes, hence the last bits of a logprob."""
    if isinstance(got, float) and isinstance(want, float):
        return math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-5)
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in got)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(map(_same, got, want))
    return bool(type(got) is type(want) and got == want)


def _ids(answer: Answer) -> set[str]:
    return {c["id"] for c in answer.chunks} if answer.chunks else {answer.body["id"]}


def _phases(answer: Answer) -> dict[str, Any]:
    if answer.chunks:
        return answer.chunks[-1]["usage"]["pdmesh"]
    return answer.phases


async def _both(session: aiohttp.ClientSession, router: Router, workers: Workers,
                path: str, body: dict[str, Any]) -> tuple[Answer, Answer]:
    got = await post(session, router.url + path, body)
    want = await post(session, workers.reference.url + path, body)
    assert got.status == want.status == 200, (got.status, got.body, want.body)
    return got, want


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("path", "body", "whole"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
async def test_router_answers_as_a_mixed_worker(router: Router, workers: Workers, path: str,
                                                body: dict[str, Any], whole: bool,
                                                stream: bool) -> None:
    request = {**body, "stream": stream}
    if stream:
        request["stream_options"] = {"include_usage": True}
    async with aiohttp.ClientSession() as s:
        got, want = await _both(s, router, workers, path, request)
        pd = not whole
        if stream:
            views = _stream_view(got.chunks, pd), _stream_view(want.chunks, pd)
        else:
            views = _body_view(got.body, pd), _body_view(want.body, pd)
        assert _same(*views), views
        # One id per answer, of the mixed worker's form (cmpl-..., chatcmpl-...).
        assert len(_ids(got)) == 1
        assert next(iter(_ids(got))).split("-")[0] == next(iter(_ids(want))).split("-")[0]
        phases = _phases(got)
        if whole:
            target = "mixed" if router.with_mixed else "decode"
            assert phases["decision"] == "single_worker" and phases["prefill_worker"] is None
            assert phases["decode_worker"].startswith(target + "-")
        else:
            assert phases["decision"] == "prefill_decode"
        await settle_to_zero(s, workers.prefill.url, workers.decode.url)


PD_CASES = [c for c in CASES if not c[3]]


@pytest.mark.parametrize(("path", "body"), [c[1:3] for c in PD_CASES], ids=[c[0] for c in PD_CASES])
async def test_continuous_usage_equals_a_mixed_workers(router: Router, workers: Workers,
                                                       path: str, body: dict[str, Any]) -> None:
    """stream_options.continuous_usage_stats through P/D: the chunks the router makes from the
    prefill's first token (and the role chunk, for chat) and the decode's later ones carry the
    mixed worker's usage, chunk for chunk (the decode counts the prefill's token too), and only
    the final chunk gets the router's phases."""
    request = {**body, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with aiohttp.ClientSession() as s:
        got, want = await _both(s, router, workers, path, request)
        views = _stream_view(got.chunks, True), _stream_view(want.chunks, True)
        assert _same(*views), views
        *chunks, last = got.chunks
        assert all(set(c["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
                   for c in chunks)
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == last["usage"]["completion_tokens"] == 5
        assert last["choices"] == [] and _phases(got)["decision"] == "prefill_decode"
        await settle_to_zero(s, workers.prefill.url, workers.decode.url)


async def test_single_worker_requests_are_counted(router: Router, workers: Workers) -> None:
    async with aiohttp.ClientSession() as s:
        for _, path, body, _ in CASES[:3]:
            got = await post(s, router.url + path, body)
            assert got.status == 200, got.body
        async with s.get(router.url + "/metrics") as resp:
            metrics = await resp.text()
    role = "mixed" if router.with_mixed else "decode"
    assert f'pdmesh:router_single_worker_requests_total{{reason="n",role="{role}"}} 2.0' in metrics
    assert (f'pdmesh:router_single_worker_requests_total{{reason="prompts",role="{role}"}} 1.0'
            in metrics)
    assert 'pdmesh:disagg_decision_total{decision="single_worker"} 3.0' in metrics


@pytest.mark.parametrize("n", [1.5, "3", 0, 10_000])
async def test_a_bad_n_gets_the_mixed_workers_400(router: Router, workers: Workers, n: Any) -> None:
    """Whichever route a malformed `n` takes (1.5 looks like n>1), the answer is the envelope a
    mixed worker gives, never a 500."""
    body = {**BASE, "prompt": "Once upon a time", "n": n}
    async with aiohttp.ClientSession() as s:
        got = await post(s, router.url + COMPLETIONS, body)
        want = await post(s, workers.reference.url + COMPLETIONS, body)
        assert got.status == want.status == 400
        assert got.body == want.body and got.body["error"]["param"] == "n"
        await settle_to_zero(s, workers.prefill.url, workers.decode.url)


def test_needs_single_worker_names_what_no_leg_serves() -> None:
    assert needs_single_worker(ApiKind.COMPLETIONS, {"prompt": "x", "n": 2}) == SINGLE_N
    assert needs_single_worker(ApiKind.CHAT, {"messages": [], "n": 2.0}) == SINGLE_N
    assert needs_single_worker(ApiKind.COMPLETIONS, {"prompt": ["a", "b"]}) == SINGLE_PROMPTS
    assert needs_single_worker(ApiKind.COMPLETIONS, {"prompt": [[1], [2, 3]]}) == SINGLE_PROMPTS
    # One prompt (however spelt), n=1, and what a leg serves like a mixed worker: P/D.
    for body in ({"prompt": "a", "n": 1}, {"prompt": ["a"]}, {"prompt": [1, 2, 3]},
                 {"prompt": [[1, 2]]}, {"prompt": "a", "echo": True, "logprobs": 2},
                 {"prompt": "a", "best_of": 3, "prompt_logprobs": 1}):
        assert needs_single_worker(ApiKind.COMPLETIONS, body) is None
    # Malformed values keep the usual route: the worker's 400 names the field.
    for body in ({"prompt": "a", "n": "3"}, {"prompt": "a", "n": True}, {"prompt": ["a", [1]]},
                 {"prompt": [["a"], ["b"]]}):
        assert needs_single_worker(ApiKind.COMPLETIONS, body) is None
    assert needs_single_worker(ApiKind.CHAT, {"messages": [], "prompt": ["a", "b"]}) is None


async def test_a_failed_mixed_worker_is_retried_on_the_decode(make_mesh) -> None:
    """Fake workers: the whole request never reaches the prefill, reaches the decode without
    kv_transfer_params, and falls back to it when the mixed worker fails."""
    mesh = await make_mesh([FakeWorker("prefill"), FakeWorker("decode"), FakeWorker("mixed")])
    mixed, decode = mesh.role("mixed")[0], mesh.role("decode")[0]
    mixed.faults.append(Fault(status=503))
    body = {"model": "fake-model", "prompt": ["a b", "c d"], "max_tokens": 3}
    resp = await mesh.client.post(COMPLETIONS, json=body)
    assert resp.status == 200, await resp.text()
    phases = json.loads(resp.headers["x-pdmesh-phases"])
    assert (phases["decision"], phases["attempts"]) == ("single_worker", 2)
    assert phases["decode_worker"] == "decode-0" and phases["prefill_worker"] is None
    assert not mesh.role("prefill")[0].calls
    assert [c.body for c in mixed.calls] == [c.body for c in decode.calls] == [body]



@pytest.mark.parametrize(("path", "body", "param"), [
    (COMPLETIONS, {"prompt": "Once upon a time", "best_of": 2}, "best_of"),
    (COMPLETIONS, {"prompt": "Once upon a time", "prompt_logprobs": 1}, "prompt_logprobs"),
    (CHAT, {"messages": CHAT_MESSAGES, "prompt_logprobs": 0}, "prompt_logprobs"),
], ids=["best_of", "prompt_logprobs", "chat_prompt_logprobs"])
async def test_unsupported_fields_get_the_mixed_workers_400(router: Router, workers: Workers,
                                                            path: str, body: dict[str, Any],
                                                            param: str) -> None:
    """What no worker implements (ranking best_of > n candidates, prompt logprobs) is refused
    through P/D with the mixed worker's envelope, rather than ignored."""
    request = {**BASE, **body}
    async with aiohttp.ClientSession() as s:
        got = await post(s, router.url + path, request)
        want = await post(s, workers.reference.url + path, request)
        assert got.status == want.status == 400
        assert got.body == want.body and got.body["error"]["param"] == param
        await settle_to_zero(s, workers.prefill.url, workers.decode.url)
