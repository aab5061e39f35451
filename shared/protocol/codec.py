"""The one KV-transfer wire codec: typed dataclass messages in msgpack, never pickle.

Three shapes travel on the wire, all built here:
- a *message*: the msgpack map {"t": tag, "b": {field: value}}. The tag selects the dataclass
  from a registry (dispatch by message type, never by a method-name string) and every field is
  checked against its type hint, so malformed input raises ProtocolError and nothing else.
- an *envelope* (every request body): the msgpack objects compat_hash, protocol version,
  factors, message bytes, concatenated in that order so a receiver compares the hash before it
  parses anything else. Raw bytes may trail the envelope (push writes).
- a *frame* (tensor streams): a big-endian u32 header length, a header message, then the raw
  payload of `header.payload_nbytes` bytes.
"""

from __future__ import annotations

import dataclasses
import struct
import types
from collections.abc import Awaitable, Callable
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

import msgpack

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

KV_PROTOCOL_VERSION = 5
# Changelog of KV_PROTOCOL_VERSION (bump on any wire or semantic change; it is a compat factor):
#   1  first version: envelope (hash, version, factors, message); messages {"t","b"}; frames
#      u32 + header + raw little-endian payload; KV chunks are boxes of the block-major view
#      [n, L, 2, bs, kvh, hd], at most 4 MiB; block digests are XXH3-128 of a block's bytes.
#      (still 1, unreleased: kv_transfer_params gained the optional `prompt_digest`.)
#   2  node_info (handshake, info) gained `layer_ranges`: the [start, end) layers of each
#      pipeline stage behind a KV service; the handshake rejects ranges that do not tile the
#      layers. A version-1 peer would reject the new field, so it gets a hash mismatch instead.
#      Also (same version, unreleased): push writes stream while the prefill still computes,
#      and a push stream may write a block again (after a preemption on the prefill); the
#      decode keeps the digest of the latest full write of each block.
#   3  the compat factors gained `weight_transforms` (shared/protocol/compat.py
#      WeightTransforms: the quantisation of the decoder and of the LM head), so a quantised
#      and a dense worker of one checkpoint get different hashes. A version-2 peer hashes
#      without it and is refused on the hash, naming the new factor and the version.
#   4  signed requests (with PDMESH_KV_SECRET) carry a nonce (`X-PDMesh-KV-Nonce`) inside the
#      HMAC ("timestamp\nnonce\nMETHOD\npath\n" + body), accepted once within a 30 s + 5 s
#      window; without a secret a KV service serves loopback peers only. A version-3 peer
#      signs without a nonce: with a secret it gets 401 naming the missing nonce and the
#      protocol version, without one the hash mismatch names protocol_version.
#      push_register gained `kv_tls`: the decode's KV listener serves TLS, so the prefill
#      writes to it over https (kv_transfer_params gained the optional `remote_tls` likewise,
#      written only when true, so a plain-HTTP mesh's JSON contract is unchanged).
#   5  push_keepalive: a push prefill whose prompt is still queued tells the decode so every
#      third of the push deadline, so a long queue on the prefill no longer reads as a dead
#      prefill (the decode's deadline measures silence, not waiting). A version-4 decode has
#      no such route; the version mismatch refuses the pairing first.

MAX_CHUNK_BYTES = 4 * 1024 * 1024  # largest raw payload in one frame or push write
MAX_HEADER_BYTES = 1024 * 1024

T = TypeVar("T", bound="Message")
D = TypeVar("D", bound="DataclassInstance")  # the dataclass from_fields builds


class ProtocolError(ValueError):
    """Input that is not a well-formed message of this protocol version."""


_REGISTRY: dict[str, type[Message]] = {}


class Message:
    """Base of every wire dataclass; `class X(Message, tag="x")` registers X under "x".

    Subclasses are frozen dataclasses. `payload_nbytes` is how many raw bytes follow the
    message when it heads a frame (0 except for tensor chunks).
    """

    TAG: ClassVar[str]
    if TYPE_CHECKING:  # every subclass is a dataclass; lets from_fields accept type[Message]
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __init_subclass__(cls, tag: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if tag in _REGISTRY:
            raise TypeError(f"message tag {tag!r} registered twice")
        cls.TAG = tag
        _REGISTRY[tag] = cls

    @property
    def payload_nbytes(self) -> int:
        return 0


_SCALARS = (int, float, str, bytes, bool, type(None))


def to_fields(msg: Any) -> Any:
    """Dataclasses to dicts and tuples to lists, recursively: the plain data msgpack/JSON take."""
    if isinstance(msg, _SCALARS):
        return msg
    if isinstance(msg, list | tuple):
        if all(type(v) in _SCALARS for v in msg):  # block ids, digests: no per-item recursion
            return list(msg)
        return [to_fields(v) for v in msg]
    if dataclasses.is_dataclass(msg) and not isinstance(msg, type):
        return {f.name: to_fields(getattr(msg, f.name)) for f in dataclasses.fields(msg)}
    if isinstance(msg, dict):
        return {k: to_fields(v) for k, v in msg.items()}
    return msg


def from_fields(cls: type[D], fields: object) -> D:
    """Build dataclass `cls` from plain data, checking every field against its type hint."""
    if not isinstance(fields, dict):
        raise ProtocolError(f"{cls.__name__}: expected a map, got {type(fields).__name__}")
    hints = _hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(fields) - known
    if unknown:
        raise ProtocolError(f"{cls.__name__}: unknown fields {sorted(map(str, unknown))}")
    kwargs = {name: _check(fields[name], hints[name], f"{cls.__name__}.{name}")
              for name in known if name in fields}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # missing fields, __post_init__ validation
        raise ProtocolError(f"{cls.__name__}: {exc}") from None


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _check_scalar(value: object, hint: type, path: str) -> Any:
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool):
        raise ProtocolError(f"{path}: expected int, got bool")
    if isinstance(value, hint):
        return value
    raise ProtocolError(f"{path}: expected {hint.__name__}, got {type(value).__name__}")


def _check(value: object, hint: Any, path: str) -> Any:
    """Validate (and lightly normalise: list->tuple, int->float) one decoded value."""
    origin = get_origin(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        for arg in get_args(hint):
            try:
                return _check(value, arg, path)
            except ProtocolError:
                continue
        raise ProtocolError(f"{path}: {type(value).__name__} matches none of {hint}")
    if hint is type(None):
        if value is None:
            return None
        raise ProtocolError(f"{path}: expected null")
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ProtocolError(f"{path}: expected a list, got {type(value).__name__}")
        arg = get_args(hint)[0]
        if arg in (int, str) and all(type(v) is arg for v in value):  # fast path, no bools
            items = list(value)
        else:
            items = [_check(v, arg, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{path}: expected a map, got {type(value).__name__}")
        kt, vt = get_args(hint)
        return {_check(k, kt, path): _check(v, vt, f"{path}.{k}") for k, v in value.items()}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_fields(hint, value)
    if isinstance(hint, type):
        return _check_scalar(value, hint, path)
    raise TypeError(f"{path}: unsupported type hint {hint!r}")  # a bug in a message class


def encode(msg: Message) -> bytes:
    data: bytes = msgpack.packb({"t": msg.TAG, "b": to_fields(msg)}, use_bin_type=True)
    return data


def _unwrap(obj: object) -> tuple[type[Message], object]:
    if not isinstance(obj, dict) or not isinstance(obj.get("t"), str):
        raise ProtocolError("not a tagged message")
    cls = _REGISTRY.get(obj["t"])
    if cls is None:
        raise ProtocolError(f"unknown message type {obj['t']!r}")
    return cls, obj.get("b")


def _unpack(data: bytes | memoryview) -> object:
    try:
        return msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises many types (ExtraData, FormatError, ValueError...)
        raise ProtocolError(f"undecodable msgpack: {type(exc).__name__}") from None


def decode_any(data: bytes | memoryview) -> Message:
    """Decode a message of any registered type (the registry picks the class)."""
    cls, fields = _unwrap(_unpack(data))
    return from_fields(cls, fields)


def decode(data: bytes | memoryview, expected: type[T]) -> T:
    msg = decode_any(data)
    if not isinstance(msg, expected):
        raise ProtocolError(f"expected {expected.TAG!r}, got {msg.TAG!r}")
    return msg


def seal(compat_hash: str, factors: dict[str, Any], msg: Message) -> bytes:
    """Build an envelope: hash first, so the receiver can reject before parsing the rest."""
    parts = (compat_hash, KV_PROTOCOL_VERSION, factors, encode(msg))
    return b"".join(msgpack.packb(p, use_bin_type=True) for p in parts)


class EnvelopeReader:
    """Reads an envelope lazily, in wire order: the hash, then (on demand) the rest.

    Construction parses only the first msgpack object, the compat hash. `factors()` and
    `message()` parse further; `trailing()` is a zero-copy view of raw bytes after it.
    """

    def __init__(self, body: bytes | bytearray | memoryview) -> None:
        self._body = body
        # A file-like source lets `tell()` locate the trailing bytes without copying the body
        # (io.BytesIO would copy a bytearray or memoryview body: a reused receive buffer).
        self._unpacker = msgpack.Unpacker(_ViewFile(body), raw=False, read_size=64 * 1024,
                                          max_buffer_size=MAX_HEADER_BYTES * 4)
        head = self._next("compat hash")
        if not isinstance(head, str):
            raise ProtocolError("envelope does not start with a compat hash string")
        self.compat_hash: str = head
        self._rest: tuple[object, object, object] | None = None

    def _next(self, what: str) -> object:
        try:
            return self._unpacker.unpack()
        except Exception as exc:
            raise ProtocolError(f"envelope {what}: {type(exc).__name__}") from None

    def _read_rest(self) -> tuple[object, object, object]:
        if self._rest is None:
            self._rest = (self._next("version"), self._next("factors"), self._next("message"))
        return self._rest

    def factors(self) -> object:
        """The peer's factors as plain decoded data (not validated: used to explain rejects)."""
        return self._read_rest()[1]

    def message(self, expected: type[T]) -> T:
        version, _, payload = self._read_rest()
        if version != KV_PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version!r}, expected {KV_PROTOCOL_VERSION}")
        if not isinstance(payload, bytes):
            raise ProtocolError("envelope message is not bytes")
        return decode(payload, expected)

    def trailing(self) -> memoryview:
        self._read_rest()
        return memoryview(self._body)[self._unpacker.tell():]


class _ViewFile:
    """The read-only file interface msgpack.Unpacker needs, over a buffer, copying only what
    is read (the envelope, a few KiB), never the payload behind it."""

    def __init__(self, buf: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(buf).cast("B")
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n < 0 else min(len(self._view), self._pos + n)
        out = self._view[self._pos:end].tobytes()
        self._pos = end
        return out


_LEN = struct.Struct(">I")


def frame_header(msg: Message) -> bytes:
    """Length prefix plus encoded header; the caller writes the raw payload right after."""
    body = encode(msg)
    return _LEN.pack(len(body)) + body


# The next piece of a byte stream as received (b"" at its end), e.g. for aiohttp:
# `lambda: resp.content.readchunk()` unpacked, or asyncio: `lambda: reader.read(1 << 16)`.
PieceSource = Callable[[], Awaitable[bytes]]


class FrameReader:
    """Reads frames from a byte stream, taking pieces as the transport delivered them.

    `next()` copies a payload once, into a reused buffer (no join into a fresh 4 MiB object
    per chunk, whose page faults were the largest cost of receiving); its view is valid only
    until the next call. `next_pieces()` copies nothing: it returns views of the received
    pieces, for a consumer that places them itself (the KV pull sink, straight into the cache).
    """

    def __init__(self, source: PieceSource, max_payload: int = MAX_CHUNK_BYTES,
                 on_eof: Callable[[], Exception] | None = None) -> None:
        self._source = source
        self._max_payload = max_payload
        self._on_eof = on_eof
        self._pending = memoryview(b"")  # received, not yet consumed
        self._staging = memoryview(bytearray(0))  # grown on first use to the largest payload

    async def next(self) -> tuple[Message, memoryview]:
        """The next frame: (header message, payload view, empty when it has none)."""
        try:
            header = await self._header()
            size = header.payload_nbytes
            if len(self._staging) < size:
                self._staging = memoryview(bytearray(size))
            return header, await self._read(self._staging[:size])
        except EOFError:
            raise self._eof() from None

    async def next_pieces(self) -> tuple[Message, list[memoryview]]:
        """As `next`, but the payload as the pieces it arrived in: views of the received
        bytes, no copy at all (a consumer that scatters them saves a 4 MiB copy per chunk)."""
        try:
            header = await self._header()
            pieces, need = [], header.payload_nbytes
            while need:
                if not self._pending:
                    piece = await self._source()
                    if not piece:
                        raise EOFError
                    self._pending = memoryview(piece)
                k = min(need, len(self._pending))
                pieces.append(self._pending[:k])
                self._pending, need = self._pending[k:], need - k
            return header, pieces
        except EOFError:
            raise self._eof() from None

    def _eof(self) -> Exception:
        return self._on_eof() if self._on_eof else ProtocolError("stream ended inside a frame")

    async def _header(self) -> Message:
        (n,) = _LEN.unpack(await self._read(bytearray(4)))
        if n > MAX_HEADER_BYTES:
            raise ProtocolError(f"frame header of {n} bytes exceeds {MAX_HEADER_BYTES}")
        header = decode_any(await self._read(bytearray(n)))
        if header.payload_nbytes > self._max_payload:
            raise ProtocolError(f"frame payload of {header.payload_nbytes} bytes exceeds "
                                f"{self._max_payload}")
        return header

    async def _read(self, dst: bytearray | memoryview) -> memoryview:
        """Fill `dst` exactly from the stream; raises EOFError if it ends first."""
        out, pos = memoryview(dst), 0
        while pos < len(out):
            if not self._pending:
                piece = await self._source()
                if not piece:
                    raise EOFError
                self._pending = memoryview(piece)
            k = min(len(out) - pos, len(self._pending))
            out[pos:pos + k] = self._pending[:k]
            self._pending, pos = self._pending[k:], pos + k
        return out
