"""Preemption on the scheduler's side, mirroring vLLM's ``Scheduler._preempt_request``
(vllm/v1/core/sched/scheduler.py): recompute, not swap.

Loaded the first time ``schedule_running`` finds the KV pool out of blocks and preempts the last
running request. The article's examples never run out of blocks, so they never read this file.
Step record: ``"preempt"`` (req_id, num_computed_tokens_before).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm import trace
from minivllm.request import Request, RequestStatus

if TYPE_CHECKING:
    from minivllm.core.sched.scheduler import Scheduler


def preempt_request(sched: "Scheduler", request: Request) -> None:
    """Free all of the request's blocks and put it back at the head of ``waiting``: it starts
    over from token 0 (its prefix-cached blocks may still be found again), its drafts dropped."""
    trace.record("preempt", req_id=request.request_id,
                 num_computed_tokens_before=request.num_computed_tokens)
    sched.kv_cache_manager.free(request)
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    request.spec_token_ids = []
    request.num_preemptions += 1
    sched.num_preemptions_total += 1
    sched.waiting.appendleft(request)
