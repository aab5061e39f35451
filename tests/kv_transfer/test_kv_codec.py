"""The wire codec: typed messages, envelopes, frames, tensors in <= 4 MiB chunks."""

from __future__ import annotations

import asyncio
import math

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shared.protocol.codec import (
    KV_PROTOCOL_VERSION,
    MAX_CHUNK_BYTES,
    EnvelopeReader,
    FrameReader,
    ProtocolError,
    decode,
    decode_any,
    encode,
    frame_header,
    seal,
)
from shared.protocol.messages import (
    HeartbeatRequest,
    LeaseRef,
    NodeInfo,
    PullRequest,
    PushRegister,
    StreamEnd,
    TensorChunk,
    TokenLogprobWire,
)
from shared.protocol.pd import KVTransferParams
from shared.protocol.tensors import (
    Box,
    RowDigester,
    assemble,
    block_digest,
    plan_boxes,
    raw_bytes,
    row_digests,
    tensor_chunks,
)

NODE = NodeInfo("e1", "decode", "pull", 16, 100, 0, 30, 1, "127.0.0.1", 9000)


def params(**kw: object) -> KVTransferParams:
    base = dict(transfer_mode="pull", remote_engine_id="p", remote_host="h", remote_port=1,
                remote_request_id="r", lease_id="l", block_ids=[3, 9], num_tokens=20,
                block_size=16, first_token=TokenLogprobWire(5, -0.5, [5], [-0.5]),
                lease_expiry=1.5, digests=["a", "b"], compat_hash="x")
    base.update(kw)
    return KVTransferParams(**base)  # type: ignore[arg-type]


def test_messages_round_trip_including_nested() -> None:
    for msg in (NODE, params(), HeartbeatRequest("e", [LeaseRef("r", "l"), LeaseRef("s", "m")]),
                PullRequest("e", "r", "l", [1, 2, 3]), StreamEnd(2, 10)):
        assert decode(encode(msg), type(msg)) == msg
        assert decode_any(encode(msg)) == msg


def test_push_register_carries_the_decode_listener_scheme() -> None:
    """Version 4: a TLS decode's registration says so; the prefill then writes over https."""
    plain = PushRegister("d", "t", [1, 2], 20, "10.0.0.3", 9001)
    tls = PushRegister("d", "t", [1, 2], 20, "10.0.0.3", 9001, kv_tls=True)
    assert KV_PROTOCOL_VERSION >= 4
    for msg in (plain, tls):
        assert decode(encode(msg), PushRegister) == msg
    assert (plain.address, tls.address) == ("10.0.0.3:9001", "https://10.0.0.3:9001")


def test_params_json_round_trip_and_validation() -> None:
    p = params()
    assert KVTransferParams.from_wire(p.to_wire()) == p
    with pytest.raises(ProtocolError):  # 2 blocks cannot hold 40 tokens at block size 16
        KVTransferParams.from_wire({**p.to_wire(), "num_tokens": 40})
    with pytest.raises(ProtocolError):
        KVTransferParams.from_wire({**p.to_wire(), "block_ids": ["3", 9]})
    with pytest.raises(ProtocolError):
        KVTransferParams.from_wire({**p.to_wire(), "surprise": 1})
    with pytest.raises(ProtocolError):
        KVTransferParams.from_wire(["not", "an", "object"])


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x92\x01", msgpack.packb({"t": "nope", "b": {}}),
    msgpack.packb({"t": "pull", "b": {"engine_id": 1}}), msgpack.packb({"t": "pull"}),
    msgpack.packb({"t": "pull", "b": {"engine_id": "e", "remote_request_id": "r",
                                      "lease_id": "l", "block_ids": [True]}}),
    msgpack.packb([1, 2, 3]),
])
def test_malformed_input_raises_protocol_error_only(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(data, PullRequest)


@given(st.binary(max_size=200))
def test_fuzz_decode_never_raises_anything_else(data: bytes) -> None:
    try:
        decode_any(data)
    except ProtocolError:
        pass


def test_wrong_message_type_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="expected 'pull'"):
        decode(encode(NODE), PullRequest)


def test_envelope_hash_first_and_trailing_bytes() -> None:
    body = seal("h" * 64, {"k": 1}, NODE) + b"RAW-PAYLOAD"
    reader = EnvelopeReader(body)
    assert reader.compat_hash == "h" * 64
    assert reader.factors() == {"k": 1}
    assert reader.message(NodeInfo) == NODE
    assert bytes(reader.trailing()) == b"RAW-PAYLOAD"


def test_envelope_garbage_after_hash_parses_only_the_hash() -> None:
    body = msgpack.packb("other-hash") + b"\xc1\xc1 garbage"
    reader = EnvelopeReader(body)  # must not raise: only the hash was read
    assert reader.compat_hash == "other-hash"
    with pytest.raises(ProtocolError):
        reader.factors()
    with pytest.raises(ProtocolError):
        EnvelopeReader(b"\x01\x02")  # does not start with a string


def test_envelope_rejects_other_protocol_version() -> None:
    parts = ("h", KV_PROTOCOL_VERSION + 1, {}, encode(NODE))
    reader = EnvelopeReader(b"".join(msgpack.packb(p) for p in parts))
    with pytest.raises(ProtocolError, match="protocol version"):
        reader.message(NodeInfo)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_tensor_chunks_round_trip_bit_exact(dtype: torch.dtype) -> None:
    # 9 MiB+ of data: splits into several chunks, none above 4 MiB.
    t = torch.randn(5, 3, 1000, 160).to(dtype)
    chunks = [(c, bytes(p)) for c, p in tensor_chunks(t, MAX_CHUNK_BYTES)]
    assert len(chunks) > 1
    assert all(len(p) <= MAX_CHUNK_BYTES and len(p) == c.payload_nbytes for c, p in chunks)
    back = assemble(chunks, tuple(t.shape), dtype)
    assert torch.equal(back.view(torch.uint8 if dtype != torch.float32 else torch.int32),
                       t.view(torch.uint8 if dtype != torch.float32 else torch.int32))


def test_rows_larger_than_the_limit_are_split_inside_the_row() -> None:
    t = torch.arange(3 * 4 * 10, dtype=torch.float32).reshape(3, 4, 10)  # rows of 160 bytes
    boxes = list(plan_boxes(tuple(t.shape), 4, 64))
    assert all(math.prod(b.shape) * 4 <= 64 for b in boxes)
    assert sum(math.prod(b.shape) for b in boxes) == t.numel()
    chunks = [(c, bytes(p)) for c, p in tensor_chunks(t, 64)]
    assert torch.equal(assemble(chunks, (3, 4, 10), torch.float32), t)
    # Rows hashed piecewise equal rows hashed whole.
    digester = RowDigester(3, (4, 10), 4)
    for c, p in chunks:
        digester.feed(Box(tuple(c.offset), tuple(c.shape)), p)
    assert digester.digests == row_digests(t) == [block_digest(raw_bytes(r)) for r in t]
    assert digester.mismatches(row_digests(t)) == []
    # Pieces of a row swapped: the bytes would land elsewhere than hashed -> refused.
    swapped = RowDigester(3, (4, 10), 4)
    (c0, p0), (c1, _) = chunks[0], chunks[1]
    assert c0.offset[0] == c1.offset[0] == 0
    with pytest.raises(ProtocolError, match="out of order"):
        swapped.feed(Box(tuple(c1.offset), tuple(c1.shape)), p0)


async def test_frames_over_a_stream_arriving_in_pieces() -> None:
    t = torch.randn(4, 8).bfloat16()
    chunk = TensorChunk("bfloat16", [4, 8], [0, 0])
    data = frame_header(chunk) + bytes(raw_bytes(t)) + frame_header(StreamEnd(1, 64))
    reader = asyncio.StreamReader()
    frames = FrameReader(lambda: reader.read(5))
    for i in range(0, len(data), 7):  # the network splits anywhere
        reader.feed_data(data[i:i + 7])
    reader.feed_eof()
    header, payload = await frames.next()
    assert header == chunk and len(payload) == 64
    assert torch.equal(assemble([(header, payload)], (4, 8), torch.bfloat16).view(torch.int16),
                       t.view(torch.int16))
    assert (await frames.next())[0] == StreamEnd(1, 64)
    with pytest.raises(ProtocolError, match="ended"):
        await frames.next()


async def test_frame_payload_limit_is_enforced_before_reading() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(frame_header(TensorChunk("float32", [2 * MAX_CHUNK_BYTES], [0])))
    with pytest.raises(ProtocolError, match="exceeds"):
        await FrameReader(lambda: reader.read(1 << 16)).next()


async def test_truncated_payload_is_an_error() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(frame_header(TensorChunk("uint8", [100], [0])) + b"x" * 10)
    reader.feed_eof()
    with pytest.raises(ProtocolError, match="ended"):
        await FrameReader(lambda: reader.read(1 << 16)).next()
