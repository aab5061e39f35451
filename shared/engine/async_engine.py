"""AsyncEngine: one dedicated engine thread running LLMEngine.step(), bridged to asyncio.

Threading model: the engine thread owns the LLMEngine. Other threads never touch it; they
append commands (add, abort, KV-connector calls) to a queue guarded by a Condition, and the
thread runs them between steps. When there is nothing to compute the thread sleeps on the
Condition (no busy spin). Outputs go back with ONE `loop.call_soon_threadsafe` per step,
which puts each RequestOutput into its request's asyncio.Queue, hands that step's KV
progress (full prompt blocks of `on_kv_progress` requests) to their listeners, and then runs
the step listeners (the KV service reaps expired leases there: once per engine step).
If a step (or a command between steps) raises, the engine is FAILED: in this order, the
traceback is logged once, the state flips (no command gets in any more; later calls raise
EngineDeadError), every stream and KV-connector caller still waiting gets an ERROR output /
EngineDeadError, the failure listeners run (the worker turns unhealthy and exits), and only
then is the engine asked to finish its requests (`fail_all`, which decodes their tails and may
well raise again: that must not, and now cannot, keep anyone waiting).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from shared.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.kv_connector import (
    AsyncKVConnector,
    KVRequestOptions,
    KVRole,
    SchedulerKVConnector,
)
from shared.engine.kv_stream import KVProgress
from shared.engine.outputs import FinishReason, RequestOutput
from shared.engine.sampling_params import SamplingParams
from shared.engine.stats import EngineStats
from shared.engine.structured_spec import InvalidStructuredOutput, StructuredOutputSpec
from shared.model.config import ModelConfig
from shared.model.tokenizer import Tokenizer

T = TypeVar("T")
log = logging.getLogger(__name__)
_IDLE_WAIT_S = 1.0  # safety net only: every state change also notifies the condition
_GRAMMAR_THREADS = 2  # compiles run here: a runaway one can never starve asyncio's own pool


class EngineDeadError(RuntimeError):
    """The engine thread is not running (never started, shut down, or crashed)."""


class EngineState(StrEnum):
    """NEW -> RUNNING -> STOPPED (shutdown) or FAILED (an exception escaped a step)."""

    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"
    FAILED = "failed"


class AsyncEngine:
    """The services' handle on one engine; every public method is called from the event loop.

    After `await start()`: tokenizer, model_config, model_dir, max_model_len, fingerprint and
    a fresh engine_id are set. `generate` yields incremental RequestOutputs; leaving the
    iteration early (break + aclose, cancellation, GeneratorExit) aborts the request, which
    frees its blocks before the next step. `healthy` is True exactly while RUNNING; `failure`
    says why the engine FAILED. `kv_connector` is the P/D seam (shared.engine.kv_connector).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine: LLMEngine | None = None
        self.tokenizer: Tokenizer | None = None
        self.model_config: ModelConfig | None = None
        self.model_dir: Path | None = None
        self.max_model_len = 0
        self.fingerprint = ""
        self.engine_id = ""
        self.state = EngineState.NEW
        self.failure: str | None = None
        self._cond = threading.Condition()
        self._commands: deque[Callable[[LLMEngine], None]] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._running = threading.Event()  # set by start() once the engine is published
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._stats: EngineStats | None = None
        self._waiters: set[asyncio.Future[Any]] = set()  # pending _run_in_engine results
        self._kv_listeners: dict[str, Callable[[KVProgress], None]] = {}
        self._step_listeners: list[Callable[[], None]] = []
        self._failure_listeners: list[Callable[[str], None]] = []
        self._failure_told = False  # the failure listeners ran (event loop only)
        self._grammar_pool: ThreadPoolExecutor | None = None
        self.kv_connector = AsyncKVConnector(
            lambda fn: self._run_in_engine(lambda e: fn(SchedulerKVConnector(e))),
            lambda: self.streams_kv_progress, self.add_step_listener)

    @property
    def healthy(self) -> bool:
        return self.state is EngineState.RUNNING

    # ---- life cycle ------------------------------------------------------------------------
    async def start(self, engine: LLMEngine | None = None) -> None:
        """Load the model (or adopt a built `engine`), warm up, start: all on the engine
        thread, which keeps the process's torch work on one thread. Every thread that runs a
        parallel torch op keeps an OpenMP pool, and libgomp stops spinning at its barriers
        (the per-op regions of a step then sleep and wake) once the pools' threads outnumber
        the CPUs; see kernels/dense/csrc/decode_team.cpp."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._running.clear()
        built: asyncio.Future[LLMEngine] = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(engine, built),
                                        name="pdmesh-engine", daemon=True)
        self._thread.start()
        try:
            engine = await built
        except BaseException:  # a load or warm-up failure (the thread has ended), or a cancel
            self._running.set()  # not RUNNING: a load that was cancelled ends once built
            self._thread = None
            raise
        self.engine, self.tokenizer, self.model_config = engine, engine.tokenizer, engine.model_config
        self.model_dir, self.fingerprint = engine.model_dir, engine.fingerprint
        self.max_model_len = engine.max_model_len
        self.engine_id = uuid.uuid4().hex
        self._stats = engine.stats()
        self.state, self.failure = EngineState.RUNNING, None
        self._running.set()

    async def shutdown(self) -> None:
        """Abort everything (consumers get ABORT outputs) and stop the thread."""
        if self._grammar_pool is not None:  # a compile still running ends on its own
            self._grammar_pool.shutdown(wait=False, cancel_futures=True)
            self._grammar_pool = None
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(thread.join)
        self._thread = None
        if self.engine is not None:
            self.engine.close()

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self, engine: LLMEngine | None, built: asyncio.Future[LLMEngine]) -> None:
        try:
            if engine is None:
                engine = LLMEngine.from_config(self.config)
            engine.warmup()
        except BaseException as exc:  # noqa: BLE001 - start() raises it
            self._post(_settle, built, None, exc)
            return
        self._post(_settle, built, engine, None)
        self._running.wait()  # start() has published the engine (or given up on it)
        if self.state is not EngineState.RUNNING:  # start() was cancelled
            engine.close()
            return
        try:
            self._steps(engine)
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the consumers
            self._fail(engine, exc)
        finally:
            if self.state is EngineState.RUNNING:  # only if the failure handling itself broke
                self._close(EngineState.FAILED, "the engine thread ended unexpectedly")

    def _steps(self, engine: LLMEngine) -> None:
        """Run commands and steps until shut down; whatever raises ends the thread."""
        while True:
            with self._cond:
                if not self._commands and not self._stopping and not engine.has_work():
                    self._cond.wait(_IDLE_WAIT_S)
                commands, self._commands = self._commands, deque()
                stopping = self._stopping
            for command in commands:
                command(engine)
            if stopping:
                for rid in list(engine.scheduler.requests):
                    engine.abort_request(rid)
            outputs = engine.step()
            self._stats = engine.stats()
            self._deliver(outputs, engine.take_kv_progress(), step=True)
            if stopping:
                self._close(EngineState.STOPPED, "the engine was shut down")
                return

    def _fail(self, engine: LLMEngine, exc: BaseException) -> None:
        """Log the traceback (logging never raises), release everyone (state, waiting
        streams, listeners), and only then let the engine finish its requests: that last
        part runs the very code that just failed."""
        error = f"engine failed: {exc!r}"
        log.error("engine thread died; every request of this engine fails", exc_info=exc)
        self._close(EngineState.FAILED, error)
        try:
            self._deliver(engine.fail_all(error))  # frees blocks; partial outputs, if it can
        except BaseException as again:  # noqa: BLE001 - the streams already got their errors
            log.warning("finishing the failed engine's requests raised too: %r", again)

    def _close(self, state: EngineState, error: str) -> None:
        """Refuse further commands; whatever still waits on the engine gets `error`."""
        with self._cond:  # no command gets in after this; queued ones never run
            self.state = state
            self.failure = error if state is EngineState.FAILED else None
            self._commands.clear()
        self._post(self._fail_waiting, error, state is EngineState.FAILED)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run fn(*args) on the event loop (dropped if the loop is closed: nobody listens)."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:
                pass

    def _deliver(self, outputs: list[RequestOutput], progress: list[KVProgress] | None = None,
                 step: bool = False) -> None:
        """Hand one step's results to the loop (one call); `step` also runs step listeners."""
        if outputs or progress or step:
            self._post(self._put, outputs, progress or [], step)

    def _put(self, outputs: list[RequestOutput], progress: list[KVProgress], step: bool) -> None:
        # Progress first: a listener sees a request's blocks before its final output.
        for report in progress:
            listener = self._kv_listeners.get(report.request_id)
            if listener is not None:
                _call_listener(listener, report)
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        for fn in self._step_listeners if step else ():
            _call_listener(fn)

    def _fail_waiting(self, error: str, failed: bool) -> None:
        """On the loop: an ERROR output for every open stream (a consumer stops at its first
        finished output, so one that already got its own final output ignores this one),
        EngineDeadError for _run_in_engine callers, then the failure listeners."""
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(_error_output(rid, error))
        for future in list(self._waiters):
            _settle(future, None, EngineDeadError(error))
        if failed and not self._failure_told:
            self._failure_told = True
            for fn in list(self._failure_listeners):
                _call_listener(fn, error)

    def _submit(self, command: Callable[[LLMEngine], Any]) -> None:
        with self._cond:
            if not self.healthy or self._thread is None:
                raise EngineDeadError(f"the engine is not running ({self.failure or self.state})")
            self._commands.append(command)
            self._cond.notify()

    # ---- public API ------------------------------------------------------------------------
    @property
    def streams_kv_progress(self) -> bool:
        """Whether generate(on_kv_progress=...) reports blocks during the prompt: engines
        with a KV progress tracker do; for others the listener is dropped and the KV goes
        out once the prompt finished."""
        return self.engine is not None and self.engine.kv_stream is not None

    def add_failure_listener(self, fn: Callable[[str], None]) -> None:
        """Call `fn(reason)` on the event loop once, when the engine fails (not on shutdown);
        at once (soon) if it already has."""
        if self._failure_told:
            assert self._loop is not None and self.failure is not None
            self._loop.call_soon(_call_listener, fn, self.failure)
        else:
            self._failure_listeners.append(fn)

    def add_step_listener(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call `fn()` on the event loop after every engine step; returns the remover."""
        self._step_listeners.append(fn)
        return lambda: self._step_listeners.remove(fn) if fn in self._step_listeners else None

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, kv: KVRequestOptions | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Incremental outputs until one with `finished`. `kv` makes it a P/D request: HOLD
        keeps its blocks (and `kv.on_progress`, where the engine streams KV progress, is
        called on the loop as full prompt blocks are computed); AWAIT_REMOTE waits for
        `kv_connector.adopt`. Raises ValueError for an invalid request and EngineDeadError
        when the engine is down."""
        if self.engine is None:
            raise EngineDeadError("the engine is not started")
        self.engine.validate(prompt_token_ids, params)
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        stream_kv = kv is not None and kv.on_progress is not None and self.streams_kv_progress
        if stream_kv:
            assert kv is not None and kv.on_progress is not None
            self._kv_listeners[request_id] = kv.on_progress
        finished = False
        try:
            self._submit(lambda e: self._add(e, request_id, list(prompt_token_ids), params, kv,
                                             stream_kv))
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            self._kv_listeners.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def compile_grammar(self, spec: StructuredOutputSpec) -> None:
        """Compile `spec` into the engine's grammar cache off the event loop and the engine
        thread, so that adding the request finds it there. Raises InvalidStructuredOutput
        (with the API field in `param`) for a grammar that cannot compile, or that takes longer
        than `config.grammar_compile_timeout_s` (the compile may go on in the background)."""
        if self.engine is None:
            raise EngineDeadError("the engine is not started")
        self.engine.check_structured(spec)
        if self._grammar_pool is None:
            self._grammar_pool = ThreadPoolExecutor(_GRAMMAR_THREADS, "pdmesh-grammar")
        limit = self.config.grammar_compile_timeout_s
        job = asyncio.get_running_loop().run_in_executor(self._grammar_pool,
                                                         self.engine.grammars.compile, spec)
        job.add_done_callback(_retrieve)  # a compile that outlived its request: errors unread
        try:
            async with asyncio.timeout(limit):
                await asyncio.shield(job)  # a timeout leaves the compile running, not cancelled
        except TimeoutError:
            param = spec.param or "response_format"
            raise InvalidStructuredOutput(
                f"{param}: the {spec.kind.value} constraint did not compile within {limit:g} s",
                param) from None

    def activate_structured(self, request_id: str) -> None:
        """The request's reasoning ended: its grammar (a `reasoning_first` spec) applies from
        its next sampled token on. Thread-safe, never raises. Prefer the spec's
        `reasoning_end_ids`, which the engine matches itself at the exact token (the same on
        a mixed worker and after a P/D hand-off); this call lands between steps."""
        try:
            self._submit(lambda e: e.activate_structured(request_id))
        except EngineDeadError:
            pass

    def _add(self, engine: LLMEngine, request_id: str, prompt: list[int],
             params: SamplingParams, kv: KVRequestOptions | None, stream_kv: bool) -> None:
        role = kv.role if kv is not None else None
        try:
            engine.add_request(request_id, prompt, params, hold_kv=role is KVRole.HOLD,
                               wait_for_remote_kv=role is KVRole.AWAIT_REMOTE,
                               stream_kv=stream_kv)
        except Exception as exc:  # noqa: BLE001 - reported to this request only
            self._deliver([_error_output(request_id, str(exc), prompt)])

    def abort(self, request_id: str) -> None:
        """Thread-safe, never raises; the request's blocks are freed before the next step
        (a dead or stopped engine has nothing left to free)."""
        try:
            self._submit(lambda e: e.abort_request(request_id))
        except EngineDeadError:
            pass

    async def _run_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps and return its result (the
        KV connector's transport; services go through `kv_connector`'s typed methods)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def command(engine: LLMEngine) -> None:
            try:
                result = fn(engine)
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._waiters.add(future)
        try:
            self._submit(command)
            return await future
        finally:
            self._waiters.discard(future)

    def stats(self) -> EngineStats:
        """The snapshot published after the latest step (thread-safe, never blocks)."""
        if self._stats is None:
            raise EngineDeadError("the engine is not started")
        return self._stats


def _call_listener(fn: Callable[..., None], *args: Any) -> None:
    """A listener's failure is its own bug: log it, never let it break output delivery."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        log.exception("engine listener %r failed", fn)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _error_output(request_id: str, error: str, prompt: list[int] | None = None) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt_token_ids=prompt or [], new_token_ids=[],
                         new_text="", token_ids=[], text="", finished=True,
                         finish_reason=FinishReason.ERROR, error=error)
