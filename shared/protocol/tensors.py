"""Tensors on the wire: dtype + shape + raw bytes, split into boxes of at most 4 MiB.

A tensor is cut along dim 0 into groups of whole rows that fit the limit; a row larger than
the limit is cut the same way along its own dim 0, recursively. Every box is therefore a
C-contiguous run of the tensor's bytes, and boxes come in memory order, which is what lets a
receiver hash a row (a KV block) incrementally while its pieces arrive.

Digests: `block_digest` is XXH3-128 of one row's raw bytes (hex). It guards against stale
or corrupted blocks (the freed-and-reused race), not against an adversary: HMAC covers
authenticity. XXH3 runs at memory speed (~25 GiB/s here, sha256 ~1 GiB/s), so verifying
every block costs the transfer almost nothing.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import xxhash

from shared.protocol.codec import ProtocolError
from shared.protocol.messages import DTYPE_ITEMSIZE, TensorChunk

assert sys.byteorder == "little", "the wire format is little-endian raw memory"

_TORCH_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
}
_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}
assert _TORCH_DTYPES.keys() == DTYPE_ITEMSIZE.keys()


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _NAMES:
        raise ValueError(f"dtype {dtype} cannot travel on the KV wire")
    return _NAMES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    if name not in _TORCH_DTYPES:
        raise ProtocolError(f"unknown dtype {name!r}")
    return _TORCH_DTYPES[name]


def raw_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy view of a contiguous CPU tensor's bytes (any dtype, bf16 included)."""
    if not t.is_contiguous():
        raise ValueError("raw_bytes needs a contiguous tensor")
    return t.reshape(-1).view(torch.uint8).numpy().data  # ndarray.data: a 1-D byte memoryview


def from_raw(buf: bytes | bytearray | memoryview, dtype: str, shape: list[int]) -> torch.Tensor:
    """A tensor viewing `buf` (no copy). Callers only read it (copy into a cache or assemble)."""
    numel = math.prod(shape)
    if len(buf) != numel * DTYPE_ITEMSIZE[dtype]:
        raise ProtocolError(f"payload of {len(buf)} bytes does not match {dtype}{list(shape)}")
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype(dtype))
    with warnings.catch_warnings():  # a read-only buffer (bytes) is fine: we never write to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch_dtype(dtype), count=numel).view(shape)


@dataclass(frozen=True)
class Box:
    """A sub-tensor `[offset, offset + shape)`, both full rank."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape, strict=True))


def plan_boxes(shape: tuple[int, ...], itemsize: int, max_bytes: int) -> Iterator[Box]:
    """Boxes covering `shape` in memory order, each at most `max_bytes` (see module doc)."""
    if itemsize > max_bytes:
        raise ValueError("max_bytes is smaller than one element")
    yield from _plan(tuple(shape), itemsize, max_bytes, ())


def _plan(shape: tuple[int, ...], itemsize: int, max_bytes: int,
          prefix: tuple[int, ...]) -> Iterator[Box]:
    pad = (1,) * len(prefix)
    row = itemsize * math.prod(shape[1:])
    if row <= max_bytes or len(shape) == 1:
        step = max(1, max_bytes // max(row, 1))
        for start in range(0, shape[0], step):
            size = min(step, shape[0] - start)
            yield Box(prefix + (start,) + (0,) * (len(shape) - 1), pad + (size,) + shape[1:])
        return
    for i in range(shape[0]):
        yield from _plan(shape[1:], itemsize, max_bytes, prefix + (i,))


def tensor_chunks(t: torch.Tensor, max_bytes: int) -> Iterator[tuple[TensorChunk, memoryview]]:
    """Split a tensor into (header, raw payload) pairs of at most `max_bytes` each."""
    name = dtype_name(t.dtype)
    for box in plan_boxes(tuple(t.shape), t.element_size(), max_bytes):
        part = t[box.slices()].contiguous()
        yield TensorChunk(name, list(box.shape), list(box.offset)), raw_bytes(part)


def check_box(chunk: TensorChunk, full_shape: tuple[int, ...], dtype: str) -> Box:
    """Validate a received chunk against the tensor it claims to belong to."""
    if chunk.dtype != dtype:
        raise ProtocolError(f"chunk dtype {chunk.dtype} but the destination is {dtype}")
    if len(chunk.shape) != len(full_shape):
        raise ProtocolError(f"chunk rank {len(chunk.shape)} but the destination is {full_shape}")
    for o, s, n in zip(chunk.offset, chunk.shape, full_shape, strict=True):
        if o + s > n:
            raise ProtocolError(f"chunk box {chunk.offset}+{chunk.shape} outside {full_shape}")
    return Box(tuple(chunk.offset), tuple(chunk.shape))


def assemble(chunks: Iterable[tuple[TensorChunk, bytes]], shape: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
    """Inverse of tensor_chunks: place every box into a fresh tensor (test and small-data use)."""
    out = torch.empty(shape, dtype=dtype)
    for chunk, payload in chunks:
        box = check_box(chunk, shape, dtype_name(dtype))
        out[box.slices()] = from_raw(payload, chunk.dtype, chunk.shape)
    return out


def block_digest(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def row_digests(t: torch.Tensor) -> list[str]:
    """Digest of every dim-0 row of a contiguous tensor (a block-major KV gather)."""
    buf = raw_bytes(t)
    row = len(buf) // t.shape[0] if t.shape[0] else 0
    return [block_digest(buf[i * row:(i + 1) * row]) for i in range(t.shape[0])]


class RowDigester:
    """Digests the dim-0 rows of a tensor from its boxes as they arrive, in memory order.

    `feed(box, payload)` hashes whole rows directly and keeps one running hash for a row that
    arrives in pieces; each piece must start where the previous one ended (checked from its
    box), so the digest always describes the bytes where they were placed. `digests` holds
    None for a row not yet complete. A row may be sent again (a push stream restarts after a
    preemption): its first piece drops the old digest and any other unfinished row.
    """

    def __init__(self, num_rows: int, row_shape: tuple[int, ...], itemsize: int) -> None:
        self.row_bytes = math.prod(row_shape) * itemsize
        # Byte stride of each row dimension, C order: locates a piece inside its row.
        self._strides = [math.prod(row_shape[d + 1:]) * itemsize for d in range(len(row_shape))]
        self.digests: list[str | None] = [None] * num_rows
        self._partial: tuple[int, xxhash.xxh3_128, int] | None = None  # (row, hash, bytes seen)

    def feed(self, box: Box, payload: bytes | memoryview | list[memoryview]) -> None:
        """Hash box `box`; `payload` is its bytes, whole or as the pieces they arrived in."""
        pieces = payload if isinstance(payload, list) else [memoryview(payload)]
        nbytes = sum(len(p) for p in pieces)
        first, rows = box.offset[0], box.shape[0]
        if nbytes == rows * self.row_bytes:  # whole rows
            if len(pieces) == 1:
                view = pieces[0]
                for i in range(rows):
                    self.digests[first + i] = block_digest(
                        view[i * self.row_bytes:(i + 1) * self.row_bytes])
                return
            for row, h in zip(range(first, first + rows), _row_hashes(pieces, self.row_bytes),
                              strict=True):
                self.digests[row] = h.hexdigest()
            return
        if rows != 1:
            raise ProtocolError(f"a box of {rows} rows carries {nbytes} bytes")
        start = sum(o * s for o, s in zip(box.offset[1:], self._strides, strict=True))
        if start == 0:  # a row (re)starts: an unfinished one before it stays incomplete
            self._partial = None
            self.digests[first] = None
        row, h, seen = self._partial or (first, xxhash.xxh3_128(), 0)
        if row != first or start != seen:
            raise ProtocolError(f"piece of row {first} at byte {start} out of order "
                                f"(expected row {row} at byte {seen})")
        for piece in pieces:
            h.update(piece)
        seen += nbytes
        if seen >= self.row_bytes:
            self.digests[row] = h.hexdigest()
            self._partial = None
        else:
            self._partial = (row, h, seen)

    def mismatches(self, expected: list[str]) -> list[int]:
        """Indices of rows whose digest differs from `expected` or never completed."""
        if len(expected) != len(self.digests):
            raise ProtocolError(f"{len(expected)} digests for {len(self.digests)} blocks")
        return [i for i, (got, want) in enumerate(zip(self.digests, expected, strict=True))
                if got != want]


def _row_hashes(pieces: list[memoryview], row_bytes: int) -> Iterator[xxhash.xxh3_128]:
    """One finished hash per `row_bytes` of the pieces' concatenation (no join)."""
    h, left = xxhash.xxh3_128(), row_bytes
    for piece in pieces:
        while piece:
            k = min(left, len(piece))
            h.update(piece[:k])
            piece, left = piece[k:], left - k
            if not left:
                yield h
                h, left = xxhash.xxh3_128(), row_bytes
