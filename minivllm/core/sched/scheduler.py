"""The scheduler, mirroring vllm/v1/core/sched/scheduler.py (Dec-2025 semantics).

There are no prefill and decode phases: each step tries to close the gap between a request's
``num_computed_tokens`` and ``num_tokens_with_spec`` under a token budget. ``schedule()`` runs
vLLM's sections in order, each a function here, sharing what it builds in ``ScheduledRequests``
(utils.py):
- ``schedule_running``: the running requests (spec decode step 4: drafts in
  ``request.spec_token_ids`` count as new tokens, so ``allocate_slots`` reserves their KV slots;
  preempting from the back of ``running`` when it fails);
- ``schedule_waiting``: the waiting ones, only if nothing was preempted, through the P/D steps
  "cache lookup" (``_get_computed_tokens``: ``get_num_new_matched_tokens``) and "state update"
  (``_allocate_and_update_state``: ``update_state_after_alloc``);
- ``_make_scheduler_output``: the ``SchedulerOutput``, with P/D "build metadata object"
  (``build_connector_meta``).
The KV-transfer bookkeeping that only a connector exercises closes the class; a step with no
connector runs none of it. An asynchronous load takes its own path: its request waits in
``WAITING_FOR_REMOTE_KVS`` in ``kv_holding_waiting`` (vLLM 0.32's queue, scanned first:
``schedule_kv_holding``) until the worker reports it in ``finished_recving``.
Beside it, read only when needed (the article's examples never need them), each taking the
scheduler as an argument and never importing this file: kv_holding.py (the asynchronous-load
path), delayed_free.py (blocks a transfer still uses), failed_loads.py (a load that failed),
stop_strings.py (a request with stop strings), schedule_record.py (a recorded step);
spec_decode/metrics.py, once drafts are verified (``spec_decoding_stats``).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Optional

from minivllm import trace
from minivllm.config import VllmConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import KVCacheBlocks, get_request_block_hasher
from minivllm.core.sched.output import NewRequestData, SchedulerOutput
from minivllm.core.sched.utils import (ComputedTokens, ScheduledRequests, check_stop,
                                       make_cached_request_data, schedule_spec_tokens)
from minivllm.request import Request, RequestStatus
from minivllm.utils import cdiv

if TYPE_CHECKING:
    from minivllm.spec_decode.metrics import SpecDecodingStats


class Scheduler:
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
        # Waiting requests that hold KV blocks: their asynchronous load was started (kv_holding.py).
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
        """Finish requests from outside the step (vLLM's ``finish_requests``): an abort
        (``FINISHED_ABORTED``) or a KV load that failed under ``kv_load_failure_policy="fail"``
        (``FINISHED_ERROR``). Each unfinished request leaves whichever queue holds it and is freed
        (``_free_request``: its blocks may stay while a transfer still uses them). A request that
        finishes on its own (EOS, a stop, its length) is freed in ``update_from_output``."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            for queue in (self.running, self.waiting, self.kv_holding_waiting):
                if request in queue:
                    queue.remove(request)
            request.status = finished_status
            self._free_request(request)

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
        if trace.active and trace.is_recording():   # the "schedule" and "kv_cache" step records
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

    def schedule_waiting(self, scheduled: ScheduledRequests) -> None:
        """Next, the WAITING requests (vLLM's second loop), while the budget and ``max_num_seqs``
        allow: P/D "cache lookup" (``_get_computed_tokens``), the new tokens, ``allocate_slots``
        and P/D "state update" (``_allocate_and_update_state``), then the request runs.

        A request that cannot start now moves behind the others (``skipped_waiting_requests``):
        the connector asks to be asked again later. One whose KV loads asynchronously moves to
        ``kv_holding_waiting`` (``_start_async_load``). The first one that finds
        no room ends the loop and stays at the head of ``waiting``."""
        skipped_waiting_requests: deque[Request] = deque()
        while (self.waiting and scheduled.token_budget > 0
               and len(self.running) < self.max_num_running_reqs):
            request = self.waiting[0]
            computed_tokens = self._get_computed_tokens(request)
            if computed_tokens is None:
                skipped_waiting_requests.append(self.waiting.popleft())
                continue
            (new_computed_blocks, num_new_local_computed_tokens, num_external_computed_tokens,
             num_computed_tokens, load_kv_async) = computed_tokens
            if load_kv_async:   # load first, compute later (kv_holding.py)
                if not self._start_async_load(request, computed_tokens):
                    break
                self.kv_holding_waiting.append(self.waiting.popleft())
                continue
            num_new_tokens = request.num_tokens - num_computed_tokens
            if 0 < self.long_prefill_token_threshold < num_new_tokens:
                num_new_tokens = self.long_prefill_token_threshold
            if not self.enable_chunked_prefill and num_new_tokens > scheduled.token_budget:
                break
            num_new_tokens = min(num_new_tokens, scheduled.token_budget)
            new_blocks = self._allocate_and_update_state(
                request, num_new_tokens=num_new_tokens,
                num_new_local_computed_tokens=num_new_local_computed_tokens,
                new_computed_blocks=new_computed_blocks,
                num_external_computed_tokens=num_external_computed_tokens,
                num_lookahead_tokens=self.num_lookahead_tokens)
            if new_blocks is None:
                break   # stays at the head of `waiting`
            self.waiting.popleft()
            self._add_to_running(request, scheduled, num_new_tokens, computed_tokens)
        self.waiting.extendleft(reversed(skipped_waiting_requests))

    def _get_computed_tokens(self, request: Request) -> Optional[ComputedTokens]:
        """P/D "cache lookup": the local prefix cache first, then the connector's
        ``get_num_new_matched_tokens`` for what lies beyond it (prefill: 0; decode: maybe a hit;
        none if the request reads no cache). None when the connector asks to be asked again later."""
        new_computed_blocks, num_new_local_computed_tokens = (
            self.kv_cache_manager.get_computed_blocks(request))
        num_external_computed_tokens, load_kv_async = 0, False
        if self.connector is not None and not request.skip_reading_prefix_cache:
            num_external_computed_tokens, load_kv_async = (
                self.connector.get_num_new_matched_tokens(request, num_new_local_computed_tokens))
            if num_external_computed_tokens is None:
                return None
            request.num_external_computed_tokens = num_external_computed_tokens
        num_computed_tokens = num_new_local_computed_tokens + num_external_computed_tokens
        return ComputedTokens(new_computed_blocks=new_computed_blocks,
                              num_new_local_computed_tokens=num_new_local_computed_tokens,
                              num_external_computed_tokens=num_external_computed_tokens,
                              num_computed_tokens=num_computed_tokens, load_kv_async=load_kv_async)

    def _allocate_and_update_state(self, request: Request, num_new_tokens: int,
                                   num_new_local_computed_tokens: int,
                                   new_computed_blocks: Optional[KVCacheBlocks],
                                   num_external_computed_tokens: int, num_lookahead_tokens: int,
                                   delay_cache_blocks: bool = False) -> Optional[KVCacheBlocks]:
        """``allocate_slots`` for a waiting request's new and external tokens (its local hits are
        claimed, not allocated), then P/D "state update": the connector's
        ``update_state_after_alloc`` records an external hit to load (no-op for prefill). It gets
        all of the request's blocks, lookahead included, as vLLM passes
        ``kv_cache_manager.get_blocks()``. Returns the new blocks, or None when they do not fit."""
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, num_new_tokens=num_new_tokens + num_external_computed_tokens,
            num_new_computed_tokens=num_new_local_computed_tokens,
            new_computed_blocks=new_computed_blocks, num_lookahead_tokens=num_lookahead_tokens,
            delay_cache_blocks=delay_cache_blocks)
        if new_blocks is not None and new_computed_blocks is not None:   # admitted after a lookup
            self.kv_cache_manager.record_prefix_cache_stats(request, num_new_local_computed_tokens)
        if new_blocks is not None and self.connector is not None:
            self.connector.update_state_after_alloc(
                request, self.kv_cache_manager.get_blocks(request.request_id),
                num_external_computed_tokens)
        return new_blocks

    def _add_to_running(self, request: Request, scheduled: ScheduledRequests, num_new_tokens: int,
                        computed_tokens: ComputedTokens) -> None:
        """A waiting request runs from this step on: the worker gets it in full, with all of its
        blocks (``scheduled_new_reqs``, or ``scheduled_resumed_reqs`` after a preemption), and its
        local and external hits count as computed (the ``"prefix_hit"`` record)."""
        num_computed_tokens = computed_tokens.num_computed_tokens
        num_external_computed_tokens = computed_tokens.num_external_computed_tokens
        self.running.append(request)
        if num_external_computed_tokens > 0:   # loaded in this step's forward
            scheduled.has_sync_kv_loads = True
        if request.status == RequestStatus.PREEMPTED:
            scheduled.scheduled_resumed_reqs.append(request)
        else:
            scheduled.scheduled_new_reqs.append(request)
        scheduled.req_to_new_blocks[request.request_id] = self.kv_cache_manager.get_blocks(
            request.request_id)
        scheduled.num_scheduled_tokens[request.request_id] = num_new_tokens
        scheduled.token_budget -= num_new_tokens
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed_tokens
        if trace.active:
            trace.record("prefix_hit", req_id=request.request_id,
                         num_local_computed_tokens=computed_tokens.num_new_local_computed_tokens,
                         num_external_computed_tokens=num_external_computed_tokens)

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
        """vLLM's ``_preempt_request``: recompute, not swap. Free all of the request's blocks and
        put it back at the head of ``waiting``: it starts over from token 0 (its prefix-cached
        blocks may still be found again), its drafts dropped. Step record: ``"preempt"``."""
        if trace.active:
            trace.record("preempt", req_id=request.request_id,
                         num_computed_tokens_before=request.num_computed_tokens)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

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

    # ------------------------------------------------------------------ KV transfer (a connector only)
    # vLLM's names; what only other connectors or faults exercise is in kv_holding.py,
    # delayed_free.py and failed_loads.py, read only when needed.
    def _start_async_load(self, request: Request, computed_tokens: ComputedTokens) -> bool:
        """Load first, compute later (the connector's ``load_kv_async``): the request waits in
        ``WAITING_FOR_REMOTE_KVS`` while the worker fetches its KV (kv_holding.py). Returns
        False (nothing changed) when its blocks do not fit."""
        from minivllm.core.sched.kv_holding import start_async_load
        return start_async_load(self, request, computed_tokens)

    def schedule_kv_holding(self, scheduled: ScheduledRequests) -> bool:
        """vLLM 0.32's ``kv_holding_waiting`` queue, scanned before ``waiting``: the requests whose
        asynchronous load was started, scheduled once their load landed (kv_holding.py, read only
        when the queue is not empty). Returns False when one found no room: then no waiting
        request is scheduled this step either, as in vLLM."""
        if not self.kv_holding_waiting:
            return True
        from minivllm.core.sched.kv_holding import schedule_kv_holding
        return schedule_kv_holding(self, scheduled)

    # ------------------------------------------------------------------ failed loads, transfers
    def _handle_invalid_blocks(self, invalid_block_ids: set[int]) -> set[str]:
        """External KV that failed to load after it was counted as computed (vLLM's
        ``_handle_invalid_blocks``): each affected request is cut back to its first invalid block.
        In failed_loads.py, read only once a load has failed. Returns the affected ids."""
        from minivllm.core.sched.failed_loads import handle_invalid_blocks
        return handle_invalid_blocks(self, invalid_block_ids)

    def _kv_load_failure_policy(self) -> str:
        ktc = self.vllm_config.kv_transfer_config
        return ktc.kv_load_failure_policy if ktc is not None else "recompute"

    def _finish_failed_loads(self, req_ids: set[str]) -> list[tuple[Request, list[int]]]:
        """``kv_load_failure_policy="fail"``: the requests whose KV did not load finish with
        ``FINISHED_ERROR`` (failed_loads.py)."""
        from minivllm.core.sched.failed_loads import finish_failed_loads
        return finish_failed_loads(self, req_ids)

    def _computed_block_ids(self, request: Request) -> list[int]:
        """The blocks that hold the request's computed tokens (vLLM passes
        ``get_block_ids_for_computed_tokens`` to ``request_finished``): lookahead blocks that were
        never written are not offered to a reader."""
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[0]
        return block_ids[:cdiv(max(request.num_computed_tokens, 0), self.block_size)]

    def _delay_or_free(self, request: Request, sending: bool, recving: bool) -> None:
        """A finished request's blocks are freed at once, unless a transfer still uses them:
        the connector's worker reads them out (``sending``) or a load still writes into them
        (``recving``); then they wait for the worker's report (delayed_free.py)."""
        if sending or recving:
            from minivllm.core.sched.delayed_free import delay_free
            delay_free(self, request, sending, recving)
        else:
            self.kv_cache_manager.free(request)
            del self.requests[request.request_id]

    def _update_from_kv_xfer_finished(self, kv_out: Any) -> None:
        """vLLM's ``_update_from_kv_xfer_finished``: the connector sees the worker's output; a
        finished load or send (asynchronous connectors only) is taken up in delayed_free.py."""
        self.connector.update_connector_output(kv_out)
        if kv_out.finished_recving or kv_out.finished_sending:
            from minivllm.core.sched.delayed_free import update_from_kv_xfer_finished
            update_from_kv_xfer_finished(self, kv_out)
