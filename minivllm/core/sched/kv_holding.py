"""The waiting requests that already hold KV blocks: vLLM 0.32's ``kv_holding_waiting`` queue
(vllm/v1/core/sched/scheduler.py, the waiting loop drains it before ``waiting``).

A request enters it when its connector loads its KV asynchronously (``_start_async_load``,
kv_transfer.py): the RedisStore and ZmqPull connectors do, the article's SharedStorage connector
never does. ``KVTransferMixin.schedule_kv_holding`` reads this file only when the queue is not
empty, so the article's examples never load it.
"""
from __future__ import annotations

from collections import deque

from minivllm.core.sched.utils import ComputedTokens, ScheduledRequests, SchedulerState
from minivllm.request import Request, RequestStatus


def schedule_kv_holding(sched: SchedulerState, scheduled: ScheduledRequests) -> bool:
    """The requests whose asynchronous load was started, scanned before ``waiting``. One still
    loading is skipped (the scan goes on); once the worker reported its load, its loaded tokens
    are computed and their blocks allocated, so it needs no lookup, only slots for the rest of its
    prompt (vLLM: "WAITING reqs have num_computed_tokens > 0 after async KV recvs are
    completed"). A load whose first block failed starts over in ``waiting``, lookup included.
    Returns False when a request found no room: then no waiting request is scheduled this step
    either, as in vLLM."""
    skipped: deque[Request] = deque()
    fits = True
    while (sched.kv_holding_waiting and scheduled.token_budget > 0
           and len(sched.running) < sched.max_num_running_reqs):
        request = sched.kv_holding_waiting[0]
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if not sched._update_waiting_for_remote_kv(request):
                skipped.append(sched.kv_holding_waiting.popleft())
                continue
            request.status = (RequestStatus.PREEMPTED if request.num_preemptions
                              else RequestStatus.WAITING)
        if request.num_computed_tokens == 0:
            sched.waiting.appendleft(sched.kv_holding_waiting.popleft())
            continue
        num_new_tokens = request.num_tokens - request.num_computed_tokens
        if 0 < sched.long_prefill_token_threshold < num_new_tokens:
            num_new_tokens = sched.long_prefill_token_threshold
        if not sched.enable_chunked_prefill and num_new_tokens > scheduled.token_budget:
            fits = False
            break
        num_new_tokens = min(num_new_tokens, scheduled.token_budget)
        new_blocks = sched._allocate_and_update_state(
            request, num_new_tokens=num_new_tokens, num_new_local_computed_tokens=0,
            new_computed_blocks=None, num_external_computed_tokens=0,
            num_lookahead_tokens=sched.num_lookahead_tokens)
        if new_blocks is None:
            fits = False
            break
        sched.kv_holding_waiting.popleft()
        loaded = ComputedTokens(
            new_computed_blocks=None, num_new_local_computed_tokens=0,
            num_external_computed_tokens=0, num_computed_tokens=request.num_computed_tokens,
            load_kv_async=False)   # computed by the load: no lookup, nothing external now
        sched._add_to_running(request, scheduled, num_new_tokens, loaded)
    sched.kv_holding_waiting.extendleft(reversed(skipped))
    return fits
