"""Lanes: the N microbatch streams of a pipeline, each with its own Scheduler over one cache.

A request is put in one lane when it arrives (the least loaded) and stays there; a lane has
at most one step in flight and is scheduled again only after that step's tokens came back.
So a request belongs to at most one in-flight microbatch, and preemption (which only picks
victims among the lane's own running requests) never touches a request that is in flight.
All lanes share one KVCacheManager, so blocks and the prefix cache are pooled.

`LaneScheduler` also presents the lanes as one Scheduler (`requests`, `running`, `waiting`,
`add_request`, `finish_request`, `num_preemptions`), which is all LLMEngine's request-level
methods (add, abort, fail_all, stats, warmup) need of `engine.scheduler`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from shared.engine.block_manager import KVCacheManager
from shared.engine.request import Request, RequestStatus
from shared.engine.scheduler import ScheduledBatch, Scheduler
from shared.engine.spec.drafter import Drafter
from shared.pipeline.handoff import TokenHandoff


@dataclass
class InFlightStep:
    """A step sent down the pipeline whose results stage 0 has not consumed yet."""

    step_id: int
    batch: ScheduledBatch
    handoff: TokenHandoff | None  # None: no row samples, so nothing comes back


@dataclass
class Lane:
    index: int
    scheduler: Scheduler
    inflight: InFlightStep | None = None


class LaneScheduler:
    """N lanes (one per pipeline stage) behind the Scheduler interface; engine thread only.

    Each lane gets max_num_batched_tokens per step (a step is one forward) and
    ceil(max_num_seqs / N) running requests, so at most about max_num_seqs run in total.
    `on_finish(request)` runs for every request that leaves, however it finished.
    """

    def __init__(self, kv: KVCacheManager, num_lanes: int, *, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool,
                 on_finish: Callable[[Request], None]) -> None:
        per_lane = math.ceil(max_num_seqs / num_lanes)
        self.lanes = [Lane(i, Scheduler(kv, max_num_seqs=per_lane,
                                        max_num_batched_tokens=max_num_batched_tokens,
                                        enable_chunked_prefill=enable_chunked_prefill))
                      for i in range(num_lanes)]
        self.requests: dict[str, Request] = {}
        # Scheduler's surface: pipelines never speculate (PipelineEngine refuses the config).
        self.drafter: Drafter | None = None
        self._lane_of: dict[str, Lane] = {}
        self._on_finish = on_finish
        self._cursor = 0

    def next_lane(self) -> Lane:
        """Round robin: the lane whose turn it is to step."""
        lane = self.lanes[self._cursor]
        self._cursor = (self._cursor + 1) % len(self.lanes)
        return lane

    def lane_of(self, request_id: str) -> Lane | None:
        return self._lane_of.get(request_id)

    # ---- the Scheduler surface used by LLMEngine ---------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        lane = min(self.lanes, key=lambda ln: len(ln.scheduler.requests))
        lane.scheduler.add_request(request)
        self.requests[request.request_id] = request
        self._lane_of[request.request_id] = lane

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        lane = self._lane_of.pop(request_id, None)
        if lane is None:
            return None
        del self.requests[request_id]
        request = lane.scheduler.finish_request(request_id, status)
        assert request is not None
        self._on_finish(request)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def running(self) -> list[Request]:
        return [r for lane in self.lanes for r in lane.scheduler.running]

    @property
    def waiting(self) -> list[Request]:
        return [r for lane in self.lanes for r in lane.scheduler.waiting]

    @property
    def num_preemptions(self) -> int:
        return sum(lane.scheduler.num_preemptions for lane in self.lanes)

    @num_preemptions.setter
    def num_preemptions(self, value: int) -> None:
        if value != 0:
            raise ValueError("the preemption counter can only be reset to 0")
        for lane in self.lanes:
            lane.scheduler.num_preemptions = 0
