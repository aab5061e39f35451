"""The pipeline's TCPStore listens on the configured address only, never on every interface.

TCPStore's own server binds `*:port`; `open_store` binds the socket itself. The check reads
the kernel's socket table (/proc/net/tcp, tcp6) for the store's port in LISTEN state.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from shared.pipeline.channel import open_store

LISTEN = "0A"
pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")


def listening_addresses(port: int) -> set[str]:
    """Local addresses (kernel hex) of the sockets listening on `port`, IPv4 and IPv6."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            cols = line.split()
            addr, hex_port = cols[1].split(":")
            if int(hex_port, 16) == port and cols[3] == LISTEN:
                found.add(addr)
    return found


LOOPBACK_V4 = "0100007F"  # 127.0.0.1, little-endian hex as the kernel prints it


def test_master_store_listens_on_loopback_only() -> None:
    store = open_store("127.0.0.1", 0, 2, is_master=True, timeout_s=10)
    assert listening_addresses(store.port) == {LOOPBACK_V4}
    client = open_store("127.0.0.1", store.port, 2, is_master=False, timeout_s=10)
    client.set("k", "v")  # the store serves through the descriptor it was handed
    assert store.get("k") == b"v"


def test_fixed_port_is_honoured() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = open_store("127.0.0.1", port, 1, is_master=True, timeout_s=10)
    assert store.port == port
    assert listening_addresses(port) == {LOOPBACK_V4}


def test_unbindable_address_raises() -> None:
    with pytest.raises(OSError):
        open_store("192.0.2.1", 0, 1, is_master=True, timeout_s=2)  # TEST-NET: not ours
