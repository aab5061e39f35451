"""Routing policies and prefix hashing as pure functions (no HTTP)."""

from __future__ import annotations

import hashlib
import random
from array import array

import pytest

from services.router.config import Policy
from services.router.policies import (
    Candidate,
    PolicyState,
    PrefixIndex,
    chained_block_hashes,
    least_loaded,
    pick,
    power_of_two,
    prefix_aware,
    round_robin,
)

C = [Candidate("a", running=3), Candidate("b", running=1, waiting=1), Candidate("c", running=5)]


def test_round_robin_cycles_in_order():
    state = PolicyState()
    picked = [pick(Policy.ROUND_ROBIN, C, state).id for _ in range(7)]
    assert picked == ["a", "b", "c", "a", "b", "c", "a"]
    assert round_robin(C, 4).id == "b"


def test_least_loaded_uses_the_fresher_of_worker_and_router_counts():
    assert least_loaded(C).id == "b"
    busy_b = [C[0], Candidate("b", running=1, waiting=1, inflight=9), C[2]]
    assert least_loaded(busy_b).id == "a"
    tie = [Candidate("x", 1, kv_usage=0.5), Candidate("y", 1, kv_usage=0.2)]
    assert least_loaded(tie).id == "y"  # equal load: lower KV usage wins


def test_power_of_two_picks_the_lighter_of_two_random_candidates():
    for seed in range(20):
        a, b = random.Random(seed).sample(C, 2)
        expected = a if (a.load, a.kv_usage) <= (b.load, b.kv_usage) else b
        assert power_of_two(C, random.Random(seed)).id == expected.id
    assert power_of_two(C[:1], random.Random(0)).id == "a"


def test_prefix_aware_prefers_the_longest_prefix_holder():
    assert prefix_aware(C, {"a": 3, "c": 1}, overload_abs=8, overload_rel=1.5).id == "a"


def test_prefix_aware_falls_back_to_load_when_no_prefix_or_overloaded():
    assert prefix_aware(C, {}, overload_abs=8, overload_rel=1.5).id == "b"
    hot = [Candidate("a", running=40), Candidate("b", running=2)]
    assert prefix_aware(hot, {"a": 5}, overload_abs=8, overload_rel=1.5).id == "b"
    # Past the absolute gap but not the relative one: still the prefix holder.
    warm = [Candidate("a", running=40), Candidate("b", running=30)]
    assert prefix_aware(warm, {"a": 5}, overload_abs=8, overload_rel=1.5).id == "a"


def test_pick_without_token_ids_treats_prefix_aware_as_least_loaded():
    assert pick(Policy.PREFIX_AWARE, C, PolicyState(), None).id == "b"
    with pytest.raises(ValueError):
        pick(Policy.LEAST_LOADED, [], PolicyState())


def _reference_hashes(tokens, bs):
    out, prev = [], b""
    for i in range(len(tokens) // bs):
        prev = hashlib.blake2b(prev + array("q", tokens[i * bs:(i + 1) * bs]).tobytes(),
                               digest_size=8).digest()
        out.append(prev)
    return out


def test_chained_block_hashes_cover_full_blocks_and_chain():
    tokens = list(range(10))
    hashes = chained_block_hashes(tokens, 4)
    assert hashes == _reference_hashes(tokens, 4) and len(hashes) == 2
    changed = chained_block_hashes([99] + tokens[1:], 4)
    assert all(x != y for x, y in zip(hashes, changed, strict=True))  # block 0 changes every link
    assert chained_block_hashes(tokens[:8] + [5, 5], 4) == hashes  # the tail block is ignored


def test_prefix_index_matches_leading_blocks_and_evicts():
    index = PrefixIndex(capacity=3)
    hashes = chained_block_hashes(list(range(16)), 4)
    index.record("w", hashes[:2])
    assert index.match("w", hashes) == 2
    assert index.match("other", hashes) == 0
    index.record("w", chained_block_hashes(list(range(100, 112)), 4))  # 3 new: evicts ours
    assert index.match("w", hashes) == 0
    index.forget("w")
    assert index.matches(["w"], hashes) == {"w": 0}
