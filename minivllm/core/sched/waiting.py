"""The scheduler's waiting requests, mirroring the second loop of vLLM's ``Scheduler.schedule()``
(vllm/v1/core/sched/scheduler.py) and the article's P/D steps on the scheduler's side, in order:
"cache lookup" (``_get_computed_tokens``: the local prefix cache, then the connector's
``get_num_new_matched_tokens``), ``allocate_slots`` and "state update" (``_allocate_and_update_state``:
the connector's ``update_state_after_alloc``), then the request runs (``_add_to_running``).
A mixin of ``Scheduler`` (scheduler.py), which owns the state it reads (``SchedulerState``).
"""
from __future__ import annotations

from collections import deque
from typing import Optional

from minivllm import trace
from minivllm.core.kv_cache_utils import KVCacheBlocks
from minivllm.core.sched.utils import ComputedTokens, ScheduledRequests, SchedulerState
from minivllm.request import Request, RequestStatus


class WaitingMixin(SchedulerState):
    def schedule_waiting(self, scheduled: ScheduledRequests) -> None:
        """Next, the WAITING requests (vLLM's second loop), while the budget and ``max_num_seqs``
        allow: P/D "cache lookup" (``_get_computed_tokens``), the new tokens, ``allocate_slots``
        and P/D "state update" (``_allocate_and_update_state``), then the request runs.

        A request that cannot start now moves behind the others (``skipped_waiting_requests``):
        the connector asks to be asked again later. One whose KV loads asynchronously moves to
        ``kv_holding_waiting`` (kv_transfer.py: ``_start_async_load``). The first one that finds
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
            if load_kv_async:   # load first, compute later (kv_transfer.py)
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
        trace.record("prefix_hit", req_id=request.request_id,
                     num_local_computed_tokens=computed_tokens.num_new_local_computed_tokens,
                     num_external_computed_tokens=num_external_computed_tokens)
