"""The waiting requests that already hold KV blocks: vLLM 0.32's ``kv_holding_waiting`` queue
(vllm/v1/core/sched/scheduler.py, the waiting loop drains it before ``waiting``), and the
asynchronous-load path around it: entering it (``start_async_load``, the request waits in
``WAITING_FOR_REMOTE_KVS``), leaving it once the worker reported the load
(``update_waiting_for_remote_kv``), and the scan (``schedule_kv_holding``).

A request enters it when its connector loads its KV asynchronously: the RedisStore and ZmqPull
connectors do, the article's SharedStorage connector never does. The scheduler
(``Scheduler._start_async_load``, ``schedule_kv_holding``) calls into this file only when a load
is asynchronous or the queue is not empty, so the article's examples never run it. Step records: ``"remote_kv_wait"`` when a load starts,
``"remote_kv_ready"`` once it landed (trace.py).
"""
from __future__ import annotations

from collections import deque

from minivllm import trace
from minivllm.core.sched.utils import ComputedTokens, ScheduledRequests, SchedulerState
from minivllm.request import Request, RequestStatus


def start_async_load(sched: SchedulerState, request: Request,
                     computed_tokens: ComputedTokens) -> bool:
    """Load first, compute later: the connector's ``load_kv_async``. Blocks for the local
    hits and the external tokens only, not cached until the load lands; then the request
    waits in ``WAITING_FOR_REMOTE_KVS`` while the worker fetches in the background and other
    requests keep running. Returns False (nothing changed) when the blocks do not fit."""
    (new_computed_blocks, num_new_local_computed_tokens, num_external_computed_tokens,
     num_computed_tokens, _) = computed_tokens
    # No lookahead while the load is pending, as vLLM 0.32 (scheduler.py): nothing is
    # computed yet, so nothing drafts. The request gets its k slots once it runs.
    new_blocks = sched._allocate_and_update_state(
        request, num_new_tokens=0, num_new_local_computed_tokens=num_new_local_computed_tokens,
        new_computed_blocks=new_computed_blocks,
        num_external_computed_tokens=num_external_computed_tokens, num_lookahead_tokens=0,
        delay_cache_blocks=True)
    if new_blocks is None:
        return False
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.waiting_for_remote_kvs[request.request_id] = num_computed_tokens
    trace.record("remote_kv_wait", req_id=request.request_id,
                 num_local_computed_tokens=num_new_local_computed_tokens,
                 num_external_computed_tokens=num_external_computed_tokens)
    return True


def update_waiting_for_remote_kv(sched: SchedulerState, request: Request) -> bool:
    """vLLM's ``_update_waiting_for_remote_kv``: once the load is reported, the request's loaded
    tokens count as computed (only those before a failed block) and its full blocks enter the
    prefix cache. Returns whether the request can be scheduled now."""
    req_id = request.request_id
    if req_id not in sched.finished_recving_kv_req_ids:
        return False
    sched.finished_recving_kv_req_ids.remove(req_id)
    num_computed_tokens = min(sched.waiting_for_remote_kvs.pop(req_id), request.num_tokens - 1)
    if num_computed_tokens == 0:   # the first block already failed: start over, lookup included
        sched.kv_cache_manager.free(request)
    elif sched.kv_cache_manager.enable_caching:
        sched.kv_cache_manager.cache_blocks(request, num_computed_tokens)
    request.num_computed_tokens = num_computed_tokens
    request.num_external_computed_tokens = min(request.num_external_computed_tokens,
                                               num_computed_tokens)
    trace.record("remote_kv_ready", req_id=req_id, num_computed_tokens=num_computed_tokens)
    return True


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
            if not update_waiting_for_remote_kv(sched, request):
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
