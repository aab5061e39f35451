"""KVCacheManager: exact block ids, reference counts, LRU tail-first eviction, prefix hits,
held blocks and the P/D allocation hooks. The oracle is hand-computed block bookkeeping."""

from __future__ import annotations

import pytest

from shared.engine.block_manager import KVCacheManager
from shared.engine.request import Request, RequestStatus
from shared.engine.sampling_params import SamplingParams

BS = 4


def make_req(tokens: list[int], rid: str = "r", hold: bool = False) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), hold_kv=hold)


def compute(kv: KVCacheManager, req: Request, n: int | None = None) -> None:
    """Admit `req` (with its prefix hit) and pretend n (default: all) tokens were computed."""
    hit = kv.get_computed_blocks(req)
    n = req.num_tokens - req.num_computed_tokens - hit.num_tokens if n is None else n
    assert kv.allocate_slots(req, n, hit)
    req.num_computed_tokens += hit.num_tokens + n
    kv.cache_computed_blocks(req)


def finish(kv: KVCacheManager, req: Request, status=RequestStatus.FINISHED_STOPPED) -> None:
    req.status = status
    kv.free(req)


def assert_all_free(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.ref_counts == [0] * kv.num_blocks
    assert kv.num_held_blocks == 0


def test_allocation_ids_refcounts_and_tail_first_eviction():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_req(list(range(10)), "a")
    compute(kv, a)
    assert a.block_table == [0, 1, 2]
    assert kv.ref_counts[:4] == [1, 1, 1, 0] and kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)
    finish(kv, a)
    assert a.block_table == []
    # Free queue is now 3,4,5,6,7 then a's blocks tail-first: 2,1,0.
    b = make_req(list(range(100, 124)), "b")
    compute(kv, b)
    assert b.block_table == [3, 4, 5, 6, 7, 2]
    finish(kv, b)
    assert_all_free(kv)


def test_decode_growth_allocates_one_block_at_boundary():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    r = make_req([1, 2, 3, 4], "r")
    compute(kv, r)
    assert r.block_table == [0]
    r.append_output_token(9)
    assert kv.allocate_slots(r, 1)  # position 4 opens block 1
    assert r.block_table == [0, 1]
    r.num_computed_tokens += 1
    r.append_output_token(9)
    assert kv.allocate_slots(r, 1) and r.block_table == [0, 1]  # position 5 fits in block 1
    finish(kv, r)
    assert_all_free(kv)


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    r = make_req(list(range(13)), "r")
    assert not kv.allocate_slots(r, 13)
    assert r.block_table == [] and kv.num_free_blocks == 3


def test_prefix_hit_full_blocks_only_and_never_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_req(list(range(10)), "a")  # full blocks: [0..3], [4..7]
    compute(kv, a)
    finish(kv, a)
    b = make_req(list(range(8)) + [77, 78, 79], "b")
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == [0, 1] and hit.num_tokens == 8
    # Exactly two full blocks: the last token must be computed, so only one block hits.
    c = make_req(list(range(8)), "c")
    assert kv.get_computed_blocks(c).block_ids == [0]
    # Same second block tokens under a different first block: the chain breaks at block 0.
    d = make_req([9, 9, 9, 9] + list(range(4, 8)) + [1], "d")
    assert kv.get_computed_blocks(d).num_tokens == 0
    # A partial block is never cached.
    e = make_req(list(range(10)) + [5, 5, 5], "e")
    assert kv.get_computed_blocks(e).num_tokens == 8


def test_prefix_hit_counters_and_shared_refcounts():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_req(list(range(10)), "a")
    compute(kv, a)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)
    b = make_req(list(range(9)) + [50, 51, 52], "b")
    compute(kv, b)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (22, 8)
    assert b.block_table[:2] == a.block_table[:2]
    assert kv.ref_counts[a.block_table[0]] == 2 and kv.ref_counts[a.block_table[2]] == 1
    finish(kv, a)
    assert kv.ref_counts[b.block_table[0]] == 1
    finish(kv, b)
    assert_all_free(kv)


def test_hit_revives_free_block_and_eviction_drops_key():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_req(list(range(9)), "a")
    compute(kv, a)  # blocks 0, 1 full and cached; block 2 partial
    finish(kv, a)  # free queue: 3, 2, 1, 0
    b = make_req(list(range(8)) + [100], "b")
    compute(kv, b)
    assert b.block_table == [0, 1, 3]  # 0 and 1 revived from the free queue, 3 popped
    finish(kv, b)  # free queue: 2, 3, 1, 0
    # Fill the cache with other tokens: LRU pops 2, 3, then 1 (b's later block) first.
    c = make_req(list(range(200, 209)), "c")
    compute(kv, c)
    assert c.block_table == [2, 3, 1]
    finish(kv, c)
    d = make_req(list(range(8)) + [100], "d")
    hit = kv.get_computed_blocks(d)
    assert hit.block_ids == [0]  # block 1 was evicted, block 0 survives (tail-first)


def test_held_blocks_survive_finish_until_released():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    p = make_req(list(range(9)), "p", hold=True)
    compute(kv, p)
    blocks = list(p.block_table)
    finish(kv, p)
    assert kv.held_block_ids("p") == blocks and kv.num_held_blocks == 3
    assert kv.num_free_blocks == 5 and all(kv.ref_counts[b] == 1 for b in blocks)
    # Held blocks are not evictable: allocating everything else leaves them alone.
    assert kv.allocate_blocks(5 * BS) == [3, 4, 5, 6, 7]
    assert kv.allocate_blocks(1) is None
    assert kv.release_held("p") and not kv.release_held("p")
    assert kv.held_block_ids("p") is None
    kv.free_blocks([3, 4, 5, 6, 7])
    assert_all_free(kv)


def test_aborted_hold_request_frees_at_once():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    p = make_req(list(range(9)), "p", hold=True)
    compute(kv, p)
    finish(kv, p, RequestStatus.FINISHED_ABORTED)
    assert kv.held_block_ids("p") is None
    assert_all_free(kv)


def test_adopt_prefilled_blocks_registers_prefix_hashes():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    blocks = kv.allocate_blocks(10)
    assert blocks == [0, 1, 2]
    r = make_req(list(range(10)), "d")
    kv.adopt_blocks(r, blocks, 10)
    assert r.block_table == blocks and r.num_computed_tokens == 10
    other = make_req(list(range(10)) + [1], "o")
    assert kv.get_computed_blocks(other).block_ids == [0, 1]
    with pytest.raises(ValueError):
        kv.adopt_blocks(make_req([1, 2], "x"), [5, 6], 2)  # 2 blocks cannot hold exactly 2 tokens
    with pytest.raises(ValueError):
        kv.free_blocks([7])  # never allocated
    finish(kv, r)
    assert_all_free(kv)


def test_reset_prefix_cache_forgets_keys():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_req(list(range(9)), "a")
    compute(kv, a)
    finish(kv, a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_req(list(range(9)), "b")).num_tokens == 0
    assert kv.prefix_cache_queries == 0
