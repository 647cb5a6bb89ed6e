"""The engine core loop, mirroring vllm/v1/engine/core.py ``EngineCore.step()``:
``schedule()`` → ``execute_model()`` → ``update_from_output()`` → ``post_step()`` (drafts reach the
scheduler through their own call, after the outputs: ``take_draft_token_ids`` →
``update_draft_token_ids``).

With ``async_scheduling`` (vLLM 0.32's default for EAGLE and the draft model on GPU) the scheduler is
an ``AsyncScheduler`` (core/sched/async_scheduler.py) and ``post_step`` takes no drafts: they stay in
the worker, as vllm/v1/engine/core.py ``post_step`` skips ``take_draft_token_ids`` when async. vLLM
also overlaps scheduling with the forward (``step_with_batch_queue``); minivllm's step stays serial.

Set a breakpoint in ``Scheduler.schedule`` and call ``step()``: everything runs in this process.
A step that schedules nothing while requests wait checks whether the KV cache is too small
(``_check_room``).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional

from minivllm import trace
from minivllm.config import VllmConfig
from minivllm.core.sched.output import SchedulerOutput
from minivllm.request import Request
from minivllm.trace import Tracer
from minivllm.utils import resolve_obj_by_qualname

# As vLLM's SchedulerConfig.scheduler_cls: the article's scheduler, or vLLM 0.32's AsyncScheduler.
SCHEDULER_CLS = {False: "minivllm.core.sched.scheduler.Scheduler",
                 True: "minivllm.core.sched.async_scheduler.AsyncScheduler"}
# As vLLM's ParallelConfig.worker_cls: "auto" is the article's Worker; any other value is a class's
# qualified name (the simulator's SimulatedWorker, minivllm/sim/worker.py, runs no model).
WORKER_CLS = {"auto": "minivllm.worker.worker.Worker"}


class EngineCore:
    def __init__(self, vllm_config: VllmConfig,
                 detokenize: Optional[Callable[[list[int]], str]] = None) -> None:
        self.vllm_config = vllm_config
        worker_cls = vllm_config.parallel_config.worker_cls
        self.worker = resolve_obj_by_qualname(WORKER_CLS.get(worker_cls, worker_cls))(vllm_config)
        self.worker.init_device()
        self.worker.load_model()
        num_gpu_blocks = self.worker.determine_num_available_blocks()
        self.worker.initialize_cache(num_gpu_blocks)
        self.async_scheduling = vllm_config.scheduler_config.async_scheduling
        scheduler_cls = resolve_obj_by_qualname(SCHEDULER_CLS[self.async_scheduling])
        self.scheduler = scheduler_cls(vllm_config, num_gpu_blocks, detokenize=detokenize)
        self.tracer = Tracer()
        self.step_index = 0

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def step(self) -> list[tuple[Request, list[int]]]:
        """One engine step. Returns (request, new token ids) for requests that progressed."""
        # vLLM's has_requests(): also step for finished requests whose ids the worker has not
        # seen yet or whose blocks a transfer still holds, so they are freed without new work.
        if not self.scheduler.has_requests():
            return []
        # Recording is a flag read here: a run that records nothing never enters trace.py.
        with self.tracer.step(self.step_index) if self.tracer.enabled else nullcontext():
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens == 0 and self.scheduler.waiting:
                self._check_room(scheduler_output)
            model_output = self.worker.execute_model(scheduler_output)
            if model_output is None:   # vLLM 0.32: the forward ran; sampling finishes the step
                model_output = self.worker.sample_tokens()
            outputs = self.scheduler.update_from_output(scheduler_output, model_output)
            self.post_step()
            if trace.active and trace.is_recording() and self.scheduler.num_spec_tokens:
                # What the next schedule() reads: drafts (default) or -1 placeholders (async).
                trace.record("spec_token_ids", spec_token_ids={
                    r.request_id: list(r.spec_token_ids) for r in self.scheduler.running})
        self.step_index += 1
        return outputs

    def _check_room(self, scheduler_output: SchedulerOutput) -> None:
        """A step scheduled nothing while requests wait: ``RuntimeError`` when nothing would ever
        free blocks for them (no running request, no preemption, no load in flight, no finished
        request holding blocks), instead of stepping forever: the KV cache is too small for any
        of them (``num_gpu_blocks_override`` may set it below what one request needs)."""
        scheduler = self.scheduler
        if (not scheduler.running and not scheduler_output.preempted_req_ids
                and not scheduler.waiting_for_remote_kvs and not scheduler.delayed_free):
            cache = self.vllm_config.cache_config
            raise RuntimeError(
                "The KV cache cannot hold even one waiting request "
                f"({cache.num_gpu_blocks} blocks of {cache.block_size} tokens): raise "
                "num_gpu_blocks_override or lower max_model_len.")

    def post_step(self) -> None:
        if self.async_scheduling:
            return   # the worker substitutes its drafts for the placeholders itself
        draft_token_ids = self.worker.take_draft_token_ids()
        if draft_token_ids is not None:
            self.scheduler.update_draft_token_ids(draft_token_ids)
