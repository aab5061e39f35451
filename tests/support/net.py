"""Loopback networking for tests (standard library only: cheap to import anywhere)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS may hand it out again once closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_on(hosts: list[str], tries: int = 20) -> int:
    """A TCP port free on every one of `hosts` now (e.g. 127.0.0.2 and 127.0.0.3: all of
    127/8 is loopback on Linux): replicas behind one DNS name or Service share a port."""
    for _ in range(tries):
        socks: list[socket.socket] = []
        try:
            first = socket.socket()
            socks.append(first)
            first.bind((hosts[0], 0))
            port = first.getsockname()[1]
            for host in hosts[1:]:
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError(f"no port free on all of {hosts}")
