"""Scheduler: budgets, chunked prefill, decode priority, preemption by recompute and aborts,
driven without a model (a fake step appends token 7 whenever a request samples)."""

from __future__ import annotations

import random

from shared.engine.block_manager import KVCacheManager
from shared.engine.request import Request, RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import ScheduledBatch, Scheduler

BS = 4


def make(num_blocks=64, seqs=8, tokens=32, chunked=True, caching=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(kv, max_num_seqs=seqs, max_num_batched_tokens=tokens,
                     enable_chunked_prefill=chunked)


def req(rid: str, n: int, max_tokens: int = 4, base: int = 0) -> Request:
    return Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens))


def step(s: Scheduler) -> ScheduledBatch:
    """One engine step with a fake runner; finishes requests that reached max_tokens."""
    batch = s.schedule()
    assert batch.total_num_scheduled_tokens <= s.max_num_batched_tokens
    assert len(s.running) <= s.max_num_seqs
    for r, c, n in zip(batch.requests, batch.num_computed_tokens, batch.num_scheduled_tokens,
                       strict=True):
        assert c + n <= r.num_tokens and len(r.block_table) * BS >= c + n
    updated = s.update_from_output(batch, [7 if x else None for x in batch.samples],
                                   [None] * len(batch.samples))
    for r in updated:
        if r.num_output_tokens >= r.params.max_tokens:
            s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    return batch


def sched_map(batch: ScheduledBatch) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(batch.requests, batch.num_scheduled_tokens, strict=True)}


def run_to_end(s: Scheduler, limit: int = 500) -> int:
    steps = 0
    while s.has_unfinished_requests():
        step(s)
        steps += 1
        assert steps < limit, "scheduler made no progress"
    return steps


def assert_all_free(s: Scheduler) -> None:
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert s.kv.ref_counts == [0] * s.kv.num_blocks


def test_max_num_seqs_and_token_budget():
    s = make(seqs=2, tokens=10)
    for i in range(3):
        s.add_request(req(f"r{i}", 8, base=100 * i))
    b = step(s)
    assert sched_map(b) == {"r0": 8, "r1": 2}  # r1's prompt is chunked to the budget
    assert b.samples == [True, False]
    b = step(s)
    assert sched_map(b) == {"r0": 1, "r1": 6}  # r2 waits: max_num_seqs=2
    assert [r.request_id for r in s.waiting] == ["r2"]
    run_to_end(s)
    assert_all_free(s)


def test_chunked_prefill_splits_long_prompt_and_samples_at_end():
    s = make(tokens=10)
    r = req("long", 25)
    s.add_request(r)
    chunks = [step(s) for _ in range(3)]
    assert [sched_map(b)["long"] for b in chunks] == [10, 10, 5]
    assert [b.samples for b in chunks] == [[False], [False], [True]]
    assert r.num_computed_tokens == 25 and r.output_token_ids == [7]


def test_decodes_are_scheduled_before_partial_prefills():
    s = make(tokens=8)
    s.add_request(req("a", 3, max_tokens=10))
    step(s)
    s.add_request(req("b", 20, base=50))
    b = step(s)
    assert sched_map(b) == {"a": 1, "b": 7}
    b = step(s)
    assert sched_map(b) == {"a": 1, "b": 7}
    assert b.requests[0].request_id == "a"


def test_without_chunking_a_prompt_waits_for_room():
    s = make(tokens=10, chunked=False)
    s.add_request(req("a", 6))
    s.add_request(req("b", 6, base=50))
    b = step(s)
    assert sched_map(b) == {"a": 6}  # b does not fit the 4 remaining tokens
    b = step(s)
    assert sched_map(b) == {"a": 1, "b": 6}


def test_preemption_frees_victim_and_requeues_it_first():
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens growing by 12 tokens each.
    s = make(num_blocks=6, tokens=64)
    a, b = req("a", 8, max_tokens=12), req("b", 8, max_tokens=12, base=50)
    s.add_request(a)
    s.add_request(b)
    seen_preempted = False
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        before = s.num_preemptions
        step(s)
        if s.num_preemptions > before:
            # b arrived last, so it is the victim; it is back at the head of waiting.
            assert b.status in (RequestStatus.PREEMPTED, RequestStatus.RUNNING)
            assert s.waiting and s.waiting[0] is b or b.status == RequestStatus.RUNNING
            seen_preempted = True
    assert seen_preempted and s.num_preemptions >= 1 and b.num_preemptions >= 1
    assert a.num_preemptions == 0
    assert a.output_token_ids == [7] * 12 and b.output_token_ids == [7] * 12
    assert_all_free(s)


def test_preempted_request_recomputes_prompt_and_outputs():
    s = make(num_blocks=5, tokens=64, caching=False)
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8, base=50)
    s.add_request(a)
    s.add_request(b)
    recomputes = []
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        batch = step(s)
        m = sched_map(batch)
        if "b" in m and m["b"] > 1 and b.num_preemptions:
            recomputes.append(m["b"])
    assert b.num_preemptions >= 1
    # The recompute covers prompt + the outputs generated before preemption, in one chunk.
    assert recomputes and all(n > 8 for n in recomputes)
    assert_all_free(s)


def test_self_preemption_when_alone_and_blocked_by_held_blocks():
    s = make(num_blocks=3, tokens=64)
    held = s.kv.allocate_blocks(2 * BS)
    r = req("r", 3, max_tokens=6)
    s.add_request(r)
    step(s)  # prompt at positions 0-2 (block 0), samples token 4
    step(s)  # position 3 still fits in block 0
    step(s)  # position 4 needs a second block: none free, r preempts itself
    assert r.status == RequestStatus.PREEMPTED and s.num_preemptions == 1
    assert step(s).is_empty  # cannot be readmitted while the blocks are held
    s.kv.free_blocks(held)
    run_to_end(s)
    assert r.output_token_ids == [7] * 6
    assert_all_free(s)


def test_aborts_at_any_step_leave_no_blocks():
    rng = random.Random(0)
    for trial in range(30):
        s = make(num_blocks=rng.choice([6, 10, 40]), tokens=rng.choice([8, 16, 64]),
                 seqs=rng.choice([2, 4, 8]))
        ids = []
        for i in range(6):
            s.add_request(req(f"t{trial}-{i}", rng.randint(1, 12), max_tokens=rng.randint(1, 8),
                              base=rng.choice([0, 100])))
            ids.append(f"t{trial}-{i}")
        for _ in range(rng.randint(0, 12)):
            step(s)
            if rng.random() < 0.4:
                s.finish_request(rng.choice(ids), RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        assert not s.running and not s.waiting
        assert_all_free(s)


def test_prefix_hit_skips_cached_tokens():
    s = make(tokens=64)
    a = req("a", 10, max_tokens=1)
    s.add_request(a)
    run_to_end(s)
    b = Request("b", list(range(9)) + [99], SamplingParams(max_tokens=1))
    s.add_request(b)
    batch = step(s)
    assert sched_map(batch) == {"b": 2} and b.num_cached_tokens == 8
    assert s.kv.prefix_cache_hits == 8


def test_waiting_for_remote_kv_keeps_its_place():
    s = make(tokens=64)
    parked = req("parked", 4)
    parked.status = RequestStatus.WAITING_FOR_REMOTE_KV
    s.add_request(parked)
    s.add_request(req("next", 4, base=10))
    b = step(s)
    assert sched_map(b) == {"next": 4} and s.waiting[0] is parked
    parked.status = RequestStatus.WAITING
    assert "parked" in sched_map(step(s))
