"""benchmarks/two_hosts.py without namespaces: the ip/tc commands, the Link's clean-up on every
path, the KV throughput read from a real KV metrics registry, the table math, and the
no-root exit. The namespace run itself is a benchmark (it needs root and minutes).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from unittest import mock

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.kv_transfer.context import KVTransferMetrics

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# The scripts import each other by bare name; benchmarks/ leads sys.path only while they load
# (benchmarks/kernels.py must not shadow the `kernels` package afterwards).
with mock.patch.object(sys, "path", [str(BENCHMARKS), *sys.path]):
    link_mod = importlib.import_module("two_hosts_link")
    report = importlib.import_module("two_hosts_report")
    two_hosts = importlib.import_module("two_hosts")


@pytest.fixture(autouse=True)
def _keep_sys_path() -> Iterator[None]:
    saved = list(sys.path)
    yield
    sys.path[:] = saved


@pytest.mark.parametrize(("text", "bits"), [("10gbit", 10**10), ("1gbit", 10**9),
                                            ("500mbit", 5 * 10**8), ("2.5gbit", 25 * 10**8)])
def test_rates_parse_and_print_back(text, bits) -> None:
    assert link_mod.parse_rate(text) == bits
    assert link_mod.parse_rate(link_mod.format_rate(bits)) == bits


@pytest.mark.parametrize("bad", ["10gbps", "fast", "0gbit", ""])
def test_bad_rates_are_rejected(bad) -> None:
    with pytest.raises(ValueError):
        link_mod.parse_rate(bad)


def test_both_directions_are_shaped_with_a_bucket_for_the_rate() -> None:
    plan = link_mod.LinkPlan(ns_a="na", ns_b="nb")
    cmds = plan.shape_commands(10**10)
    assert {(c[2], c[6]) for c in cmds} == {("na", plan.dev_a), ("nb", plan.dev_b)}
    for cmd in cmds:
        args = dict(zip(cmd[9::2], cmd[10::2], strict=True))  # after "root tbf"
        assert cmd[:2] == ["tc", "-n"] and cmd[7:9] == ["root", "tbf"]
        assert args["rate"] == "10000000000bit"
        assert int(args["burst"]) == 10**10 // 8 // 1000  # one millisecond at line rate
    slow = dict(zip(plan.shape_commands(10**9)[0][9::2], plan.shape_commands(10**9)[0][10::2],
                    strict=True))
    assert int(slow["burst"]) == link_mod.MIN_BURST  # 125 kB would be below two GSO frames


def test_setup_joins_the_namespaces_with_addresses_and_loopback() -> None:
    plan = link_mod.LinkPlan(ns_a="na", ns_b="nb")
    flat = [" ".join(c) for c in plan.setup_commands()]
    assert flat[:2] == ["ip netns add na", "ip netns add nb"]
    assert "ip -n na addr add 10.77.0.1/24 dev veth-a" in flat
    assert "ip -n nb addr add 10.77.0.2/24 dev veth-b" in flat
    assert {"ip -n na link set lo up", "ip -n nb link set lo up"} <= set(flat)
    veth = next(c for c in flat if "veth" in c and "peer" in c)
    assert "netns na" in veth and "netns nb" in veth


class Recorder:
    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail_on = fail_on

    def __call__(self, cmd: Sequence[str]) -> None:
        line = " ".join(cmd)
        self.calls.append(line)
        if self.fail_on is not None and self.fail_on in line:
            raise RuntimeError(f"{line}: failed")


def test_close_deletes_both_namespaces_once_even_when_one_fails() -> None:
    run = Recorder(fail_on="netns del na")
    link = link_mod.Link(link_mod.LinkPlan(ns_a="na", ns_b="nb"), run)
    link.create()
    link.shape(10**9)
    errors = link.close()
    assert run.calls[-2:] == ["ip netns del na", "ip netns del nb"]
    assert len(errors) == 1 and "na" in errors[0]
    before = len(run.calls)
    assert link.close() == [] and len(run.calls) == before  # idempotent


def test_a_half_made_link_is_still_torn_down() -> None:
    run = Recorder(fail_on="type veth")
    link = link_mod.Link(link_mod.LinkPlan(ns_a="na", ns_b="nb"), run)
    with pytest.raises(RuntimeError):
        link.create()
    link.close()
    assert run.calls[-2:] == ["ip netns del na", "ip netns del nb"]


def test_never_created_link_runs_nothing_on_close() -> None:
    run = Recorder()
    assert link_mod.Link(link_mod.LinkPlan(ns_a="na", ns_b="nb"), run).close() == []
    assert run.calls == []


def test_kv_throughput_comes_from_the_timed_side_of_the_real_metrics() -> None:
    registry = CollectorRegistry()
    metrics = KVTransferMetrics(registry)
    metrics.observe("pull", "send", 9.0, 999)  # the prefill side of a pull: not the timed one
    before = report.kv_sums(generate_latest(registry).decode())
    pulls = [(0.25, 40 << 20), (0.5, 40 << 20)]
    for seconds, nbytes in pulls:
        metrics.observe("pull", "receive", seconds, nbytes)
    metrics.observe("push", "send", 0.125, 10 << 20)
    metrics.observe("push", "receive", 3.0, 10 << 20)  # includes the prompt: not the wire
    after = report.kv_sums(generate_latest(registry).decode())
    assert report.kv_delta(before, after, "pull") == (sum(b for _, b in pulls),
                                                      pytest.approx(0.75))
    assert report.kv_delta(before, after, "push") == (10 << 20, pytest.approx(0.125))


def test_line_fraction_is_bits_over_rate() -> None:
    assert report.line_fraction(125_000_000, 2.0, 10**9) == pytest.approx(0.5)
    assert report.line_fraction(0, 1.0, 10**9) is None
    assert report.line_fraction(10, 1.0, None) is None
    gbit, frac = report.kv_columns(1_250_000_000, 1.0, 10**10)
    assert gbit == pytest.approx(10.0) and frac == pytest.approx(1.0)


def row(path: str, ttft: float, e2el: float, link: str = "1gbit") -> object:
    return report.Row(link=link, prompt_len=2000, path=path, concurrency=1, requests=4,
                      failed=0, ttft_ms=ttft, t2_ms=None, itl_ms=None, e2el_ms=e2el, kv_bytes=0,
                      kv_s=0.0, kv_gbit_s=None, line_frac=None, load1=0.0)


def test_pd_is_compared_with_mixed_on_the_same_link_only() -> None:
    rows = [row("mixed", 200.0, 1000.0), row("pull", 300.0, 500.0),
            row("push", 100.0, 2000.0, link="10gbit")]
    lines = report.pd_vs_mixed(rows)
    assert len(lines) == 1  # push on 10gbit has no mixed row to compare with
    assert "TTFT x1.50" in lines[0] and "E2EL x0.50" in lines[0]
    assert all(report.format_row(r).count("-") >= 1 for r in rows)  # missing figures print "-"


def test_without_root_it_says_so_and_exits_zero(capsys) -> None:
    with mock.patch.object(two_hosts.os, "geteuid", return_value=1000), \
            mock.patch.object(two_hosts, "run", side_effect=AssertionError("must not run")):
        assert two_hosts.main(["--rates", "1gbit"]) == 0
    assert "needs root" in capsys.readouterr().out


def test_preflight_names_what_is_missing() -> None:
    assert two_hosts.preflight(0, "/usr/sbin/ip") is None
    assert "ip netns" in (two_hosts.preflight(0, None) or "")
    assert "root" in (two_hosts.preflight(1000, "/usr/sbin/ip") or "")
