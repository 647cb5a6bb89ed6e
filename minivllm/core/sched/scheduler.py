"""The scheduler, mirroring vllm/v1/core/sched/scheduler.py (Dec-2025 semantics): one class, as in
vLLM.

There are no prefill and decode phases: each step tries to close the gap between a request's
``num_computed_tokens`` and ``num_tokens_with_spec`` under a token budget. ``schedule()`` runs
vLLM's sections in order, each a method here, sharing what it builds in ``ScheduledRequests``:
- ``schedule_running``: the running requests (spec decode step 4: drafts in
  ``request.spec_token_ids`` count as new tokens, so ``allocate_slots`` reserves their KV slots;
  preempting from the back of ``running`` when it fails);
- ``schedule_waiting``: the waiting ones, only if nothing was preempted, through the P/D steps
  "cache lookup" (``_get_computed_tokens``: ``get_num_new_matched_tokens``) and "state update"
  (``_allocate_and_update_state``: ``update_state_after_alloc``);
- ``_make_scheduler_output``: the ``SchedulerOutput``, with P/D "build metadata object"
  (``build_connector_meta``).
The KV-transfer bookkeeping that only a connector exercises closes the class; a step with no
connector runs none of it:
- an asynchronous load (the RedisStore and ZmqPull connectors; never the article's
  SharedStorage connector): its request waits in ``WAITING_FOR_REMOTE_KVS`` in
  ``kv_holding_waiting`` (vLLM 0.32's queue, scanned first: ``schedule_kv_holding``) until the
  worker reports it in ``finished_recving`` (``_update_waiting_for_remote_kv``);
- delayed free (vLLM's ``_free_request`` and ``_update_from_kv_xfer_finished``): a finished
  request keeps its blocks while a transfer still uses them;
- a failed load (vLLM's ``_handle_invalid_blocks``, ``kv_load_failure_policy``).
Step records (trace.py): ``"schedule"`` and ``"kv_cache"`` once per step while a step is recorded,
``"preempt"``, ``"prefix_hit"``, ``"remote_kv_wait"``, ``"remote_kv_ready"``, ``"delay_free"``,
``"delayed_free_done"``, ``"kv_load_failed"``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

from minivllm import trace
from minivllm.config import VllmConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import KVCacheBlocks, get_request_block_hasher
from minivllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.core.sched.utils import check_stop
from minivllm.request import Request, RequestStatus
from minivllm.utils import cdiv

if TYPE_CHECKING:
    from minivllm.spec_decode.metrics import SpecDecodingStats


class ComputedTokens(NamedTuple):
    """A waiting request's cache lookup (``Scheduler._get_computed_tokens``), in vLLM's names."""
    new_computed_blocks: Optional[KVCacheBlocks]   # local prefix-cache hits (None: none looked up)
    num_new_local_computed_tokens: int
    num_external_computed_tokens: int              # the connector's hit
    num_computed_tokens: int                       # what the request starts from
    load_kv_async: bool                            # the connector loads it in the background


@dataclass
class ScheduledRequests:
    """The lists and dicts one ``schedule()`` call fills, under the names vLLM's ``schedule()``
    gives them as locals: the running loop makes it, the waiting loop adds to it,
    ``_make_scheduler_output`` turns it into the ``SchedulerOutput``."""
    token_budget: int
    scheduled_running_reqs: list[Request] = field(default_factory=list)
    preempted_reqs: list[Request] = field(default_factory=list)
    # req_id -> the blocks the worker learns of this step (running: the new ones; new and
    # resumed requests: all of them)
    req_to_new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    scheduled_new_reqs: list[Request] = field(default_factory=list)
    scheduled_resumed_reqs: list[Request] = field(default_factory=list)
    # A request admitted this step loads external KV in this step's forward.
    has_sync_kv_loads: bool = False


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
        # Waiting requests that hold KV blocks: their asynchronous load was started
        # (``_start_async_load``).
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
            self._record_schedule(scheduler_output, scheduled.token_budget)
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
                self._schedule_spec_tokens(request, num_new_tokens, scheduled_spec_decode_tokens)
        return ScheduledRequests(token_budget, scheduled_running_reqs, preempted_reqs,
                                 req_to_new_blocks, num_scheduled_tokens,
                                 scheduled_spec_decode_tokens)

    def _schedule_spec_tokens(self, request: Request, num_new_tokens: int,
                              scheduled_spec_decode_tokens: dict[str, list[int]]) -> None:
        """The drafts that fit in ``num_new_tokens`` go to the workers (the budget or max_model_len
        may have cut some); ``request.spec_token_ids`` is emptied, fresh drafts arrive through
        ``update_draft_token_ids()`` after this step (the "Speculative decode related" lines of
        vLLM's ``schedule``)."""
        num_scheduled_spec_tokens = (num_new_tokens + request.num_computed_tokens
                                     - request.num_tokens)
        if num_scheduled_spec_tokens > 0:
            scheduled_spec_decode_tokens[request.request_id] = (
                request.spec_token_ids[:num_scheduled_spec_tokens])
        request.spec_token_ids = []

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
            if load_kv_async:   # load first, compute later
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
        cached_reqs_data = self._make_cached_request_data(
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

    def _make_cached_request_data(self, running_reqs: list[Request], resumed_reqs: list[Request],
                                  req_to_new_blocks: dict[str, KVCacheBlocks]) -> CachedRequestData:
        """The requests the worker already knows (running) or knew (resumed after preemption), as
        column-oriented deltas (vLLM's ``_make_cached_request_data``)."""
        data = CachedRequestData()
        for req in running_reqs + resumed_reqs:
            data.req_ids.append(req.request_id)
            if req in resumed_reqs:
                data.resumed_req_ids.add(req.request_id)
                data.resumed_req_token_ids[req.request_id] = list(req.all_token_ids)
            data.new_block_ids.append(req_to_new_blocks[req.request_id].get_block_ids())
            data.num_computed_tokens.append(req.num_computed_tokens)
            data.num_output_tokens.append(req.num_output_tokens)
        return data

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        # num_computed_tokens is optimistic: advanced *before* the model runs; rejected drafts are
        # subtracted again in update_from_output.
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            request.is_prefill_chunk = request.num_computed_tokens < request.num_tokens
        self.finished_req_ids = set()

    def _record_schedule(self, scheduler_output: SchedulerOutput, token_budget_left: int) -> None:
        """The step records ``"schedule"`` (what was scheduled, from ``scheduler_output``, with
        what was left of the token budget) and ``"kv_cache"`` (the running requests' block tables
        and the pool, ``KVCacheManager.snapshot``), written while a step is recorded
        (``engine.tracer.enabled = True``: the tours, the notebooks' figures)."""
        so = scheduler_output
        trace.record(
            "schedule", num_scheduled_tokens=dict(so.num_scheduled_tokens),
            scheduled_spec_decode_tokens={k: list(v) for k, v in
                                          so.scheduled_spec_decode_tokens.items()},
            preempted_req_ids=sorted(so.preempted_req_ids),
            new_req_ids=[r.req_id for r in so.scheduled_new_reqs],
            resumed_req_ids=sorted(so.scheduled_cached_reqs.resumed_req_ids),
            total_num_scheduled_tokens=so.total_num_scheduled_tokens,
            token_budget=self.max_num_scheduled_tokens, token_budget_left=token_budget_left,
            running=[r.request_id for r in self.running],
            waiting=[r.request_id for r in (*self.kv_holding_waiting, *self.waiting)],
            statuses={r.request_id: r.status.name for r in self.requests.values()})
        snap = self.kv_cache_manager.snapshot([r.request_id for r in self.running])
        snap["num_computed_tokens"] = {r.request_id: r.num_computed_tokens for r in self.running}
        trace.record("kv_cache", **snap)

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
        whatever the connector says (vLLM's ``finish_requests``). Otherwise ``_free_blocks``."""
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
        if delay_free or loading:
            self._delay_free(request, sending=bool(delay_free), recving=loading)
        else:
            self._free_blocks(request)

    def _free_blocks(self, request: Request) -> None:
        """vLLM's ``_free_blocks``: the request's blocks go back to the pool and it leaves
        ``requests``."""
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def make_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: Any,
                     eos_token_id: Optional[int], prompt: Optional[str] = None) -> Request:
        return Request(request_id, prompt_token_ids, sampling_params, eos_token_id,
                       block_hasher=self.block_hasher, prompt=prompt)

    # ------------------------------------------------------------------ KV transfer (a connector only)
    # An asynchronous load: the request waits in kv_holding_waiting (vLLM 0.32's queue). Step
    # records: "remote_kv_wait" when its load starts, "remote_kv_ready" once it landed.
    def _start_async_load(self, request: Request, computed_tokens: ComputedTokens) -> bool:
        """Load first, compute later: the connector's ``load_kv_async``. Blocks for the local
        hits and the external tokens only, not cached until the load lands; then the request
        waits in ``WAITING_FOR_REMOTE_KVS`` while the worker fetches in the background and other
        requests keep running. Returns False (nothing changed) when the blocks do not fit."""
        (new_computed_blocks, num_new_local_computed_tokens, num_external_computed_tokens,
         num_computed_tokens, _) = computed_tokens
        # No lookahead while the load is pending, as vLLM 0.32 (scheduler.py): nothing is
        # computed yet, so nothing drafts. The request gets its k slots once it runs.
        new_blocks = self._allocate_and_update_state(
            request, num_new_tokens=0, num_new_local_computed_tokens=num_new_local_computed_tokens,
            new_computed_blocks=new_computed_blocks,
            num_external_computed_tokens=num_external_computed_tokens, num_lookahead_tokens=0,
            delay_cache_blocks=True)
        if new_blocks is None:
            return False
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote_kvs[request.request_id] = num_computed_tokens
        trace.record("remote_kv_wait", req_id=request.request_id,
                     num_local_computed_tokens=num_new_local_computed_tokens,
                     num_external_computed_tokens=num_external_computed_tokens)
        return True

    def _update_waiting_for_remote_kv(self, request: Request) -> bool:
        """vLLM's ``_update_waiting_for_remote_kv``: once the load is reported, the request's loaded
        tokens count as computed (only those before a failed block) and its full blocks enter the
        prefix cache. Returns whether the request can be scheduled now."""
        req_id = request.request_id
        if req_id not in self.finished_recving_kv_req_ids:
            return False
        self.finished_recving_kv_req_ids.remove(req_id)
        num_computed_tokens = min(self.waiting_for_remote_kvs.pop(req_id), request.num_tokens - 1)
        if num_computed_tokens == 0:   # the first block already failed: start over, lookup included
            self.kv_cache_manager.free(request)
        elif self.kv_cache_manager.enable_caching:
            self.kv_cache_manager.cache_blocks(request, num_computed_tokens)
        request.num_computed_tokens = num_computed_tokens
        request.num_external_computed_tokens = min(request.num_external_computed_tokens,
                                                   num_computed_tokens)
        trace.record("remote_kv_ready", req_id=req_id, num_computed_tokens=num_computed_tokens)
        return True

    def schedule_kv_holding(self, scheduled: ScheduledRequests) -> bool:
        """vLLM 0.32's ``kv_holding_waiting`` queue, scanned before ``waiting``: the requests whose
        asynchronous load was started. One still loading is skipped (the scan goes on); once the
        worker reported its load, its loaded tokens are computed and their blocks allocated, so it
        needs no lookup, only slots for the rest of its prompt (vLLM: "WAITING reqs have
        num_computed_tokens > 0 after async KV recvs are completed"). A load whose first block
        failed starts over in ``waiting``, lookup included. Returns False when a request found no
        room: then no waiting request is scheduled this step either, as in vLLM."""
        if not self.kv_holding_waiting:   # no load was asynchronous
            return True
        skipped: deque[Request] = deque()
        fits = True
        while (self.kv_holding_waiting and scheduled.token_budget > 0
               and len(self.running) < self.max_num_running_reqs):
            request = self.kv_holding_waiting[0]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not self._update_waiting_for_remote_kv(request):
                    skipped.append(self.kv_holding_waiting.popleft())
                    continue
                request.status = (RequestStatus.PREEMPTED if request.num_preemptions
                                  else RequestStatus.WAITING)
            if request.num_computed_tokens == 0:
                self.waiting.appendleft(self.kv_holding_waiting.popleft())
                continue
            num_new_tokens = request.num_tokens - request.num_computed_tokens
            if 0 < self.long_prefill_token_threshold < num_new_tokens:
                num_new_tokens = self.long_prefill_token_threshold
            if not self.enable_chunked_prefill and num_new_tokens > scheduled.token_budget:
                fits = False
                break
            num_new_tokens = min(num_new_tokens, scheduled.token_budget)
            new_blocks = self._allocate_and_update_state(
                request, num_new_tokens=num_new_tokens, num_new_local_computed_tokens=0,
                new_computed_blocks=None, num_external_computed_tokens=0,
                num_lookahead_tokens=self.num_lookahead_tokens)
            if new_blocks is None:
                fits = False
                break
            self.kv_holding_waiting.popleft()
            loaded = ComputedTokens(
                new_computed_blocks=None, num_new_local_computed_tokens=0,
                num_external_computed_tokens=0, num_computed_tokens=request.num_computed_tokens,
                load_kv_async=False)   # computed by the load: no lookup, nothing external now
            self._add_to_running(request, scheduled, num_new_tokens, loaded)
        self.kv_holding_waiting.extendleft(reversed(skipped))
        return fits

    # ------------------------------------------------------------------ failed loads
    # Step record: "kv_load_failed" (req_id, policy) when kv_load_failure_policy="fail" ends a
    # request.
    def _handle_invalid_blocks(self, invalid_block_ids: set[int]) -> set[str]:
        """External KV that failed to load after it was counted as computed (vLLM's
        ``_handle_invalid_blocks``, for ``KVConnectorOutput.invalid_block_ids``): cut each affected
        request back to its first invalid block so the next step recomputes from there; its output
        this step was computed on bad KV. Returns the affected ids (running ones and asynchronous
        loads)."""
        affected = set()
        for req_id, target in list(self.waiting_for_remote_kvs.items()):   # async loads
            block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
            bad = [i for i, b in enumerate(block_ids[:cdiv(target, self.block_size)])
                   if b in invalid_block_ids]
            if bad:
                self.waiting_for_remote_kvs[req_id] = min(target, bad[0] * self.block_size)
                affected.add(req_id)
        for request in self.running:
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[0]
            num_blocks = cdiv(request.num_computed_tokens, self.block_size)
            bad = [i for i, b in enumerate(block_ids[:num_blocks]) if b in invalid_block_ids]
            if not bad:
                continue
            valid = bad[0] * self.block_size
            lost = request.num_computed_tokens - valid
            request.num_computed_tokens = valid
            request.num_cached_tokens = min(request.num_cached_tokens, valid)
            request.num_external_computed_tokens = max(
                0, request.num_external_computed_tokens - lost)
            affected.add(request.request_id)
        return affected

    def _kv_load_failure_policy(self) -> str:
        ktc = self.vllm_config.kv_transfer_config
        return ktc.kv_load_failure_policy if ktc is not None else "recompute"

    def _finish_failed_loads(self, req_ids: set[str]) -> list[tuple[Request, list[int]]]:
        """``kv_load_failure_policy="fail"`` (vLLM 0.32's default): a request whose external KV
        did not load finishes with ``FINISHED_ERROR`` and no new tokens; an asynchronous load keeps
        its blocks until the worker reports it (``_free_request``)."""
        outputs = []
        for req_id in sorted(req_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            trace.record("kv_load_failed", req_id=req_id, policy="fail")
            self.finish_requests([req_id], RequestStatus.FINISHED_ERROR)
            outputs.append((request, []))
        return outputs

    # ------------------------------------------------------------------ held blocks
    # Delayed free: a finished request leaves running / waiting at once, but its blocks and its
    # `requests` entry stay while (a) the connector's request_finished returned delay_free=True,
    # until the worker reports it in finished_sending (P in the pull model: D reads P's blocks
    # after P finished), or (b) an asynchronous load still writes into them, until
    # finished_recving (an abort while WAITING_FOR_REMOTE_KVS). Step records: "delay_free" when a
    # finished request keeps its blocks, "delayed_free_done" when they are freed at last.
    def _computed_block_ids(self, request: Request) -> list[int]:
        """The blocks that hold the request's computed tokens (vLLM passes
        ``get_block_ids_for_computed_tokens`` to ``request_finished``): lookahead blocks that were
        never written are not offered to a reader."""
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[0]
        return block_ids[:cdiv(max(request.num_computed_tokens, 0), self.block_size)]

    def _delay_free(self, request: Request, sending: bool, recving: bool) -> None:
        """Keep a finished request's blocks while a transfer uses them: the connector's worker reads
        them out (``sending``), a load still writes into them (``recving``)."""
        reasons = ({"sending"} if sending else set()) | ({"recving"} if recving else set())
        self.delayed_free[request.request_id] = reasons
        trace.record("delay_free", req_id=request.request_id, reasons=sorted(reasons),
                     block_ids=self.kv_cache_manager.get_block_ids(request.request_id)[0])

    def _release_delayed_free(self, req_id: str, reason: str) -> bool:
        """One transfer holding a finished request's blocks completed; free them once none does
        (``_free_blocks``). Returns whether ``req_id`` was a delayed finished request."""
        reasons = self.delayed_free.get(req_id)
        if reasons is None:
            return False
        reasons.discard(reason)
        if not reasons:
            del self.delayed_free[req_id]
            trace.record("delayed_free_done", req_id=req_id, reason=reason,
                         block_ids=self.kv_cache_manager.get_block_ids(req_id)[0])
            self._free_blocks(self.requests[req_id])
        return True

    def _update_from_kv_xfer_finished(self, kv_out: Any) -> None:
        """vLLM's ``_update_from_kv_xfer_finished``: the connector sees the worker's output; then
        its finished transfers (asynchronous connectors only): a load wakes its request up in the
        next ``schedule()`` (``_update_waiting_for_remote_kv``); a finished request's held blocks
        are freed once its last transfer is done (``finished_sending`` on the producer,
        ``finished_recving`` after an abort)."""
        self.connector.update_connector_output(kv_out)
        for req_id in (kv_out.finished_recving or ()):
            if self._release_delayed_free(req_id, "recving"):
                continue
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished():
                self.finished_recving_kv_req_ids.add(req_id)
        for req_id in (kv_out.finished_sending or ()):
            self._release_delayed_free(req_id, "sending")
