"""StageGroup: spawns stage processes 1..N-1 and makes the calling process rank 0.

Start-up order (each step bounded by `connect_timeout_s`, and a stage that dies is reported
at once instead of waiting out the timeout):
    1. rank 0 opens the TCP store (port 0 picks a free port) and spawns the stages;
    2. every stage loads its layers and reports on a status queue (rank 0 loads its own
       layers meanwhile);
    3. once all reported, every rank joins the gloo process group.
Shutdown is graceful when the pipeline is healthy (the caller has drained it and sent
SHUTDOWN down the chain), else the processes are killed. Either way the process group is
destroyed, so a new pipeline can start in the same process (a worker restart).
"""

from __future__ import annotations

import logging
import queue
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from shared.pipeline.channel import join_group, leave_group, open_store
from shared.pipeline.config import PipelineConfig
from shared.pipeline.handoff import PipelineError
from shared.pipeline.stage import StageSpec, stage_main

log = logging.getLogger(__name__)
_POLL_S = 0.2


class StageGroup:
    """The stage processes of one pipeline; rank 0 is the process that builds this."""

    def __init__(self, pipeline: PipelineConfig, *, model_dir: Path, dtype: str,
                 layer_ranges: tuple[tuple[int, int], ...], block_size: int, seed: int,
                 num_threads: int, kv_cache: torch.Tensor, counters: torch.Tensor,
                 kernel_tier: str = "auto",
                 token_gate: Any = None, step_gate: Any = None) -> None:
        self.pipeline = pipeline
        ctx = mp.get_context("spawn")
        self._status = ctx.Queue()
        self.store = open_store(pipeline.master_addr, pipeline.master_port, pipeline.pp_size,
                                is_master=True, timeout_s=pipeline.connect_timeout_s)
        self.procs: dict[int, Any] = {}
        self.joined = False
        for rank in range(1, pipeline.pp_size):
            spec = StageSpec(rank, pipeline, self.store.port, Path(model_dir), dtype,
                             layer_ranges[rank], block_size, seed, num_threads, kernel_tier)
            gates = (token_gate, step_gate) if spec.is_last else (None, None)
            proc = ctx.Process(target=stage_main, name=f"pdmesh-stage-{rank}", daemon=True,
                               args=(spec, kv_cache, counters, self._status, *gates))
            proc.start()
            self.procs[rank] = proc

    def check_alive(self) -> None:
        """Raise PipelineError if any stage process has exited (cheap: a waitpid)."""
        for rank, proc in self.procs.items():
            if proc.exitcode is not None:
                raise PipelineError(f"pipeline stage {rank} exited (code {proc.exitcode})")

    def wait_ready(self) -> None:
        """Wait until every stage loaded its layers, then join the process group as rank 0."""
        deadline = time.monotonic() + self.pipeline.connect_timeout_s
        waiting = set(self.procs)
        while waiting:
            try:
                rank, error = self._status.get(timeout=_POLL_S)
            except queue.Empty:
                self.check_alive()
                if time.monotonic() > deadline:
                    raise PipelineError(f"stages {sorted(waiting)} did not start within "
                                        f"{self.pipeline.connect_timeout_s} s") from None
                continue
            if error is not None:
                raise PipelineError(f"pipeline stage {rank} {error}")
            waiting.discard(rank)
        join_group(self.store, self.pipeline.bind_addr(0), 0, self.pipeline.pp_size)
        self.joined = True

    def stop(self, graceful: bool) -> None:
        """Let the stages exit (graceful: they received SHUTDOWN) or kill them; then leave
        the group. Never raises; safe to call twice."""
        timeout = self.pipeline.step_timeout_s if graceful else 0.0
        deadline = time.monotonic() + timeout
        for rank, proc in self.procs.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                if graceful:
                    log.warning("pipeline stage %d did not exit; killing it", rank)
                proc.kill()
                proc.join(5.0)
        if self.joined:
            leave_group()
            self.joined = False
        self._status.close()
        self._status.join_thread()
