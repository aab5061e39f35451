"""StageChannel: one stage's end of the pipeline's point-to-point traffic (gloo isend/irecv).

Roles are fixed by rank, and each method checks its role before posting anything, so a
misplaced call fails at once instead of waiting for a peer that will never answer:
    send_forward   every stage but the last   (to rank + 1)
    recv_forward   every stage but the first  (from rank - 1)
    post_tokens    stage 0 only               (from the last stage)
    send_tokens    the last stage only        (to stage 0)
Sends are asynchronous; each is kept (with its tensors) until waited, exactly once, by `_reap`
(when done, or when more than `max_outstanding` are queued) or `flush`. The counters live in a
shared-memory int64 tensor [world, len(Counter)], one row per stage, so stage 0 (and tests)
can read every stage's traffic live.
"""

from __future__ import annotations

import socket
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum

import torch
import torch.distributed as dist

from shared.pipeline.handoff import HandoffLedger, PipelineError, TokenHandoff, Work
from shared.pipeline.wire import (
    PREAMBLE_LEN,
    TAG_FORWARD,
    TAG_TOKENS_BASE,
    MessageKind,
    StepHeader,
    TokenSpec,
)

_BACKEND = "pdmesh_gloo"
# Stage processes block on their next message for as long as stage 0 is idle; every wait
# that a live pipeline must finish promptly passes an explicit timeout instead.
_IDLE_TIMEOUT = timedelta(days=30)


_bind_addr = "127.0.0.1"  # set by join_group before the backend is created


def _create_gloo(store: dist.Store, rank: int, size: int,
                 timeout: timedelta) -> dist.ProcessGroupGloo:
    # torch's stub lists `Options` (and a constructor without options); the binding is _Options.
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    # Bind gloo's pairs to the store's address (loopback), not whatever the host name
    # resolves to, so no stage listens on an outside interface.
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_bind_addr)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _posted(work: dist.Work | None) -> Work:
    """An isend/irecv's Work: torch returns None only to a rank outside the group."""
    if work is None:
        raise PipelineError("a point-to-point operation was not posted (rank not in the group)")
    return work


def bind_listener(addr: str, port: int) -> socket.socket:
    """A listening TCP socket on `addr` only (port 0: any free one)."""
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    if not infos:
        raise PipelineError(f"cannot resolve the pipeline address {addr!r}")
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart on a fixed port
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def open_store(addr: str, port: int, world_size: int, *, is_master: bool,
               timeout_s: float) -> dist.TCPStore:
    """The rendezvous store; port 0 on the master picks a free one (read `store.port`).

    The master's server listens on `addr` only: TCPStore's own server binds every interface
    (`*:port`), so the master binds the socket itself and hands the store its descriptor,
    which the store then owns (and closes)."""
    timeout = timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(addr, port, world_size, False, timeout=timeout)
    sock = bind_listener(addr, port)
    bound_port = sock.getsockname()[1]
    return dist.TCPStore(addr, bound_port, world_size, True, timeout=timeout,
                         wait_for_workers=False, master_listen_fd=sock.detach())


def join_group(store: dist.TCPStore, addr: str, rank: int, world_size: int) -> None:
    """Make this process rank `rank` of the default process group (gloo on `addr`)."""
    if dist.is_initialized():
        raise PipelineError("this process already belongs to a pipeline (one per process)")
    global _bind_addr
    _bind_addr = addr
    if _BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(_BACKEND, _create_gloo, devices=["cpu"])
    dist.init_process_group(_BACKEND, store=store, rank=rank, world_size=world_size,
                            timeout=_IDLE_TIMEOUT)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class Counter(IntEnum):
    FORWARD_SENT = 0
    FORWARD_RECEIVED = 1
    TOKENS_SENT = 2
    TOKEN_RECVS_POSTED = 3
    TOKEN_RECVS_ON_LAST = 4  # the last rank entering the receive path: must stay 0


def new_counters(world_size: int) -> torch.Tensor:
    return torch.zeros(world_size, len(Counter), dtype=torch.int64).share_memory_()


@dataclass(frozen=True)
class ForwardMessage:
    kind: MessageKind
    lane: int
    header_data: torch.Tensor | None  # int64, passed on unchanged by middle stages
    hidden: torch.Tensor | None  # [T, hidden]
    blob: bytes

    @property
    def header(self) -> StepHeader:
        assert self.header_data is not None
        return StepHeader.decode(self.header_data)


class StageChannel:
    """Point-to-point messages of stage `rank` in the default gloo process group."""

    def __init__(self, rank: int, world_size: int, *, hidden_size: int, dtype: torch.dtype,
                 timeout_s: float, counters: torch.Tensor) -> None:
        self.rank, self.world_size = rank, world_size
        self.last = world_size - 1
        self.hidden_size, self.dtype = hidden_size, dtype
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.counters = counters
        self.max_outstanding = world_size  # one in-flight microbatch per lane
        self._sends: deque[tuple[list[Work], list[torch.Tensor]]] = deque()

    def _count(self, counter: Counter) -> None:
        self.counters[self.rank, counter] += 1

    def _require(self, ok: bool, what: str) -> None:
        if not ok:
            raise PipelineError(f"rank {self.rank} of {self.world_size} cannot {what}")

    # ---- sends -----------------------------------------------------------------------------
    def _wait(self, work: Work, what: str, *, idle: bool = False) -> None:
        try:
            work.wait() if idle else work.wait(self.timeout)
        except Exception as exc:
            raise PipelineError(f"rank {self.rank}: {what} failed: {exc}") from exc

    def _post_sends(self, tensors: list[torch.Tensor], dst: int, tag: int) -> None:
        works = [_posted(dist.isend(t, dst, tag=tag)) for t in tensors]
        self._sends.append((works, tensors))
        while self._sends and (len(self._sends) > self.max_outstanding
                               or all(w.is_completed() for w in self._sends[0][0])):
            self._reap_one()

    def _reap_one(self) -> None:
        works, _tensors = self._sends.popleft()  # tensors stay alive until the wait returns
        for work in works:
            self._wait(work, "a send")

    def flush(self) -> None:
        """Wait for every outstanding send (each exactly once)."""
        while self._sends:
            self._reap_one()

    def send_forward(self, kind: MessageKind, lane: int = 0, header: torch.Tensor | None = None,
                     hidden: torch.Tensor | None = None, blob: bytes = b"") -> None:
        self._require(self.rank < self.last, "send forward")
        header_len = 0 if header is None else header.numel()
        num_tokens = 0 if hidden is None else hidden.shape[0]
        pre = torch.tensor([int(kind), lane, header_len, num_tokens, len(blob)], dtype=torch.int64)
        tensors = [pre]
        if header is not None:
            tensors.append(header)
        if hidden is not None:
            tensors.append(hidden.contiguous())
        if blob:
            tensors.append(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        self._count(Counter.FORWARD_SENT)  # before the send: seen by anyone who receives it
        self._post_sends(tensors, self.rank + 1, TAG_FORWARD)

    def recv_forward(self) -> ForwardMessage:
        """Block for the next message from rank - 1 (no limit while idle: stage 0 paces it)."""
        self._require(self.rank > 0, "receive forward")
        src = self.rank - 1
        pre = torch.empty(PREAMBLE_LEN, dtype=torch.int64)
        self._wait(_posted(dist.irecv(pre, src, tag=TAG_FORWARD)), "waiting for a step",
                   idle=True)
        kind, lane, header_len, num_tokens, blob_len = pre.tolist()
        parts: list[torch.Tensor] = []
        if header_len:
            parts.append(torch.empty(header_len, dtype=torch.int64))
        if num_tokens:
            parts.append(torch.empty(num_tokens, self.hidden_size, dtype=self.dtype))
        if blob_len:
            parts.append(torch.empty(blob_len, dtype=torch.uint8))
        for work in [_posted(dist.irecv(p, src, tag=TAG_FORWARD)) for p in parts]:
            self._wait(work, "receiving a step")
        self._count(Counter.FORWARD_RECEIVED)
        it = iter(parts)
        return ForwardMessage(
            MessageKind(kind), lane, next(it) if header_len else None,
            next(it) if num_tokens else None, bytes(next(it).numpy()) if blob_len else b"")

    # ---- sampled tokens --------------------------------------------------------------------
    def send_tokens(self, lane: int, payload: torch.Tensor, *, blocking: bool = False) -> None:
        self._require(self.rank == self.last, "send sampled tokens")
        self._count(Counter.TOKENS_SENT)
        self._post_sends([payload], 0, TAG_TOKENS_BASE + lane)
        if blocking:
            self.flush()

    def post_tokens(self, spec: TokenSpec, *, lane: int, step: int,
                    ledger: HandoffLedger) -> TokenHandoff:
        """Post the receive for one step's tokens; only for a step with spec.num_rows > 0."""
        if self.rank == self.last:
            self._count(Counter.TOKEN_RECVS_ON_LAST)
        self._require(self.rank == 0 and self.rank != self.last, "receive sampled tokens")
        assert spec.num_rows > 0, "a step that samples nothing posts no receive"
        buffer = spec.empty()
        work = _posted(dist.irecv(buffer, self.last, tag=TAG_TOKENS_BASE + lane))
        self._count(Counter.TOKEN_RECVS_POSTED)
        return TokenHandoff(work, buffer, spec, lane=lane, step=step, timeout_s=self.timeout_s,
                            ledger=ledger)
