"""The scheduler, mirroring vllm/v1/core/sched/scheduler.py (Dec-2025 semantics).

There are no prefill and decode phases: each step tries to close the gap between a request's
``num_computed_tokens`` and ``num_tokens_with_spec`` under a token budget. ``schedule()`` runs
vLLM's sections in order, each a function here, sharing what it builds in ``ScheduledRequests``
(utils.py):
- ``schedule_running``: the running requests (spec decode step 4: drafts in
  ``request.spec_token_ids`` count as new tokens, so ``allocate_slots`` reserves their KV slots;
  preempting from the back of ``running`` when it fails);
- ``schedule_waiting`` (waiting.py): the waiting ones, only if nothing was preempted, through the
  P/D steps "cache lookup" (``_get_computed_tokens``: ``get_num_new_matched_tokens``) and "state
  update" (``_allocate_and_update_state``: ``update_state_after_alloc``);
- ``_make_scheduler_output``: the ``SchedulerOutput``, with P/D "build metadata object"
  (``build_connector_meta``).
An asynchronous load takes its own path, in kv_transfer.py with the other KV-transfer bookkeeping:
its request waits in ``WAITING_FOR_REMOTE_KVS`` in ``kv_holding_waiting`` (vLLM 0.32's queue,
scanned first: ``schedule_kv_holding``) until the worker reports it in ``finished_recving``.
Beside it, read only when needed (the article's examples never need them): preemption.py, once
the pool runs out of blocks; finish.py, for a request finished from outside the step (an abort);
stop_strings.py, for a request with stop strings; schedule_record.py, when a step is recorded;
spec_decode/metrics.py, once drafts are verified (``spec_decoding_stats``).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Optional

from minivllm import trace
from minivllm.config import VllmConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import KVCacheBlocks, get_request_block_hasher
from minivllm.core.sched.kv_transfer import KVTransferMixin
from minivllm.core.sched.output import NewRequestData, SchedulerOutput
from minivllm.core.sched.utils import (ScheduledRequests, check_stop, make_cached_request_data,
                                       schedule_spec_tokens)
from minivllm.core.sched.waiting import WaitingMixin
from minivllm.request import Request, RequestStatus

if TYPE_CHECKING:
    from minivllm.spec_decode.metrics import SpecDecodingStats


class Scheduler(WaitingMixin, KVTransferMixin):
    def __init__(self, vllm_config: VllmConfig, num_gpu_blocks: int,
                 detokenize: Optional[Callable[[list[int]], str]] = None) -> None:
        self.vllm_config = vllm_config
        sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
        self.max_num_running_reqs = sched.max_num_seqs
        self.max_num_scheduled_tokens = sched.max_num_batched_tokens
        self.enable_chunked_prefill = sched.enable_chunked_prefill
        self.max_model_len = vllm_config.model_config.max_model_len
        self.block_size = cache.block_size
        self.detokenize = detokenize

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        # Waiting requests that hold KV blocks: their asynchronous load was started (kv_transfer.py).
        self.kv_holding_waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Sent to the worker in the *next* SchedulerOutput, then replaced by a new set.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0

        spec = vllm_config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec else 0
        # Drafters that write KV for their own drafts (EAGLE, EAGLE-3, the draft model) need k
        # lookahead slots, as vLLM 0.32's num_lookahead_tokens (config/vllm.py) gives them; n-gram
        # and Medusa write no KV and reserve none.
        self.num_lookahead_tokens = self.num_spec_tokens if spec and spec.needs_lookahead_slots else 0
        self._spec_decoding_stats: Optional[SpecDecodingStats] = None   # made on first use

        self.kv_cache_manager = KVCacheManager(
            num_gpu_blocks=num_gpu_blocks, block_size=self.block_size,
            max_model_len=self.max_model_len, enable_caching=cache.enable_prefix_caching,
            use_eagle=bool(spec and spec.use_eagle()))
        self.block_hasher = get_request_block_hasher(self.block_size)

        # P/D article step "Instantiation": the connector's scheduler-side instance.
        self.connector = None
        # Async KV loads: req_id -> tokens computed once the load lands (cut by load errors), and
        # the ids the worker reported loaded, not yet seen by the waiting loop.
        self.waiting_for_remote_kvs: dict[str, int] = {}
        self.finished_recving_kv_req_ids: set[str] = set()
        # Finished requests whose blocks are still held: req_id -> what they wait for
        # ({"sending"}: the connector's worker reads them out; {"recving"}: a load writes into them).
        self.delayed_free: dict[str, set[str]] = {}
        if vllm_config.kv_transfer_config is not None and vllm_config.kv_transfer_config.kv_connector:
            from minivllm.distributed.kv_transfer import KVConnectorFactory, KVConnectorRole
            self.connector = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER)

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: list[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside the step (an abort, a failed load): finish.py."""
        from minivllm.core.sched.finish import finish_requests
        finish_requests(self, request_ids, finished_status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.kv_holding_waiting)

    @property
    def long_prefill_token_threshold(self) -> int:
        """The cap on a step's prefill chunk, so that a long prompt cannot starve the others; lifted
        when there are no others (vLLM 0.32). Constant during ``schedule()``, which drops no request."""
        num_reqs = len(self.running) + len(self.waiting) + len(self.kv_holding_waiting)
        return self.vllm_config.scheduler_config.long_prefill_token_threshold if num_reqs > 1 else 0

    def has_finished_requests(self) -> bool:
        """vLLM's ``has_finished_requests``: finished ids the worker has not been told yet, or
        finished requests whose blocks wait for the connector (``finished_sending`` or the end of
        an asynchronous load). The engine keeps stepping for them (``has_requests``)."""
        if self.finished_req_ids:
            return True
        queued = len(self.running) + len(self.waiting) + len(self.kv_holding_waiting)
        return len(self.requests) > queued

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    @property
    def spec_decoding_stats(self) -> Optional[SpecDecodingStats]:
        """The speculative-decoding counters (spec_decode/metrics.py), None without a
        ``speculative_config``; made when the first drafts are verified or someone reads them."""
        if self._spec_decoding_stats is None and self.vllm_config.speculative_config:
            from minivllm.spec_decode.metrics import SpecDecodingStats
            self._spec_decoding_stats = SpecDecodingStats(self.num_spec_tokens)
        return self._spec_decoding_stats

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """One step's schedule, in vLLM's order: the running requests, then the waiting ones (if
        nothing was preempted; those holding KV blocks first), then the output the workers get."""
        scheduled = self.schedule_running(self.max_num_scheduled_tokens)
        if not scheduled.preempted_reqs and self.schedule_kv_holding(scheduled):
            self.schedule_waiting(scheduled)
        scheduler_output = self._make_scheduler_output(scheduled)
        self._update_after_schedule(scheduler_output)
        if trace.is_recording():   # the "schedule" and "kv_cache" step records
            from minivllm.core.sched.schedule_record import record_schedule
            record_schedule(self, scheduler_output, scheduled.token_budget)
        return scheduler_output

    def schedule_running(self, token_budget: int) -> ScheduledRequests:
        """First, the RUNNING requests (vLLM's first loop; spec decode step 4).

        Drafts are part of ``num_tokens_with_spec``, so they count as new tokens and
        ``allocate_slots`` reserves their KV slots, plus ``num_lookahead_tokens`` for a drafter that
        writes KV of its own. When the pool is out of blocks, the last running request is preempted
        until the allocation fits (or the request itself was the last one)."""
        scheduled_running_reqs: list[Request] = []
        preempted_reqs: list[Request] = []
        req_to_new_blocks: dict[str, KVCacheBlocks] = {}
        num_scheduled_tokens: dict[str, int] = {}
        scheduled_spec_decode_tokens: dict[str, list[int]] = {}
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = request.num_tokens_with_spec - request.num_computed_tokens
            if 0 < self.long_prefill_token_threshold < num_new_tokens:
                num_new_tokens = self.long_prefill_token_threshold
            num_new_tokens = min(num_new_tokens, token_budget,
                                 self.max_model_len - 1 - request.num_computed_tokens)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens)
                if new_blocks is not None:
                    break
                # Out of KV blocks: preempt the lowest-priority (last) running request.
                preempted_req = self.running.pop()
                self._preempt_request(preempted_req)
                preempted_reqs.append(preempted_req)
                if preempted_req is request:
                    break
            if new_blocks is None:
                break
            scheduled_running_reqs.append(request)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1
            if request.spec_token_ids:
                schedule_spec_tokens(request, num_new_tokens, scheduled_spec_decode_tokens)
        return ScheduledRequests(token_budget, scheduled_running_reqs, preempted_reqs,
                                 req_to_new_blocks, num_scheduled_tokens,
                                 scheduled_spec_decode_tokens)

    def _make_scheduler_output(self, scheduled: ScheduledRequests) -> SchedulerOutput:
        """The step's ``SchedulerOutput``: new requests in full, the others as deltas; then P/D
        "build metadata object": the connector's ``build_connector_meta`` (prefill marks stores,
        decode marks loads) rides along to its worker half."""
        num_common_prefix_blocks = [0]
        if self.running:
            num_common_prefix_blocks = self.kv_cache_manager.get_num_common_prefix_blocks(
                self.running[0].request_id, len(self.running))
        req_to_new_blocks = scheduled.req_to_new_blocks
        new_reqs_data = [
            NewRequestData.from_request(r, req_to_new_blocks[r.request_id].get_block_ids())
            for r in scheduled.scheduled_new_reqs]
        cached_reqs_data = make_cached_request_data(
            scheduled.scheduled_running_reqs, scheduled.scheduled_resumed_reqs, req_to_new_blocks)
        num_scheduled_tokens = scheduled.num_scheduled_tokens
        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            scheduled_spec_decode_tokens=scheduled.scheduled_spec_decode_tokens,
            num_common_prefix_blocks=list(num_common_prefix_blocks),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in scheduled.preempted_reqs},
            has_sync_kv_loads=scheduled.has_sync_kv_loads,
        )
        if self.connector is not None:
            scheduler_output.kv_connector_metadata = self.connector.build_connector_meta(
                scheduler_output)
        return scheduler_output

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        # num_computed_tokens is optimistic: advanced *before* the model runs; rejected drafts are
        # subtracted again in update_from_output.
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            request.is_prefill_chunk = request.num_computed_tokens < request.num_tokens
        self.finished_req_ids = set()

    def _preempt_request(self, request: Request) -> None:
        """Free its blocks and send it back to the head of ``waiting``, to recompute from token
        0 (preemption.py: the examples never run out of blocks)."""
        from minivllm.core.sched.preemption import preempt_request
        preempt_request(self, request)

    # ------------------------------------------------------------------ outputs
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: Any) -> list[tuple[Request, list[int]]]:
        """Append sampled tokens, undo rejected drafts, stop finished requests.

        Returns (request, new_token_ids) for every request that got tokens or finished this step."""
        outputs: list[tuple[Request, list[int]]] = []
        stopped: set[str] = set()
        sampled = model_runner_output.sampled_token_ids
        kv_out = model_runner_output.kv_connector_output
        failed = self._handle_invalid_blocks(kv_out.invalid_block_ids) if (
            kv_out is not None and kv_out.invalid_block_ids) else set()
        if failed and self._kv_load_failure_policy() == "fail":
            outputs += self._finish_failed_loads(failed)
        if kv_out is not None:
            self._update_from_kv_xfer_finished(kv_out)
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or req_id in failed:
                continue
            row = model_runner_output.req_id_to_index[req_id]
            generated = sampled[row]
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and generated:   # no output (e.g. a failed load): nothing was verified
                num_accepted = len(generated) - 1
                num_rejected = len(drafts) - num_accepted
                if request.num_computed_tokens > 0:
                    # Article step 7: rejected tokens leave num_computed_tokens; their KV slots are
                    # simply overwritten later, no blocks are freed.
                    request.num_computed_tokens -= num_rejected
                if self.spec_decoding_stats is not None:
                    self.spec_decoding_stats.observe_draft(len(drafts), num_accepted)
            new_token_ids, is_stopped = self._update_request_with_output(request, generated)
            # vLLM's EngineCoreOutput.new_logprobs / new_prompt_logprobs_tensors, for the outputs.
            logprobs = getattr(model_runner_output, "logprobs", None)
            request.new_logprobs = (logprobs[row] or [])[:len(new_token_ids)] if logprobs else None
            request.new_prompt_logprobs = getattr(
                model_runner_output, "prompt_logprobs_dict", {}).get(req_id)
            if is_stopped:
                self._free_request(request)
                stopped.add(req_id)
            if new_token_ids or is_stopped:
                outputs.append((request, new_token_ids))
        if stopped:
            self.running = [r for r in self.running if r.request_id not in stopped]
        return outputs

    def _update_request_with_output(self, request: Request,
                                    new_token_ids: list[int]) -> tuple[list[int], bool]:
        for i, token_id in enumerate(new_token_ids):
            request.append_output_token_ids(token_id)
            if check_stop(request, self.max_model_len, self.detokenize):
                # Tokens after a stop (e.g. accepted drafts past an EOS) are dropped.
                return new_token_ids[:i + 1], True
        return new_token_ids, False

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Article step 3: store the proposer's drafts in request.spec_token_ids."""
        for req_id, drafts in draft_token_ids.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.is_prefill_chunk:   # a partial prefill sampled nothing to draft from
                request.spec_token_ids = []
                continue
            request.spec_token_ids = list(drafts)

    def _free_request(self, request: Request) -> None:
        """vLLM's ``_free_request``: the connector sees the blocks of the computed tokens and may
        keep them (``delay_free``) until its worker reports ``finished_sending``; a request whose
        asynchronous load is still writing into its blocks keeps them until ``finished_recving``,
        whatever the connector says (vLLM's ``finish_requests``)."""
        assert request.is_finished()
        req_id = request.request_id
        delay_free = False
        loading = (req_id in self.waiting_for_remote_kvs
                   and req_id not in self.finished_recving_kv_req_ids)
        self.waiting_for_remote_kvs.pop(req_id, None)
        self.finished_recving_kv_req_ids.discard(req_id)
        if self.connector is not None:
            delay_free, request.output_kv_transfer_params = self.connector.request_finished(
                request, self._computed_block_ids(request))
        self.finished_req_ids.add(req_id)
        self._delay_or_free(request, sending=bool(delay_free), recving=loading)

    def make_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: Any,
                     eos_token_id: Optional[int], prompt: Optional[str] = None) -> Request:
        return Request(request_id, prompt_token_ids, sampling_params, eos_token_id,
                       block_hasher=self.block_hasher, prompt=prompt)
