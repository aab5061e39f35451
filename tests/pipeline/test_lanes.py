"""LaneScheduler: lanes share one block pool, requests stay in their lane, and the lanes
together look like one Scheduler to LLMEngine's request-level methods. No processes."""

from __future__ import annotations

from shared.engine.block_manager import KVCacheManager
from shared.engine.request import Request, RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.pipeline.lanes import LaneScheduler


def lanes(num_lanes: int = 2, max_num_seqs: int = 4, blocks: int = 64):
    finished: list[str] = []
    kv = KVCacheManager(blocks, 16, enable_prefix_caching=True)
    sched = LaneScheduler(kv, num_lanes, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                          enable_chunked_prefill=True,
                          on_finish=lambda r: finished.append(r.request_id))
    return sched, kv, finished


def request(rid: str, n: int = 8) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4))


def test_requests_spread_over_lanes_and_stay_there():
    sched, _, _ = lanes()
    for i in range(5):
        sched.add_request(request(f"r{i}"))
    sizes = [len(lane.scheduler.requests) for lane in sched.lanes]
    assert sizes == [3, 2]
    assert sched.lane_of("r0") is sched.lanes[0] and sched.lane_of("r1") is sched.lanes[1]
    assert len(sched.requests) == 5 and len(sched.waiting) == 5 and not sched.running


def test_each_lane_schedules_only_its_own_requests_within_its_share():
    sched, kv, _ = lanes(max_num_seqs=4)  # 2 per lane
    for i in range(6):
        sched.add_request(request(f"r{i}"))
    a = sched.next_lane().scheduler.schedule()
    b = sched.next_lane().scheduler.schedule()
    ids_a = {r.request_id for r in a.requests}
    ids_b = {r.request_id for r in b.requests}
    assert ids_a == {"r0", "r2"} and ids_b == {"r1", "r3"}
    assert len(sched.running) == 4 and kv.num_free_blocks == 64 - 4
    assert sched.next_lane() is sched.lanes[0]  # round robin


def test_finish_goes_through_the_right_lane_and_reports():
    sched, kv, finished = lanes()
    for i in range(3):
        sched.add_request(request(f"r{i}"))
    sched.lanes[1].scheduler.schedule()
    req = sched.finish_request("r1", RequestStatus.FINISHED_ABORTED)
    assert req is not None and req.status is RequestStatus.FINISHED_ABORTED
    assert finished == ["r1"] and "r1" not in sched.requests
    assert kv.num_free_blocks == 64
    assert sched.finish_request("r1", RequestStatus.FINISHED_ABORTED) is None
    assert sched.has_unfinished_requests()


def test_preemption_counter_sums_lanes_and_resets():
    sched, _, _ = lanes()
    sched.lanes[0].scheduler.num_preemptions = 2
    sched.lanes[1].scheduler.num_preemptions = 3
    assert sched.num_preemptions == 5
    sched.num_preemptions = 0
    assert sched.num_preemptions == 0
