"""One engine in virtual time: the real ``EngineCore`` (engine/core.py: vllm/v1/engine/core.py)
with the ``SimulatedWorker`` chosen through ``ParallelConfig.worker_cls``. No vLLM file: a thin
driver in the place of vllm/v1/engine/llm_engine.py, taking requests with their output lengths
(``add_request``) and stepping the core (``step``), each step stamped with the virtual times it
started and ended. No article step of its own: every step is the article's ``EngineCore.step()``
(a breakpoint in ``Scheduler.schedule`` stops in it).

- Per request: arrival, first token, each token, finish (``RequestTimes``: TTFT, ITL, E2E).
- The engine's own KV cache events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``,
  core/kv_events_block_pool.py) when ``kv_events=True``: each ``StepResult`` carries its step's,
  for a fleet's ``KVIndex`` (disagg/fleet/kv_index.py ``KVIndex.apply``).
- ``run_trace``: a trace (trace.py) through the engine: each request added when the clock reaches
  its arrival (a chat's next turn once its previous turn finished), the clock jumping over idle
  time. ``summarize``: DESIGN.md 5.8's summary line.
"""
from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Union

from minivllm.config import (CacheConfig, DeviceConfig, KVEventsConfig, ModelConfig,
                             ParallelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig)
from minivllm.core.sched.output import SchedulerOutput
from minivllm.engine.core import EngineCore
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams
from minivllm.sim.cost_model import CostModel, StepShape
from minivllm.sim.trace import TraceRequest
from minivllm.sim.worker import DraftSource, SimulatedWorker

SIMULATED_WORKER = "minivllm.sim.worker.SimulatedWorker"


@dataclass
class RequestTimes:
    """A request's virtual timestamps (seconds). ``token_times_s``: when each output token came
    (tokens accepted together share their step's end), kept only when the engine records them."""
    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    first_token_s: Optional[float] = None
    last_token_s: Optional[float] = None
    finish_s: Optional[float] = None
    num_output_tokens: int = 0
    token_times_s: Optional[list[float]] = None

    @property
    def ttft_s(self) -> Optional[float]:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> Optional[float]:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def itl_s(self) -> Optional[float]:
        """The request's mean inter-token latency, (last token - first token) / (tokens - 1)
        (its TPOT, what DistServe's per-request SLO bounds); None with fewer than two tokens."""
        if self.num_output_tokens < 2 or self.last_token_s is None:
            return None
        return (self.last_token_s - self.first_token_s) / (self.num_output_tokens - 1)


@dataclass
class StepResult:
    """One step: its virtual start and end, tokens emitted per request, requests finished, what the
    scheduler scheduled (None when there was nothing to step), its shape, and, with
    ``kv_events``, the prefix cache's events of the step."""
    start_s: float
    end_s: float
    new_tokens: dict[str, int]
    finished: list[str]
    scheduler_output: Optional[SchedulerOutput]
    shape: StepShape
    kv_events: list = field(default_factory=list)


class _KVEventCollector:
    """A KV event publisher that keeps the batches' events until taken (the simulator's, in place
    of ZMQ)."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def take(self) -> list:
        events, self.events = self.events, []
        return events

    def shutdown(self) -> None:
        return None


def make_vllm_config(model: str, *, hf_config: Any = None, model_path: Optional[str] = None,
                     speculative_config: Union[dict, SpeculativeConfig, None] = None,
                     seed: int = 0, block_size: int = 16, enable_prefix_caching: bool = True,
                     max_model_len: Optional[int] = None, max_num_seqs: int = 128,
                     max_num_batched_tokens: Optional[int] = None,
                     num_gpu_blocks_override: Optional[int] = None, dtype: str = "auto",
                     device: str = "cpu", kv_cache_memory_bytes: Optional[int] = None,
                     enable_chunked_prefill: bool = True) -> VllmConfig:
    """The ``VllmConfig`` that ``LLM(model, ...)`` builds from the same arguments (its names and
    defaults; entrypoints/llm.py), with the simulated worker and without reading any weights:
    only the checkpoint's config (``hf_config``, read from ``model`` when not given)."""
    device_config = DeviceConfig(device=device, attention_backend="torch")
    model_config = ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len,
                               skip_tokenizer_init=True, seed=seed)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                               num_gpu_blocks_override=num_gpu_blocks_override,
                               kv_cache_memory_bytes=kv_cache_memory_bytes)
    spec = SpeculativeConfig.from_dict(speculative_config)
    if hf_config is None:
        from minivllm.model_executor.model_loader import load_hf_config, resolve_model_path
        model_path = resolve_model_path(model)
        hf_config = load_hf_config(model_path)
    model_config.verify_with_hf_config(hf_config)
    sched_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, enable_chunked_prefill=enable_chunked_prefill,
        max_num_batched_tokens=max_num_batched_tokens or max(
            4096, min(model_config.max_model_len, 8192)))
    if spec is not None:
        spec.verify_with_hf_config(hf_config)
    return VllmConfig(model_config, cache_config, sched_config, spec, None,
                      device=device_config.device, attention_backend="torch",
                      hf_config=hf_config, model_path=model_path,
                      parallel_config=ParallelConfig(worker_cls=SIMULATED_WORKER))


class SimEngine:
    """The real engine core on a virtual clock. ``vllm_config.parallel_config.worker_cls`` is set
    to the simulated worker; everything else runs as configured."""
    worker_cls = SIMULATED_WORKER      # a subclass may name a subclass of SimulatedWorker

    def __init__(self, vllm_config: VllmConfig, cost_model: CostModel,
                 drafts: Optional[DraftSource] = None, *, kv_events: bool = False,
                 record_token_times: bool = True) -> None:
        vllm_config = dataclasses.replace(
            vllm_config, parallel_config=ParallelConfig(worker_cls=self.worker_cls))
        self.vllm_config = vllm_config
        self.core = EngineCore(vllm_config)
        self.worker: SimulatedWorker = self.core.worker
        self.worker.simulate_with(cost_model, drafts)
        self.cost_model = cost_model
        self._kv_events: Optional[_KVEventCollector] = None
        if kv_events:
            from minivllm.core.kv_events_block_pool import attach_kv_events
            self._kv_events = _KVEventCollector()
            attach_kv_events(self.core, KVEventsConfig(enable_kv_cache_events=True,
                                                       publisher="null"), self._kv_events)
        hf = vllm_config.hf_config
        eos = hf.eos_token_id[0] if isinstance(hf.eos_token_id, list) else hf.eos_token_id
        self.eos_token_id: Optional[int] = eos
        self.record_token_times = record_token_times
        self.times: dict[str, RequestTimes] = {}
        self.num_steps = 0

    @classmethod
    def from_engine_args(cls, model: str, cost_model: CostModel,
                         drafts: Optional[DraftSource] = None, *, kv_events: bool = False,
                         record_token_times: bool = True, **engine_args: Any) -> "SimEngine":
        """``engine_args``: ``LLM``'s (``block_size``, ``max_num_seqs``,
        ``max_num_batched_tokens``, ``num_gpu_blocks_override``, ``speculative_config``, ...;
        ``make_vllm_config``)."""
        return cls(make_vllm_config(model, **engine_args), cost_model, drafts,
                   kv_events=kv_events, record_token_times=record_token_times)

    @property
    def clock(self) -> float:
        """Virtual seconds: the end of the last step, or the last arrival the engine idled to."""
        return self.worker.clock

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    def has_unfinished_requests(self) -> bool:
        return self.core.scheduler.has_unfinished_requests()

    def has_requests(self) -> bool:
        """Whether ``step`` has work (unfinished requests, or finished ones still to be freed)."""
        return self.core.scheduler.has_requests()

    def advance_to(self, t: float) -> None:
        """Idle until ``t``: only when nothing is unfinished (a busy engine's clock is its
        steps')."""
        if t > self.worker.clock and self.has_unfinished_requests():
            raise ValueError(f"the engine is busy until its next step ends; it cannot idle to "
                             f"{t} (clock {self.worker.clock}).")
        self.worker.advance_clock_to(t)

    def add_request(self, request_id: str, prompt_token_ids: list[int], output_tokens: int,
                    arrival_s: Optional[float] = None,
                    kv_transfer_params: Optional[dict] = None) -> Request:
        """Queue a request that arrived at ``arrival_s`` (default: now). It runs exactly
        ``output_tokens`` tokens (``SamplingParams(max_tokens=output_tokens, ignore_eos=True)``:
        the scheduler's own length check ends it), fewer only if ``max_model_len`` cuts it. An
        arrival later than the clock is allowed only while the engine is idle: the clock jumps to
        it. ``kv_transfer_params``: P/D's, as a client sends them (vLLM reads them from
        ``SamplingParams.extra_args``); the fleet simulator's prefill and decode calls."""
        max_model_len = self.vllm_config.model_config.max_model_len
        if not 0 < len(prompt_token_ids) < max_model_len:
            raise ValueError(f"request {request_id}: a prompt needs 1 to {max_model_len - 1} "
                             f"tokens (max_model_len={max_model_len}), got "
                             f"{len(prompt_token_ids)}.")
        if output_tokens < 1:
            raise ValueError(f"request {request_id}: output_tokens must be >= 1, "
                             f"got {output_tokens}.")
        if request_id in self.times or request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in this engine.")
        arrival = self.clock if arrival_s is None else arrival_s
        if arrival > self.clock:
            self.advance_to(arrival)
        params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, extra_args=None if
                                kv_transfer_params is None else
                                {"kv_transfer_params": kv_transfer_params})
        request = self.scheduler.make_request(request_id, list(prompt_token_ids), params,
                                              self.eos_token_id)
        self.times[request_id] = RequestTimes(
            request_id, arrival, len(prompt_token_ids),
            token_times_s=[] if self.record_token_times else None)
        self.core.add_request(request)
        return request

    def step(self) -> StepResult:
        """One ``EngineCore.step()``; the clock advances by the cost model's time for it."""
        start = self.worker.clock
        if not self.has_requests():
            return StepResult(start, start, {}, [], None, StepShape())
        outputs = self.core.step()
        end = self.worker.clock
        self.num_steps += 1
        new_tokens: dict[str, int] = {}
        finished: list[str] = []
        for request, token_ids in outputs:
            times = self.times[request.request_id]
            n = len(token_ids)
            if n:
                new_tokens[request.request_id] = n
                if times.first_token_s is None:
                    times.first_token_s = end
                times.last_token_s = end
                times.num_output_tokens += n
                if times.token_times_s is not None:
                    times.token_times_s.extend([end] * n)
            if request.is_finished():
                times.finish_s = end
                finished.append(request.request_id)
        return StepResult(start, end, new_tokens, finished, self.worker.last_scheduler_output,
                          self.worker.last_shape or StepShape(),
                          self._kv_events.take() if self._kv_events is not None else [])

    def pop_times(self, request_id: str) -> RequestTimes:
        """A request's timestamps, forgotten by the engine (a long simulation keeps memory flat)."""
        return self.times.pop(request_id)

    def check_trace(self, requests: Sequence[TraceRequest]) -> None:
        """``ValueError`` naming the first request this engine cannot take (a prompt not under
        ``max_model_len``, token ids outside the vocabulary, an id used twice), before any step."""
        max_model_len = self.vllm_config.model_config.max_model_len
        vocab = int(self.vllm_config.hf_config.vocab_size)
        seen: set[str] = set()
        for r in requests:
            if r.prompt_tokens >= max_model_len:
                raise ValueError(f"request {r.request_id}: {r.prompt_tokens} prompt tokens leave "
                                 f"no room under max_model_len={max_model_len}.")
            if r.prompt_token_ids is not None and max(r.prompt_token_ids) >= vocab:
                raise ValueError(f"request {r.request_id}: prompt_token_ids must be in "
                                 f"[0, {vocab}) for this model's vocabulary.")
            if r.request_id in seen or r.request_id in self.times:
                raise ValueError(f"request id {r.request_id!r} is used twice.")
            seen.add(r.request_id)

    def run_trace(self, requests: Sequence[TraceRequest], seed: int = 0,
                  progress: bool = False) -> list[RequestTimes]:
        """Every request of the trace through the engine, to the last finish; -> the requests'
        times in trace order. A request is added once the clock reaches its ``arrival_s`` (those
        arriving during a step join after it, as a server's engine loop takes them); a turn of a
        ``conversation`` waits for the previous turn to finish (the multi-turn benchmark's
        closed loop). The clock jumps over idle time. ``seed``: the token ids of lines given
        by length (``TraceRequest.prompt_ids``)."""
        self.check_trace(requests)
        vocab = int(self.vllm_config.hf_config.vocab_size)
        later: dict[str, deque] = {}
        ready: list[tuple[float, int, TraceRequest]] = []
        for i, r in enumerate(requests):
            if r.conversation is not None and r.conversation in later:
                later[r.conversation].append((i, r))
                continue
            if r.conversation is not None:
                later[r.conversation] = deque()
            heapq.heappush(ready, (r.arrival_s, i, r))
        conversation_of = {r.request_id: r.conversation for r in requests
                           if r.conversation is not None}
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(requests), desc="simulated requests", dynamic_ncols=True)
        while ready or self.has_requests():
            while ready and ready[0][0] <= self.clock:
                release, _, r = heapq.heappop(ready)
                self.add_request(r.request_id, r.prompt_ids(vocab, seed), r.output_tokens,
                                 arrival_s=release)
            if not self.has_requests():
                self.advance_to(ready[0][0])
                continue
            result = self.step()
            for req_id in result.finished:
                conv = conversation_of.get(req_id)
                if conv is not None and later[conv]:
                    i, nxt = later[conv].popleft()
                    heapq.heappush(ready, (max(nxt.arrival_s, result.end_s), i, nxt))
            if bar is not None and result.finished:
                bar.update(len(result.finished))
        if bar is not None:
            bar.close()
        return [self.times[r.request_id] for r in requests]


def _percentile(values: Sequence[float], q: float) -> Optional[float]:
    import numpy as np
    return float(np.percentile(values, q)) if len(values) else None


def summarize(times: Iterable[RequestTimes]) -> dict[str, Any]:
    """DESIGN.md 5.8's summary: TTFT and ITL (each request's mean inter-token latency) p50 and
    p90, the makespan (first arrival to last finish) and the number of requests."""
    times = list(times)
    ttft = [t.ttft_s for t in times if t.ttft_s is not None]
    itl = [t.itl_s for t in times if t.itl_s is not None]
    done = [t.finish_s for t in times if t.finish_s is not None]
    makespan = (max(done) - min(t.arrival_s for t in times)) if done else None
    return {"ttft_p50_s": _percentile(ttft, 50), "ttft_p90_s": _percentile(ttft, 90),
            "itl_p50_s": _percentile(itl, 50), "itl_p90_s": _percentile(itl, 90),
            "makespan_s": makespan, "num_requests": len(times)}
