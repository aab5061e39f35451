"""Property tests over the msgpack KV protocol, through its public API only.

For every registered message type: valid messages round-trip (bare, sealed in an envelope and
as a frame header); truncated bytes, arbitrary bytes, wrong field types, unknown and missing
fields, oversized headers and other protocol versions raise the codec's `ProtocolError` and
no other exception. Against live KV services (a pull prefill and a push decode): the same
bodies posted to every route get a 4xx with an error envelope (never a 5xx; 413 past the
body limit), HMAC-signed requests pass the signature check only when signed with the right
secret over the exact bytes sent, and the services stay healthy with no block held.
"""

from __future__ import annotations

import asyncio
import dataclasses
import types
from collections.abc import Iterator
from typing import Any, Union, get_args, get_origin, get_type_hints

import aiohttp
import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from services.common.signing import NONCE_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from shared.protocol.codec import (
    KV_PROTOCOL_VERSION,
    MAX_HEADER_BYTES,
    EnvelopeReader,
    FrameReader,
    Message,
    ProtocolError,
    decode,
    decode_any,
    encode,
    frame_header,
    from_fields,
    seal,
    to_fields,
)
from shared.protocol.messages import NodeInfo, TensorChunk, TokenLogprobWire
from shared.protocol.pd import KVTransferParams
from tests.support.kv import Node, assert_no_leaks, start_node

SECRET = b"fuzz-secret-of-16+bytes"
ROUTES = ("/kv/v1/handshake", "/kv/v1/pull", "/kv/v1/release", "/kv/v1/heartbeat",
          "/kv/v1/push/register", "/kv/v1/push/write", "/kv/v1/push/complete",
          "/kv/v1/push/keepalive", "/kv/v1/push/abort")
FAST = settings(max_examples=30, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


def message_classes() -> list[type[Message]]:
    """Every registered message type (subclasses of Message, found through the public base)."""
    found: list[type[Message]] = []
    pending = list(Message.__subclasses__())
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: c.TAG)


CLASSES = message_classes()
ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack can carry
small_ints = st.integers(min_value=0, max_value=1 << 20)
wire_scalars = (st.none() | st.booleans() | ints | st.floats() | st.text(max_size=8)
                | st.binary(max_size=8))
wire_values = st.recursive(wire_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                           max_leaves=10)
NODE = NodeInfo("e1", "decode", "pull", 16, 100, 0, 30, 1, "127.0.0.1", 9000)
# Valid instances of the classes whose constructors validate: random fields are laid over them
# one at a time, each kept only if the class accepts it, so every draw is a valid message.
EXAMPLES: dict[type[Any], Any] = {
    NodeInfo: NODE,
    TensorChunk: TensorChunk(dtype="bfloat16", shape=[2, 4], offset=[0, 0]),
    KVTransferParams: KVTransferParams(
        transfer_mode="pull", remote_engine_id="p", remote_host="h", remote_port=1,
        remote_request_id="r", lease_id="l", block_ids=[3, 9], num_tokens=20, block_size=16,
        first_token=TokenLogprobWire(5, -0.5, [5], [-0.5]), lease_expiry=1.5,
        digests=["a", "b"], compat_hash="x"),
}


def strategy_for(hint: Any) -> st.SearchStrategy[Any]:
    """Values of a message field's type hint (what its constructor takes)."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return st.one_of(*(strategy_for(a) for a in get_args(hint)))
    if hint is type(None):
        return st.none()
    if origin in (list, tuple):
        item = strategy_for(get_args(hint)[0])
        return st.lists(item, max_size=4).map(tuple if origin is tuple else list)
    if origin is dict:
        return st.dictionaries(st.text(max_size=6), ints | st.text(max_size=6), max_size=3)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return instances(hint)
    return {int: st.one_of(small_ints, ints), float: st.floats(allow_nan=False),
            str: st.text(max_size=12), bytes: st.binary(max_size=12),
            bool: st.booleans()}.get(hint, wire_values)


def _build(cls: type[Any], kwargs: dict[str, Any]) -> Any:
    try:
        return cls(**kwargs)
    except (TypeError, ValueError):  # the class's own validation refused these values
        pass
    if cls not in EXAMPLES:
        assume(False)
    built = EXAMPLES[cls]
    for name, value in kwargs.items():
        try:
            built = dataclasses.replace(built, **{name: value})
        except (TypeError, ValueError):
            continue
    return built


def instances(cls: type[Any]) -> st.SearchStrategy[Any]:
    hints = get_type_hints(cls)
    fields = {f.name: strategy_for(hints[f.name]) for f in dataclasses.fields(cls)}
    return st.fixed_dictionaries(fields).map(lambda kw: _build(cls, kw))


any_message = st.sampled_from(CLASSES).flatmap(instances)


def raises_protocol_error_or_decodes(fn: Any, *args: Any) -> None:
    """`fn(*args)` either succeeds or raises ProtocolError; anything else fails the test."""
    try:
        fn(*args)
    except ProtocolError:
        pass


# ---- the codec, offline -------------------------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.TAG)
@FAST
@given(data=st.data())
def test_every_message_type_round_trips(cls: type[Message], data: st.DataObject) -> None:
    msg = data.draw(instances(cls))
    assert decode(encode(msg), cls) == msg
    assert decode_any(frame_header(msg)[4:]) == msg
    assert EnvelopeReader(seal("hash", {"f": 1}, msg)).message(cls) == msg


def test_kv_transfer_params_round_trip_through_from_fields() -> None:
    @FAST
    @given(params=instances(KVTransferParams))
    def check(params: KVTransferParams) -> None:
        assert from_fields(KVTransferParams, to_fields(params)) == params
    check()


@FAST
@given(msg=any_message, data=st.data())
def test_truncated_messages_and_envelopes_raise_protocol_error(msg: Message,
                                                               data: st.DataObject) -> None:
    raw = encode(msg)
    cut = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
    with pytest.raises(ProtocolError):
        decode_any(raw[:cut])
    envelope = seal("hash", {}, msg)
    cut = data.draw(st.integers(min_value=0, max_value=len(envelope) - 1))
    with pytest.raises(ProtocolError):
        EnvelopeReader(envelope[:cut]).message(type(msg))


@FAST
@given(raw=st.binary(max_size=64))
def test_arbitrary_bytes_raise_only_protocol_error(raw: bytes) -> None:
    raises_protocol_error_or_decodes(decode_any, raw)
    raises_protocol_error_or_decodes(lambda b: EnvelopeReader(b).message(Message), raw)


@FAST
@given(msg=any_message, data=st.data(), value=wire_values)
def test_wrong_field_types_raise_only_protocol_error(msg: Message, data: st.DataObject,
                                                     value: Any) -> None:
    fields = to_fields(msg)
    assume(fields)
    name = data.draw(st.sampled_from(sorted(fields)))
    raw = msgpack.packb({"t": msg.TAG, "b": {**fields, name: value}}, use_bin_type=True)
    raises_protocol_error_or_decodes(decode_any, raw)


@FAST
@given(msg=any_message, extra=st.text(min_size=1, max_size=8), value=wire_values)
def test_unknown_fields_are_refused(msg: Message, extra: str, value: Any) -> None:
    fields = to_fields(msg)
    assume(extra not in fields)
    with pytest.raises(ProtocolError, match="unknown fields"):
        decode_any(msgpack.packb({"t": msg.TAG, "b": {**fields, extra: value}},
                                 use_bin_type=True))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.TAG)
def test_missing_required_fields_are_refused(cls: type[Message]) -> None:
    required = [f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for name in required:
        fields = {f: None for f in required if f != name}
        with pytest.raises(ProtocolError):
            decode_any(msgpack.packb({"t": cls.TAG, "b": fields}, use_bin_type=True))


@FAST
@given(tag=st.text(max_size=12) | wire_values, body=wire_values)
def test_unknown_tags_and_shapes_raise_only_protocol_error(tag: Any, body: Any) -> None:
    raises_protocol_error_or_decodes(decode_any, msgpack.packb({"t": tag, "b": body},
                                                               use_bin_type=True))


@FAST
@given(msg=any_message, version=wire_values)
def test_other_protocol_versions_are_refused(msg: Message, version: Any) -> None:
    assume(version != KV_PROTOCOL_VERSION)
    parts = ("hash", version, {}, encode(msg))
    envelope = b"".join(msgpack.packb(p, use_bin_type=True) for p in parts)
    with pytest.raises(ProtocolError):
        EnvelopeReader(envelope).message(type(msg))


def test_oversized_frame_headers_and_payloads_are_refused() -> None:
    def reader(data: bytes, **kw: Any) -> FrameReader:
        pieces = iter([data, b""])
        async def source() -> bytes:
            return next(pieces)
        return FrameReader(source, **kw)

    huge = (MAX_HEADER_BYTES + 1).to_bytes(4, "big") + b"x" * 16
    with pytest.raises(ProtocolError, match="exceeds"):
        asyncio.run(reader(huge).next())
    big = TensorChunk(dtype="bfloat16", shape=[1 << 20, 8], offset=[0, 0])
    with pytest.raises(ProtocolError, match="exceeds"):
        asyncio.run(reader(frame_header(big), max_payload=1024).next())
    with pytest.raises(ProtocolError):  # a frame cut short of its header
        asyncio.run(reader(frame_header(big)[:-3]).next())


# ---- live KV services ----------------------------------------------------------------------
def bodies(node: Node) -> st.SearchStrategy[bytes]:
    """What a hostile or broken peer might post: garbage, truncated or mistyped envelopes
    with the right compat hash, other versions, and valid messages of every type."""
    ident = node.service.identity
    factors = ident.factors.to_wire()

    def envelope(parts: tuple[Any, ...]) -> bytes:
        return b"".join(msgpack.packb(p, use_bin_type=True) for p in parts)

    sealed = any_message.map(lambda m: seal(ident.compat_hash, factors, m))
    return st.one_of(
        st.binary(max_size=64),
        sealed,
        st.tuples(sealed, st.integers(min_value=1, max_value=200)).map(
            lambda s: s[0][:max(1, len(s[0]) - s[1])]),
        st.tuples(any_message, wire_values).map(lambda mv: envelope(
            (ident.compat_hash, mv[1], factors, encode(mv[0])))),
        st.tuples(st.sampled_from(CLASSES), wire_values).map(lambda tv: envelope(
            (ident.compat_hash, KV_PROTOCOL_VERSION, factors,
             msgpack.packb({"t": tv[0].TAG, "b": tv[1]}, use_bin_type=True)))),
        wire_values.map(lambda v: envelope((ident.compat_hash, KV_PROTOCOL_VERSION, v, v))),
    )


@pytest.fixture
async def live() -> Iterator[tuple[Node, Node]]:
    prefill = await start_node("prefill", "pull")
    decode_node = await start_node("decode", "push", secret=SECRET)
    yield prefill, decode_node
    for node in (prefill, decode_node):
        await node.runner.cleanup()


async def _post(session: aiohttp.ClientSession, url: str, body: bytes,
                headers: dict[str, str] | None = None) -> int:
    async with session.post(url, data=body, headers=headers) as resp:
        text = await resp.text()
        assert resp.status < 500, (url, resp.status, text)
        if resp.status >= 400:
            assert (await resp.json())["error"]["message"], text
        return resp.status


async def test_live_services_answer_4xx_to_every_malformed_body(live: tuple[Node, Node]) -> None:
    prefill, decode_node = live
    statuses: dict[int, int] = {}
    async with aiohttp.ClientSession() as session:
        loop = asyncio.get_running_loop()

        def poster(node: Node, signed: bool) -> Any:
            @settings(max_examples=40, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(route=st.sampled_from(ROUTES), body=bodies(node))
            def posts(route: str, body: bytes) -> None:
                headers = sign(SECRET, "POST", route, [body]) if signed else None
                future = asyncio.run_coroutine_threadsafe(
                    _post(session, node.url + route, body, headers), loop)
                status = future.result(30)
                statuses[status] = statuses.get(status, 0) + 1
            return posts

        for node, signed in ((prefill, False), (decode_node, True)):
            await asyncio.to_thread(poster(node, signed))
        limit = prefill.service.config.max_chunk_bytes + MAX_HEADER_BYTES
        for route in ("/kv/v1/pull", "/kv/v1/push/write"):  # oversized: refused, not read
            assert await _post(session, prefill.url + route, b"\0" * (limit + 1)) == 413
        for node in (prefill, decode_node):
            async with session.get(node.url + "/kv/v1/info") as resp:
                assert resp.status == 200
    await assert_no_leaks(prefill, decode_node)
    assert statuses and all(400 <= s < 500 for s in statuses if s != 200), statuses


async def test_hmac_right_and_wrong(live: tuple[Node, Node]) -> None:
    """A signature passes only with the right secret over the exact path and bytes; each
    request is signed afresh (a signature is never reused)."""
    _, decode_node = live
    ident = decode_node.service.identity
    route = "/kv/v1/heartbeat"
    async with aiohttp.ClientSession() as session:
        @settings(max_examples=25, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(msg=any_message, flip=st.integers(min_value=0, max_value=10_000),
               wrong=st.binary(min_size=16, max_size=32))
        def signatures(msg: Message, flip: int, wrong: bytes) -> None:
            body = seal(ident.compat_hash, ident.factors.to_wire(), msg)
            tampered = bytearray(body)
            tampered[flip % len(body)] ^= 0x01

            def status(data: bytes, headers: dict[str, str] | None) -> int:
                return asyncio.run_coroutine_threadsafe(
                    _post(session, decode_node.url + route, data, headers), loop).result(30)

            assert status(body, sign(SECRET, "POST", route, [body])) != 401
            assert status(body, None) == 401
            if wrong != SECRET:
                assert status(body, sign(wrong, "POST", route, [body])) == 401
            assert status(bytes(tampered), sign(SECRET, "POST", route, [body])) == 401
            assert status(body, sign(SECRET, "POST", "/kv/v1/release", [body])) == 401

        loop = asyncio.get_running_loop()
        await asyncio.to_thread(signatures)
    await assert_no_leaks(decode_node)


# Header values a client can send: aiohttp takes visible ASCII (and spaces) up to 8 KiB a line.
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=500)
timestamps = header_text | st.integers(min_value=-(10**450), max_value=10**450).map(str)


async def test_mangled_signature_headers_are_401_never_500(live: tuple[Node, Node]) -> None:
    """Regression: a timestamp of 400 digits made the HMAC check raise OverflowError (500)."""
    _, decode_node = live
    url = decode_node.url + "/kv/v1/heartbeat"
    async with aiohttp.ClientSession() as session:
        # A well-formed nonce, so the timestamp and signature are what the check reads.
        huge = {TIMESTAMP_HEADER: "9" * 400, NONCE_HEADER: "0" * 32, SIGNATURE_HEADER: "0" * 64}
        assert await _post(session, url, b"x", huge) == 401
        loop = asyncio.get_running_loop()

        @settings(max_examples=60, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(ts=timestamps, sig=header_text)
        def mangled(ts: str, sig: str) -> None:
            headers = {TIMESTAMP_HEADER: ts.strip(), NONCE_HEADER: "0" * 32,
                       SIGNATURE_HEADER: sig.strip()}
            status = asyncio.run_coroutine_threadsafe(
                _post(session, url, b"x", headers), loop).result(30)
            assert status == 401

        await asyncio.to_thread(mangled)
