"""The simulated link of benchmarks/two_hosts.py: two network namespaces joined by a veth pair,
each direction shaped by a tbf qdisc (token bucket: `rate`, `burst`, and a queue bounded by
`latency`). netem is not available on these kernels, so the link adds no propagation delay:
it behaves like two hosts on one switch, whose RTT (tens of microseconds) is close to a veth's.

Everything here only builds `ip`/`tc` argument lists (pure, unit-tested) or runs them through
one `run` callable; `Link.close` is idempotent and never raises, so every exit path can call it.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

KIB = 1024
MIN_BURST = 128 * KIB  # two 64 KiB GSO frames: a smaller bucket makes tbf split every frame
QUEUE_LATENCY_MS = 10  # tbf's queue holds this long at line rate before it drops
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)bit$")
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}

Runner = Callable[[Sequence[str]], None]


def parse_rate(text: str) -> int:
    """'10gbit' -> 10_000_000_000 bits/s (tc's decimal units). Raises ValueError."""
    m = _RATE.match(text.strip().lower())
    if m is None:
        raise ValueError(f"link rate must look like 10gbit, 1gbit or 500mbit, got {text!r}")
    bits = int(float(m.group(1)) * _SCALE[m.group(2)])
    if bits <= 0:
        raise ValueError(f"link rate must be > 0, got {text!r}")
    return bits


def format_rate(bits: int) -> str:
    """10_000_000_000 -> '10gbit' (the largest unit that divides exactly)."""
    for unit in ("g", "m", "k"):
        if bits % _SCALE[unit] == 0:
            return f"{bits // _SCALE[unit]}{unit}bit"
    return f"{bits}bit"


def tbf_burst(rate_bit: int) -> int:
    """Bucket size in bytes: one millisecond at line rate, at least MIN_BURST. Large enough
    to reach the rate with hrtimer-paced dequeues, small enough that a 40 MiB transfer
    cannot ride the bucket (10 Gbit/s: 1.25 MB; 1 Gbit/s: 128 KiB)."""
    return max(rate_bit // 8 // 1000, MIN_BURST)


def tbf_args(rate_bit: int) -> list[str]:
    return ["tbf", "rate", f"{rate_bit}bit", "burst", str(tbf_burst(rate_bit)),
            "latency", f"{QUEUE_LATENCY_MS}ms"]


@dataclass(frozen=True)
class LinkPlan:
    """Names and addresses of one simulated two-host link (host A and host B)."""

    ns_a: str
    ns_b: str
    addr_a: str = "10.77.0.1"
    addr_b: str = "10.77.0.2"
    prefix_len: int = 24
    dev_a: str = "veth-a"  # interface names live inside the namespaces: no clash outside
    dev_b: str = "veth-b"

    def setup_commands(self) -> list[list[str]]:
        """Create both namespaces, the veth pair between them, addresses, and bring all up."""
        cmds = [["ip", "netns", "add", self.ns_a], ["ip", "netns", "add", self.ns_b],
                ["ip", "link", "add", self.dev_a, "netns", self.ns_a, "type", "veth",
                 "peer", "name", self.dev_b, "netns", self.ns_b]]
        for ns, dev, addr in ((self.ns_a, self.dev_a, self.addr_a),
                              (self.ns_b, self.dev_b, self.addr_b)):
            cmds += [["ip", "-n", ns, "addr", "add", f"{addr}/{self.prefix_len}", "dev", dev],
                     ["ip", "-n", ns, "link", "set", "lo", "up"],
                     ["ip", "-n", ns, "link", "set", dev, "up"]]
        return cmds

    def shape_commands(self, rate_bit: int) -> list[list[str]]:
        """Rate-limit both directions: each side's egress qdisc shapes what it sends."""
        return [["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf_args(rate_bit)]
                for ns, dev in ((self.ns_a, self.dev_a), (self.ns_b, self.dev_b))]

    def teardown_commands(self) -> list[list[str]]:
        """Deleting a namespace destroys its end of the veth, and with it the other end."""
        return [["ip", "netns", "del", self.ns_a], ["ip", "netns", "del", self.ns_b]]


def run_checked(cmd: Sequence[str]) -> None:
    out = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip() or out.returncode}")


class Link:
    """Owns the namespaces of one LinkPlan from `create` to `close`."""

    def __init__(self, plan: LinkPlan, run: Runner = run_checked) -> None:
        self.plan = plan
        self._run = run
        self._created = False
        self.rate_bit: int | None = None

    def create(self) -> None:
        self._created = True  # set first: a half-made link is still torn down
        for cmd in self.plan.setup_commands():
            self._run(cmd)

    def shape(self, rate_bit: int) -> None:
        for cmd in self.plan.shape_commands(rate_bit):
            self._run(cmd)
        self.rate_bit = rate_bit

    def close(self) -> list[str]:
        """Delete the namespaces (each attempted even if one fails); returns the errors."""
        if not self._created:
            return []
        self._created = False
        errors = []
        for cmd in self.plan.teardown_commands():
            try:
                self._run(cmd)
            except (RuntimeError, OSError) as exc:
                errors.append(str(exc))
        return errors
