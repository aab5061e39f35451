"""Wire messages of the KV-transfer protocol (one frozen dataclass per message type).

Each class registers under its tag with the codec; requests travel inside an envelope
(codec.seal), replies and stream frames as bare messages. Block ids are always the sender's
own ids; a receiver never trusts them without checking them against its lease or slot.
The JSON `kv_transfer_params` of the P/D contract (the pull lease included) are in
shared.protocol.pd.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.protocol.codec import Message
from shared.protocol.layout import LayerRange, even_layer_ranges

TRANSFER_MODES = ("pull", "push")
ROLES = ("prefill", "decode")
# Wire dtype names and their item sizes (shared.protocol.tensors maps them to torch dtypes).
DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1, "int32": 4, "int64": 8}


def kv_address(host: str, port: int, tls: bool = False) -> str:
    """A KV peer's address as the peer client takes it: `host:port` for a plain listener,
    `https://host:port` for a TLS one (what kv_transfer_params and push registrations say)."""
    return f"{'https://' if tls else ''}{host}:{port}"


@dataclass(frozen=True)
class NodeInfo(Message, tag="node_info"):
    """One side of a pairing: the handshake request (decode in pull, both sides in push)
    and the negotiable facts that are deliberately not in the compat hash.

    The service reads and writes layers [layer_start, layer_end) of its cache. `layer_ranges`
    says which pipeline stage computed which of them: one [start, end) per stage, in stage
    order (since protocol version 2). Left empty, it is the even split of [layer_start,
    layer_end) into `pp_size` stages (PipelineConfig's default), so a PP=1 node declares the
    single range [layer_start, layer_end). Only the shape is checked here; whether the
    ranges tile the layers without gap or overlap is negotiated (a 409 naming the layers).
    """

    engine_id: str
    role: str
    transfer_mode: str
    block_size: int
    num_blocks: int
    layer_start: int
    layer_end: int
    pp_size: int
    kv_host: str
    kv_port: int
    layer_ranges: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES or self.transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"bad role/mode {self.role!r}/{self.transfer_mode!r}")
        if not 0 <= self.layer_start < self.layer_end or self.pp_size < 1:
            raise ValueError(f"bad layer span [{self.layer_start}, {self.layer_end}) or "
                             f"pp_size {self.pp_size}")
        ranges = tuple(tuple(r) for r in self.layer_ranges) or even_layer_ranges(
            self.layer_start, self.layer_end, self.pp_size)
        if len(ranges) != self.pp_size:
            raise ValueError(f"{len(ranges)} layer ranges for pp_size {self.pp_size}")
        for r in ranges:
            if len(r) != 2 or not 0 <= r[0] < r[1]:
                raise ValueError(f"layer range {list(r)} is not [start, end) with "
                                 "0 <= start < end")
        object.__setattr__(self, "layer_ranges", ranges)

    @property
    def stage_ranges(self) -> tuple[LayerRange, ...]:
        """The per-stage ranges as (start, end) pairs (validated in __post_init__)."""
        return tuple((r[0], r[1]) for r in self.layer_ranges)

    @property
    def address(self) -> str:
        return f"{self.kv_host}:{self.kv_port}"


@dataclass(frozen=True)
class HandshakeAccepted(Message, tag="handshake_ok"):
    """Reply to a handshake: the server's node, hash and factors, re-checked by the client."""

    node: NodeInfo
    compat_hash: str
    factors: dict[str, object]


@dataclass(frozen=True)
class TokenLogprobWire(Message, tag="token_logprob"):
    """The first token sampled by the prefill, with its logprob and top alternatives."""

    token_id: int
    logprob: float | None = None
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


def prompt_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 (first 128 bits, hex) of a prompt's token ids as little-endian u32."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).hexdigest()[:32]


@dataclass(frozen=True)
class PullRequest(Message, tag="pull"):
    engine_id: str  # the caller's engine id (must have handshaken)
    remote_request_id: str
    lease_id: str
    block_ids: list[int]  # what the caller was told; must equal the lease's blocks


@dataclass(frozen=True)
class TensorChunk(Message, tag="tensor_chunk"):
    """Header of one raw tensor payload: a box `[offset, offset + shape)` of a larger tensor.

    Both lists are full rank. The payload is the box's bytes, C-contiguous, little-endian.
    """

    dtype: str
    shape: list[int]
    offset: list[int]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if len(self.shape) != len(self.offset) or not self.shape:
            raise ValueError("shape and offset must have the same, non-zero rank")
        if any(s < 0 for s in self.shape) or any(o < 0 for o in self.offset):
            raise ValueError("negative shape or offset")

    @property
    def payload_nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class StreamEnd(Message, tag="stream_end"):
    num_chunks: int
    num_bytes: int


@dataclass(frozen=True)
class StreamError(Message, tag="stream_error"):
    """Sent in place of the next chunk when a stream cannot go on (e.g. lease expired)."""

    status: int
    code: str
    message: str


@dataclass(frozen=True)
class ReleaseRequest(Message, tag="release"):
    engine_id: str
    remote_request_id: str
    lease_id: str


@dataclass(frozen=True)
class LeaseRef(Message, tag="lease_ref"):
    remote_request_id: str
    lease_id: str


@dataclass(frozen=True)
class LeaseStatus(Message, tag="lease_status"):
    remote_request_id: str
    state: str  # a LeaseState value, or "unknown"
    expires_in_s: float


@dataclass(frozen=True)
class ReleaseResult(Message, tag="release_ok"):
    lease: LeaseStatus


@dataclass(frozen=True)
class HeartbeatRequest(Message, tag="heartbeat"):
    """One batched heartbeat per peer: extends every listed lease still held."""

    engine_id: str
    leases: list[LeaseRef]


@dataclass(frozen=True)
class HeartbeatResult(Message, tag="heartbeat_ok"):
    leases: list[LeaseStatus]


@dataclass(frozen=True)
class PushRegister(Message, tag="push_register"):
    """Decode -> prefill: these pre-allocated blocks await the prompt of `transfer_id`;
    write them to the decode's KV listener at `address` (TLS when `kv_tls`, since version 4).
    The decode gives up after `deadline_seconds` without a write or keepalive (version 5)."""

    engine_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    kv_host: str
    kv_port: int
    kv_tls: bool = False
    deadline_seconds: float = 30.0

    @property
    def address(self) -> str:
        return kv_address(self.kv_host, self.kv_port, self.kv_tls)


@dataclass(frozen=True)
class PushWrite(Message, tag="push_write"):
    """Prefill -> decode: one chunk (the raw payload trails the envelope)."""

    engine_id: str
    transfer_id: str
    chunk: TensorChunk


@dataclass(frozen=True)
class PushComplete(Message, tag="push_complete"):
    engine_id: str
    transfer_id: str
    num_tokens: int
    first_token: TokenLogprobWire
    digests: list[str]


@dataclass(frozen=True)
class PushKeepalive(Message, tag="push_keepalive"):
    """Prefill -> decode: `transfer_id` is registered and its prompt still waits for compute
    (queued behind other prompts): restart the decode's push deadline (since version 5)."""

    engine_id: str
    transfer_id: str


@dataclass(frozen=True)
class PushAbort(Message, tag="push_abort"):
    """Either side -> the other: give up `transfer_id` now (errors propagate both ways)."""

    engine_id: str
    transfer_id: str
    reason: str


@dataclass(frozen=True)
class Ack(Message, tag="ack"):
    ok: bool = True


@dataclass(frozen=True)
class ServiceInfo(Message, tag="info"):
    """GET /kv/v1/info: what a router needs to pair workers without a handshake."""

    node: NodeInfo
    compat_hash: str
    factors: dict[str, object]
