"""``AsyncLLM``: one engine loop serving many asyncio callers from another thread, the role of
vllm/v1/engine/async_llm.py (vLLM runs EngineCore in another process and talks to it over ZMQ; here
two threads and two queues keep everything in one process, so a breakpoint in
``Scheduler.schedule`` still works while a server runs).

Callers (HTTP handlers on the event loop) never touch the engine: ``generate()`` puts an "add"
command in an inbox and awaits an ``asyncio.Queue`` that the engine loop fills with
``RequestOutput`` objects after every ``LLMEngine.step()``. Requests that arrive while a step runs
join the batch at the next step: this is continuous batching across HTTP requests.

Which thread runs the engine loop matters for speed on the CPU. ``minivllm serve`` runs it in
the process's main thread (``run_engine_loop``) and the event loop in a second thread, the same
split as vLLM's EngineCore process, whose model runs in that process's main thread. The reason
is OpenMP (libgomp, which PyTorch's CPU wheels use): every thread that starts a parallel region
gets its own team of worker threads, and once the process has more of them than cores, idle
workers stop spinning and sleep, so every parallel region pays a wake-up. The model is loaded
in the main thread, so its team exists; an engine loop in a second thread then runs with two
teams. Measured on a 2-core CPU: one parallel ``add`` of 200,000 floats took 14 us in the main
thread and 72 us in a second thread, and float32 SmolLM2's 8-request decode step 60-70 ms
against 85-100 ms. ``start()`` (a background engine thread, for callers that own the main
thread: a notebook's event loop) stays correct, only slower there.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

import torch

from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


class EngineOverloadedError(RuntimeError):
    """More requests in flight than ``max_pending_requests``: the server answers 503."""


class DuplicateRequestError(ValueError):
    """A request id that is already in flight: the caller's fault (HTTP 400)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an exception; every request in flight gets this."""


# Bucket edges of vLLM's histograms (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


@dataclass
class Histogram:
    buckets: list[float]
    counts: list[int] = field(default_factory=list)   # one per bucket, not cumulative
    sum: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1


@dataclass
class ServeStats:
    """What ``/metrics`` reports beyond ``LLM.get_metrics()``: measured on the engine thread at the
    moment a step's outputs are handed to the callers (vLLM measures in its output processor)."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict = field(default_factory=dict)      # finish_reason -> count
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))


@dataclass
class _RequestState:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival_time: float
    last_time: float = 0.0
    num_tokens: int = 0


class AsyncLLM:
    """Wraps an ``LLM``; ``start()`` launches the engine thread, ``shutdown()`` stops it."""

    def __init__(self, llm: Any, max_pending_requests: int = 256) -> None:
        if max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be >= 1, got {max_pending_requests}.")
        self.llm = llm
        self.engine = llm.llm_engine
        self.max_pending_requests = max_pending_requests
        self.stats = ServeStats()
        self.errored: Optional[BaseException] = None
        self._lock = threading.Lock()              # guards _inbox and _states
        self._inbox: list[tuple] = []
        self._states: dict[str, _RequestState] = {}   # by engine id
        self._in_flight: set[str] = set()              # the callers' ids
        self._serial = itertools.count()
        self._wakeup = threading.Event()
        self._stop = False
        self._running = False                  # the engine loop is (about to be) running
        self._thread: Optional[threading.Thread] = None   # set by start()

    # ------------------------------------------------------------------ caller side (event loop)
    @property
    def is_running(self) -> bool:
        return self._running and self.errored is None

    @property
    def num_pending(self) -> int:
        return len(self._states)

    def _claim_loop(self) -> None:
        """Mark the loop running before it starts, so no caller finds it not yet up."""
        if self._running:
            raise RuntimeError("the engine loop is already running.")
        self._running = True

    def start(self) -> "AsyncLLM":
        """Run the engine loop in a background thread (see the module docstring for the cost)."""
        self._claim_loop()
        self._thread = threading.Thread(target=self._run_in_background,
                                        args=(torch.get_num_threads(),),
                                        name="minivllm-engine-loop", daemon=True)
        self._thread.start()
        return self

    def run_engine_loop(self, started: Optional[Callable[[], None]] = None) -> None:
        """Run the engine loop in the calling thread until ``shutdown()`` (from another thread)
        or an engine error. ``started`` is called once the loop counts as running: the caller
        starts its HTTP server there, so no request finds the loop not yet up."""
        self._claim_loop()
        if started is not None:
            started()
        self._run()

    def shutdown(self) -> None:
        """Stop the engine loop after its current step; waits for it when it runs in a
        background thread (``start``), returns at once otherwise."""
        self._stop = True
        self._wakeup.set()
        if self._thread is not None and self._thread.is_alive() \
                and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    async def generate(self, request_id: str, prompt: Any,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative ``RequestOutput`` after every engine step that advanced
        it, the last one with ``finished=True``. Closing the iterator early (a client that went
        away) aborts the request, which frees its KV blocks."""
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running ({self.errored!r}).")
        state = _RequestState(asyncio.get_running_loop(), asyncio.Queue(), time.monotonic())
        # The engine's id is made unique, as vLLM's AsyncLLM does: a caller may reuse an id the
        # moment its last output arrived (the P/D proxy sends prefill and decode the same
        # X-Request-Id), while the engine may still hold the old request for a step.
        engine_id = f"{request_id}-{next(self._serial)}"
        with self._lock:
            if request_id in self._in_flight:
                raise DuplicateRequestError(f"request id {request_id!r} is already in flight; "
                                            "give each request its own id.")
            if len(self._states) >= self.max_pending_requests:
                raise EngineOverloadedError(
                    f"server overloaded: {len(self._states)} requests in flight, the limit is "
                    f"max_pending_requests={self.max_pending_requests}; retry later.")
            self._in_flight.add(request_id)
            self._states[engine_id] = state
            self._inbox.append(("add", engine_id, prompt, params))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await state.queue.get()
                # Outputs are cumulative: when this caller fell behind, only the newest counts
                # (one SSE chunk carries all the new text instead of one chunk per step).
                while not state.queue.empty() and isinstance(item, RequestOutput) \
                        and not item.finished:
                    item = state.queue.get_nowait()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                item.request_id = request_id      # a fresh object per step: the caller's id
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._in_flight.discard(request_id)
            if not finished:
                self.abort(engine_id)

    def abort(self, engine_id: str) -> None:
        """Abort by the engine's id (``generate`` does it when its caller goes away)."""
        with self._lock:
            self._inbox.append(("abort", engine_id))
        self._wakeup.set()

    # ------------------------------------------------------------------ engine thread
    def _deliver(self, request_id: str, item: Any, final: bool) -> None:
        with self._lock:
            state = self._states.pop(request_id, None) if final else self._states.get(request_id)
        if state is not None and not state.loop.is_closed():
            state.loop.call_soon_threadsafe(state.queue.put_nowait, item)

    def _handle_commands(self) -> None:
        with self._lock:
            commands, self._inbox = self._inbox, []
        for command in commands:
            if command[0] == "add":
                _, request_id, prompt, params = command
                try:
                    self.engine.add_request(request_id, prompt, params)
                except Exception as e:     # noqa: BLE001 (checked before queueing; a last guard)
                    self._deliver(request_id, e, final=True)
            else:
                request_id = command[1]
                with self._lock:
                    self._states.pop(request_id, None)
                if request_id in self.engine.scheduler.requests:
                    self.engine.abort_request([request_id])

    def _record(self, out: RequestOutput, now: float) -> None:
        with self._lock:
            state = self._states.get(out.request_id)
        if state is None:
            return
        n = len(out.outputs[0].token_ids)
        if n > state.num_tokens:
            if state.num_tokens == 0:
                self.stats.ttft.observe(now - state.arrival_time)
                self.stats.prompt_tokens += len(out.prompt_token_ids)
            else:
                self.stats.itl.observe(now - state.last_time)
            self.stats.generation_tokens += n - state.num_tokens
            state.num_tokens, state.last_time = n, now
        if out.finished:
            self.stats.e2e.observe(now - state.arrival_time)
            reason = out.outputs[0].finish_reason or "abort"
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def _run_in_background(self, num_threads: int) -> None:
        # The caller's count, not the default a side thread may have lowered
        # (utils.keep_off_openmp).
        torch.set_num_threads(num_threads)
        self._run()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._running = False

    def _loop(self) -> None:
        while not self._stop:
            self._wakeup.clear()
            self._handle_commands()
            if not self.engine.has_unfinished_requests():
                if not self.engine.has_requests():
                    self._wakeup.wait(timeout=0.5)
                    continue
                self._wakeup.wait(timeout=0.01)   # only held blocks left: step, but gently
            try:
                outputs = self.engine.step()
            except Exception as e:        # noqa: BLE001 (reported to every caller, then we stop)
                self.errored = e
                with self._lock:
                    ids = list(self._states)
                for request_id in ids:
                    self._deliver(request_id, EngineDeadError(f"engine step failed: {e!r}"), True)
                return
            now = time.monotonic()
            for out in outputs:
                self._record(out, now)
            self._deliver_step(outputs)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """One wake-up of each event loop per step, not one per request: every
        ``call_soon_threadsafe`` writes to the loop's self-pipe and hands the GIL over, which
        stalls the engine thread between steps."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outputs:
                state = (self._states.pop(out.request_id, None) if out.finished
                         else self._states.get(out.request_id))
                if state is not None:
                    by_loop.setdefault(state.loop, []).append((state.queue, out))
        for loop, items in by_loop.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)
