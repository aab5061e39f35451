"""Drives a run: prompts -> arrivals -> concurrent streamed requests -> BenchResult.

One process, one event loop (uvloop when present), one aiohttp ClientSession, so the load
generator costs as little CPU as possible on a small machine; its own CPU use is measured over
the load phase and reported. Arrivals follow vLLM: gamma inter-arrival times with shape
`burstiness` and mean 1/rate (burstiness 1 is Poisson), every request at t=0 when the rate is
inf; a semaphore caps the requests in flight. The first SIGINT stops sending, cancels what is in
flight and returns a partial result; a second SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import resource
import signal
import sys
import time
from contextlib import suppress
from dataclasses import dataclass

import aiohttp
import numpy as np
from tqdm import tqdm

from services.bench import datasets, metrics, spec_decode, tokenizer
from services.bench.client import OpenAIClient, RequestRecord, RequestStatus
from services.bench.config import BenchConfig
from services.bench.datasets import Prompt

_Task = asyncio.Task[RequestRecord | None]  # one request in flight: its record, None if unsent
_Pending = set[_Task]


@dataclass(frozen=True)
class LoadOutcome:
    records: list[RequestRecord]
    duration_s: float
    interrupted: bool
    not_sent: int
    cpu: metrics.ClientCpu


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times in seconds after the start: 0 first, then cumulative gamma gaps."""
    if math.isinf(rate):
        return np.zeros(n)
    # Its own stream, so the arrivals do not shift when the dataset draws more numbers.
    rng = np.random.default_rng([seed, 1])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])


class LoadRunner:
    """Sends the prompts on schedule, at most max_concurrency at a time, and collects records."""

    def __init__(self, client: OpenAIClient, config: BenchConfig) -> None:
        self._client = client
        self._config = config
        self._stop = asyncio.Event()
        limit = config.max_concurrency
        self._sem = asyncio.Semaphore(limit) if limit else None

    def interrupt(self) -> None:
        if not self._stop.is_set():
            print("\ninterrupted: cancelling requests in flight, keeping partial results "
                  "(Ctrl-C again to quit at once)", file=sys.stderr)
        self._stop.set()
        with suppress(ValueError, RuntimeError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)

    async def run(self, prompts: list[Prompt]) -> LoadOutcome:
        offsets = arrival_offsets(len(prompts), self._config.request_rate,
                                  self._config.burstiness, self._config.seed)
        loop = asyncio.get_running_loop()
        with suppress(NotImplementedError, RuntimeError):  # not the main thread: no handler
            loop.add_signal_handler(signal.SIGINT, self.interrupt)
        records: list[RequestRecord] = []
        bar = tqdm(total=len(prompts), unit="req", disable=not self._config.progress,
                   mininterval=0.5, file=sys.stderr)
        cpu0, ru0, start = time.process_time(), resource.getrusage(resource.RUSAGE_SELF), \
            time.perf_counter()
        try:
            pending = await self._dispatch(prompts, offsets, start, records, bar)
            await self._drain(pending)
        finally:
            with suppress(ValueError, RuntimeError):
                loop.remove_signal_handler(signal.SIGINT)
            bar.close()
        wall = time.perf_counter() - start
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = metrics.client_cpu(time.process_time() - cpu0, ru1.ru_utime - ru0.ru_utime,
                                 ru1.ru_stime - ru0.ru_stime, wall, self._config.cpu_warn_percent)
        records.sort(key=lambda r: r.index)
        return LoadOutcome(records, wall, self._stop.is_set(), len(prompts) - len(records), cpu)

    async def _dispatch(self, prompts: list[Prompt], offsets: np.ndarray, start: float,
                        records: list[RequestRecord], bar: tqdm) -> _Pending:
        pending: _Pending = set()
        failed = 0

        def done(task: _Task) -> None:
            nonlocal failed
            pending.discard(task)
            record = None if task.cancelled() else task.result()
            if record is None:
                return  # cancelled before it was sent
            records.append(record)
            if record.status is RequestStatus.FAILED:
                failed += 1
                bar.set_postfix(failed=failed, refresh=False)
            bar.update(1)

        for index, (prompt, offset) in enumerate(zip(prompts, offsets, strict=True)):
            delay = start + float(offset) - time.perf_counter()
            if delay > 0:
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
            if self._stop.is_set():
                break
            task = asyncio.create_task(self._one(index, prompt, start))
            pending.add(task)
            task.add_done_callback(done)
        return pending

    async def _drain(self, pending: _Pending) -> None:
        """Wait for the requests in flight, or cancel them all at the first SIGINT."""
        stop = asyncio.create_task(self._stop.wait())
        try:
            while pending and not self._stop.is_set():
                await asyncio.wait(set(pending) | {stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if pending:
            tasks = list(pending)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, index: int, prompt: Prompt, start: float) -> RequestRecord | None:
        if self._sem is not None:
            try:
                await self._sem.acquire()
            except asyncio.CancelledError:
                return None  # never sent: counted as not_sent
        try:
            return await self._client.send(index, prompt, start)
        except Exception as exc:  # a client bug shows up as an error type, not a lost run
            return RequestRecord(index, RequestStatus.FAILED, time.perf_counter() - start,
                                 prompt.prompt_len, prompt.output_len,
                                 error_type=f"client:{type(exc).__name__}", error=repr(exc))
        finally:
            if self._sem is not None:
                self._sem.release()


def new_session(config: BenchConfig) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=10)
    # No connector limit: the semaphore is the only cap. A 1 MiB read buffer keeps long SSE
    # lines (usage with extras, logprobs) within aiohttp's line limit.
    connector = aiohttp.TCPConnector(limit=0)
    return aiohttp.ClientSession(timeout=timeout, connector=connector, read_bufsize=2**20)


async def bench(config: BenchConfig) -> metrics.BenchResult:
    """Build the prompts (not timed), run the load, and compute the result."""
    async with new_session(config) as session:
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        codec = await tokenizer.connect(session, config.base_url, config.model, headers,
                                        config.tokenizer_model)
        if codec is None:
            print("warning: no tokenizer (server has no /tokenize and no --tokenizer-model): "
                  "prompts are plain words, input lengths come from the server's usage",
                  file=sys.stderr)
        prompts = await datasets.build_prompts(config, codec)
        before = await spec_decode.scrape(session, config.base_url, headers)
        outcome = await LoadRunner(OpenAIClient(session, config), config).run(prompts)
        after = await spec_decode.scrape(session, config.base_url, headers) if before else None
    result = metrics.compute(outcome.records, outcome.duration_s, slos_ms=config.goodput,
                             percentiles=config.percentiles, partial=outcome.interrupted,
                             not_sent=outcome.not_sent, client_cpu=outcome.cpu)
    return dataclasses.replace(result, spec_decode=spec_decode.summarise(before, after))


def run(config: BenchConfig) -> metrics.BenchResult:
    """Run `bench` on a fresh event loop (uvloop when installed: less client CPU per event)."""
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(bench(config))
