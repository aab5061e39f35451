"""Worker-selection policies: pure functions from candidates (and a little state) to one choice.

Each policy sees `Candidate` snapshots (never live `Worker` objects), so the unit tests need no
HTTP and no registry. `pick` dispatches on the `Policy` enum.

Prefix-aware routing works on chained block hashes of the prompt tokens: block i's hash covers
block i's tokens *and* block i-1's hash, so equal hashes at position i mean equal prompts up to
the end of block i (the engines' prefix cache chains the same way). Only full blocks are hashed.
`PrefixIndex` remembers, per worker, the hashes of prompts recently sent there (bounded LRU): a
guess at what the worker's prefix cache holds, without any events from it.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from services.router.config import Policy
from services.router.workers import Worker


@dataclass(frozen=True)
class Candidate:
    """A worker as the policies see it: id and load figures.

    `running`/`waiting` are the worker's own counts at its last health check; `inflight` is what
    this router has on it now. `load` takes the larger of the two views: the worker's figure also
    covers other routers, the router's own is fresher.
    """

    id: str
    running: int = 0
    waiting: int = 0
    inflight: int = 0
    kv_usage: float = 0.0

    @property
    def load(self) -> int:
        return max(self.running + self.waiting, self.inflight)

    @staticmethod
    def of(worker: Worker) -> Candidate:
        md = worker.metadata
        if md is None:
            return Candidate(worker.id, inflight=worker.inflight)
        return Candidate(worker.id, md.running, md.waiting, worker.inflight, md.kv_usage)


@dataclass
class PolicyState:
    """The only mutable inputs: the round-robin counter and the random source (seedable)."""

    counter: int = 0
    rng: random.Random = field(default_factory=random.Random)


def _key(c: Candidate) -> tuple[int, float]:
    return (c.load, c.kv_usage)


def round_robin(candidates: Sequence[Candidate], counter: int) -> Candidate:
    return candidates[counter % len(candidates)]


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    """Lowest load, then lowest KV usage; ties go to the earliest candidate."""
    return min(candidates, key=_key)


def power_of_two(candidates: Sequence[Candidate], rng: random.Random) -> Candidate:
    """Two distinct random candidates, the less loaded one wins (the first drawn on a tie)."""
    if len(candidates) == 1:
        return candidates[0]
    a, b = rng.sample(list(candidates), 2)
    return b if _key(b) < _key(a) else a


def prefix_aware(candidates: Sequence[Candidate], matches: Mapping[str, int], *,
                 overload_abs: int, overload_rel: float) -> Candidate:
    """The candidate holding the longest prefix of the prompt, unless it is overloaded.

    Overloaded means its load exceeds the least-loaded candidate's by more than `overload_abs`
    *and* is more than `overload_rel` times it (SGLang's cache-aware rule); then, or when no
    candidate holds any prefix block, the least-loaded candidate wins.
    """
    best = max(candidates, key=lambda c: (matches.get(c.id, 0), -c.load, -c.kv_usage))
    lightest = least_loaded(candidates)
    if matches.get(best.id, 0) == 0:
        return lightest
    gap = best.load - lightest.load
    if gap > overload_abs and best.load > overload_rel * lightest.load:
        return lightest
    return best


def pick(policy: Policy, candidates: Sequence[Candidate], state: PolicyState,
         matches: Mapping[str, int] | None = None, *, overload_abs: int = 8,
         overload_rel: float = 1.5) -> Candidate:
    """Dispatch on `policy`; prefix-aware without `matches` (no token ids) acts as least-loaded."""
    if not candidates:
        raise ValueError("no candidates to pick from")
    if policy is Policy.ROUND_ROBIN:
        state.counter += 1
        return round_robin(candidates, state.counter - 1)
    if policy is Policy.POWER_OF_TWO:
        return power_of_two(candidates, state.rng)
    if policy is Policy.PREFIX_AWARE and matches is not None:
        return prefix_aware(candidates, matches, overload_abs=overload_abs,
                            overload_rel=overload_rel)
    return least_loaded(candidates)


BlockHash = bytes


def chained_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """One 8-byte hash per *full* block of `token_ids`, each chained on the previous one."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    hashes: list[BlockHash] = []
    prev = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = array("q", token_ids[start:start + block_size]).tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=8).digest()
        hashes.append(prev)
    return hashes


class PrefixIndex:
    """Per-worker LRU sets of block hashes, capped at `capacity` hashes per worker.

    `match(worker, hashes)` is the number of leading blocks of the prompt the worker is believed
    to hold. Because hashes are chained, a hit on block i implies the whole prefix up to i, so
    the longest hit is found by scanning from the end.
    """

    def __init__(self, capacity: int = 65536) -> None:
        self._capacity = capacity
        self._blocks: dict[str, OrderedDict[BlockHash, None]] = {}

    def record(self, worker_id: str, hashes: Iterable[BlockHash]) -> None:
        blocks = self._blocks.setdefault(worker_id, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self._capacity:
            blocks.popitem(last=False)

    def match(self, worker_id: str, hashes: Sequence[BlockHash]) -> int:
        blocks = self._blocks.get(worker_id)
        if not blocks:
            return 0
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in blocks:
                return i + 1
        return 0

    def matches(self, worker_ids: Iterable[str], hashes: Sequence[BlockHash]) -> dict[str, int]:
        return {w: self.match(w, hashes) for w in worker_ids}

    def forget(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)
