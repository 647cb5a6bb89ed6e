"""Transfers that outlive their step, on the scheduler's side, mirroring vLLM's
``_update_from_kv_xfer_finished`` and the delayed branch of ``_free_request``
(vllm/v1/core/sched/scheduler.py).

Delayed free: a finished request leaves ``running`` / ``waiting`` at once, but its blocks and its
``requests`` entry stay while
(a) the connector's ``request_finished`` returned ``delay_free=True``, until the worker reports
the request in ``finished_sending`` (P in the pull model: D reads P's blocks after P finished), or
(b) an asynchronous load still writes into them, until ``finished_recving`` (an abort while
``WAITING_FOR_REMOTE_KVS``; the scheduler does this for every connector).

Called by the scheduler (``Scheduler._delay_or_free``, taken as an argument) only when a finished request must keep its
blocks or the worker reports a finished transfer: the article's SharedStorage connector moves
everything inside its step and never does, so its examples never read this file.
Step records: ``"delay_free"`` (req_id, reasons, block_ids) when a finished request keeps its
blocks, ``"delayed_free_done"`` (req_id, reason, block_ids) when they are freed at last.
"""
from __future__ import annotations

from typing import Any

from minivllm import trace
from minivllm.core.sched.utils import SchedulerState
from minivllm.request import Request


def delay_free(sched: SchedulerState, request: Request, sending: bool, recving: bool) -> None:
    """Keep a finished request's blocks while a transfer uses them: the connector's worker reads
    them out (``sending``), a load still writes into them (``recving``)."""
    reasons = ({"sending"} if sending else set()) | ({"recving"} if recving else set())
    sched.delayed_free[request.request_id] = reasons
    trace.record("delay_free", req_id=request.request_id, reasons=sorted(reasons),
                 block_ids=sched.kv_cache_manager.get_block_ids(request.request_id)[0])


def release_delayed(sched: SchedulerState, req_id: str, reason: str) -> bool:
    """One transfer holding a finished request's blocks completed; free them once none does.
    Returns whether ``req_id`` was a delayed finished request."""
    reasons = sched.delayed_free.get(req_id)
    if reasons is None:
        return False
    reasons.discard(reason)
    if not reasons:
        del sched.delayed_free[req_id]
        request = sched.requests.pop(req_id)
        trace.record("delayed_free_done", req_id=req_id, reason=reason,
                     block_ids=sched.kv_cache_manager.get_block_ids(req_id)[0])
        sched.kv_cache_manager.free(request)
    return True


def update_from_kv_xfer_finished(sched: SchedulerState, kv_out: Any) -> None:
    """The worker's finished transfers: a load wakes its request up in the next ``schedule()``
    (``kv_holding.py``); a finished request's held blocks are freed once its last transfer is
    done (``finished_sending`` on the producer, ``finished_recving`` after an abort)."""
    for req_id in (kv_out.finished_recving or ()):
        if release_delayed(sched, req_id, "recving"):
            continue
        request = sched.requests.get(req_id)
        if request is not None and not request.is_finished():
            sched.finished_recving_kv_req_ids.add(req_id)
    for req_id in (kv_out.finished_sending or ()):
        release_delayed(sched, req_id, "sending")
