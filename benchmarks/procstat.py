"""What /proc says about one process: CPU seconds, resident memory, open file descriptors.

Linux only (the benchmarks run there); a process that is gone reads as None.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class ProcSample:
    cpu_s: float  # user + system, since the process started
    rss_bytes: int
    open_fds: int


def sample(pid: int) -> ProcSample | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) may hold spaces: split after its closing parenthesis.
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/statm") as f:
            rss_pages = int(f.read().split()[1])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    utime, stime = int(fields[11]), int(fields[12])  # stat fields 14 and 15
    return ProcSample((utime + stime) / _TICKS, rss_pages * _PAGE, fds)


def children(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's list)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []
    return out


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except FileNotFoundError:
        return []
