"""Entering a network namespace: how a stage process reaches the far side of a link.

Python 3.11 has no os.setns (3.12 does), so libc's setns(2) is called through ctypes. Network
namespaces are per thread: the caller must enter before it opens any socket or starts the
threads that will (gloo's device loop, the TCP store client), which then inherit it.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

CLONE_NEWNET = 0x40000000  # <sched.h>
NETNS_DIR = Path("/run/netns")  # where `ip netns add NAME` pins a namespace


def netns_path(name: str) -> Path:
    """/run/netns/NAME for an `ip netns` name; raises ValueError for anything path-like."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"not an `ip netns` name: {name!r}")
    return NETNS_DIR / name


def enter_netns(name: str) -> None:
    """Move the calling thread into network namespace `name`. Raises OSError when the
    namespace does not exist or the process lacks CAP_SYS_ADMIN."""
    fd = os.open(netns_path(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns_net(fd)
    finally:
        os.close(fd)


def setns_net(fd: int) -> None:
    """Move the calling thread into the network namespace open as `fd` (a /run/netns entry,
    or /proc/self/ns/net opened earlier: how a thread gets back to where it started)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into a network namespace: {os.strerror(err)}")
