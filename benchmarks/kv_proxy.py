"""A fault-injecting TCP forwarder for the chaos harness (benchmarks/chaos.py).

A decode reaches a prefill's KV listener through it (the prefill advertises the proxy's port
with --kv-advertise-port). It relays bytes both ways unchanged until told otherwise:

- `arm_cut(after_bytes, count)`: the next `count` connections that carry more than
  `after_bytes` from the prefill towards the decode after arming are reset (RST, SO_LINGER 0),
  i.e. cut in the middle of a KV body, not between requests;
- `wait_flowing()`: returns once KV bytes flow towards a decode (a pull is in progress), so
  the harness can freeze the prefill in the middle of a pull.

It runs on the harness's event loop; nothing here knows about HTTP.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass, field


@dataclass(eq=False)  # hashed by identity: held in a set
class _Conn:
    """One relayed connection: the two writers, and bytes carried prefill -> decode."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    downstream_bytes: int = 0
    tasks: list[asyncio.Task] = field(default_factory=list)

    def reset(self) -> None:
        """Close both sides with an RST (linger 0), as a dropped link or a dead NAT would."""
        for writer in (self.client, self.upstream):
            if writer.transport.is_closing():
                continue  # closed already (the other side ended first)
            sock = writer.get_extra_info("socket")
            try:
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass  # the descriptor went away under us: nothing left to reset
            writer.transport.abort()


class KVProxy:
    """Listens on 127.0.0.1:`port` (0: any free port) and forwards to `target_port`."""

    def __init__(self, target_port: int, port: int = 0) -> None:
        self.target_port = target_port
        self.port = port
        self.cuts = 0  # connections reset so far
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._cut_after: int | None = None
        self._cuts_left = 0
        self._flowing = asyncio.Event()
        self._handlers: set[asyncio.Task] = set()

    async def start(self) -> KVProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.reset()
        for task in self._handlers:  # so none is left for the loop's shutdown to cancel
            task.cancel()
        await asyncio.gather(*list(self._handlers), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def arm_cut(self, after_bytes: int, count: int = 1) -> None:
        """Reset the next `count` connections once each carried `after_bytes` more towards the
        decode (counted from now for live connections)."""
        for conn in self._conns:
            conn.downstream_bytes = 0
        self._cut_after, self._cuts_left = after_bytes, count

    def disarm(self) -> None:
        self._cut_after, self._cuts_left = None, 0

    async def wait_flowing(self, timeout: float) -> bool:
        """True once bytes flow prefill -> decode after this call (a KV pull in progress)."""
        self._flowing.clear()
        try:
            await asyncio.wait_for(self._flowing.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._relay(reader, writer)
        except asyncio.CancelledError:
            pass  # closing: the connection was reset already
        finally:
            self._handlers.discard(task)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()  # the prefill is gone: the decode sees a refused peer
            return
        self.connections += 1
        conn = _Conn(writer, up_writer)
        self._conns.add(conn)
        conn.tasks = [asyncio.ensure_future(self._pipe(reader, up_writer, conn, False)),
                      asyncio.ensure_future(self._pipe(up_reader, writer, conn, True))]
        try:
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        finally:
            for t in conn.tasks:
                t.cancel()
            self._conns.discard(conn)
            for w in (writer, up_writer):
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    conn: _Conn, downstream: bool) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                if downstream:
                    self._flowing.set()
                    conn.downstream_bytes += len(data)
                    if (self._cut_after is not None and self._cuts_left > 0
                            and conn.downstream_bytes > self._cut_after):
                        self._cuts_left -= 1
                        self.cuts += 1
                        conn.reset()
                        return
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            conn.reset()
