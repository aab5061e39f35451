"""CoreShare: sibling engines on one host lend each other their threads while idle.

The ledger is checked against its rule (own share plus the shares of idle or dead siblings,
never more), then an engine is run with a sibling idle and busy: its steps take the lent
threads, hand them back when it has no work, and produce the same greedy tokens as an engine
that shares nothing.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from shared.engine.core_share import CoreShare
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    return tmp_path / "cores"


@pytest.fixture
def keep_torch_threads() -> Iterator[None]:
    """The engine sets torch's (process-wide) thread count: give the next test its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_busy_engine_runs_on_its_share_plus_the_idle_siblings(ledger: Path) -> None:
    a, b, c = CoreShare(ledger, 2), CoreShare(ledger, 1), CoreShare(ledger, 1)
    assert len({a.slot, b.slot, c.slot}) == 3
    assert a.claim() == 4  # b and c idle: all their threads
    assert b.claim() == 2  # a busy, c idle
    assert c.claim() == 1  # both busy: its own share only
    assert a.claim() == 2  # re-read at every step
    b.release()
    assert a.claim() == 3 and c.claim() == 2
    assert (a.borrowed_steps, b.borrowed_steps, c.borrowed_steps) == (2, 1, 1)
    c.close()  # a closed sibling's share leaves the ledger
    b.release()
    assert a.claim() == 3
    for share in (a, b):
        share.close()


def test_a_dead_siblings_share_is_lent_and_its_slot_reused(ledger: Path) -> None:
    """A worker killed mid-step leaves its slot marked busy: its pid is gone, so it counts
    as idle, and the next worker to start takes the slot over."""
    a = CoreShare(ledger, 1)
    code = (f"from pathlib import Path; from shared.engine.core_share import CoreShare; "
            f"s = CoreShare(Path({str(ledger)!r}), 1); s.claim(); print(s.slot)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2])
    dead_slot = int(out.stdout)  # the process exited without close(): still marked busy
    assert a.slot != dead_slot
    assert a.claim() == 2
    b = CoreShare(ledger, 1)
    assert b.slot == dead_slot
    b.claim()
    assert a.claim() == 1
    a.close()
    b.close()


def test_a_share_needs_a_thread_of_its_own(ledger: Path) -> None:
    with pytest.raises(ValueError, match=">= 1 thread"):
        CoreShare(ledger, 0)


def _tokens(engine: LLMEngine, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("r", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.token_ids)
    return tokens


@pytest.mark.usefixtures("keep_torch_threads")
def test_an_engine_borrows_an_idle_siblings_threads_and_lends_its_own(
        make_engine: Callable[..., LLMEngine], ledger: Path) -> None:
    prompt = list(range(3, 40))
    alone = make_engine()
    reference = _tokens(alone, prompt)

    sibling = CoreShare(ledger, 1)
    engine = make_engine(core_share=ledger)  # num_threads=1: its own share
    try:
        assert _tokens(engine, prompt) == reference
        stats = engine.stats()
        assert stats.num_threads == 2 and stats.num_borrowed_thread_steps >= 12
        assert sibling.claim() == 2  # the engine finished: its thread is lent back

        steps = stats.num_borrowed_thread_steps
        engine.add_request("r2", prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                        ignore_eos=True))
        engine.step()  # the sibling is busy now: the engine runs on its own thread
        assert engine.stats().num_threads == 1 == torch.get_num_threads()
        assert engine.stats().num_borrowed_thread_steps == steps
        assert sibling.claim() == 1  # and the engine, mid-request, lends nothing
        engine.abort_request("r2")
        engine.step()
        assert sibling.claim() == 2
    finally:
        engine.close()
        sibling.close()
