"""Failed KV loads on the scheduler's side, mirroring vLLM's ``_handle_invalid_blocks`` and the
``kv_load_failure_policy="fail"`` path of vllm/v1/core/sched/scheduler.py's ``update_from_output``.

Loaded the first time a worker reports blocks whose external KV did not load
(``KVConnectorOutput.invalid_block_ids``), through ``Scheduler._handle_invalid_blocks``: a load
that succeeds, as in the article's examples, never reads this file. Step record:
``"kv_load_failed"`` (req_id, policy) when ``kv_load_failure_policy="fail"`` ends a request.
"""
from __future__ import annotations

from minivllm import trace
from minivllm.core.sched.utils import SchedulerState
from minivllm.request import Request, RequestStatus
from minivllm.utils import cdiv


def handle_invalid_blocks(sched: SchedulerState, invalid_block_ids: set[int]) -> set[str]:
    """External KV that failed to load after it was counted as computed (vLLM's
    ``_handle_invalid_blocks``): cut each affected request back to its first invalid block so
    the next step recomputes from there; its output this step was computed on bad KV.
    Returns the affected ids (running ones and asynchronous loads)."""
    affected = set()
    for req_id, target in list(sched.waiting_for_remote_kvs.items()):   # async loads
        block_ids = sched.kv_cache_manager.get_block_ids(req_id)[0]
        bad = [i for i, b in enumerate(block_ids[:cdiv(target, sched.block_size)])
               if b in invalid_block_ids]
        if bad:
            sched.waiting_for_remote_kvs[req_id] = min(target, bad[0] * sched.block_size)
            affected.add(req_id)
    for request in sched.running:
        block_ids = sched.kv_cache_manager.get_block_ids(request.request_id)[0]
        num_blocks = cdiv(request.num_computed_tokens, sched.block_size)
        bad = [i for i, b in enumerate(block_ids[:num_blocks]) if b in invalid_block_ids]
        if not bad:
            continue
        valid = bad[0] * sched.block_size
        lost = request.num_computed_tokens - valid
        request.num_computed_tokens = valid
        request.num_cached_tokens = min(request.num_cached_tokens, valid)
        request.num_external_computed_tokens = max(
            0, request.num_external_computed_tokens - lost)
        affected.add(request.request_id)
    return affected


def finish_failed_loads(sched: SchedulerState,
                        req_ids: set[str]) -> list[tuple[Request, list[int]]]:
    """``kv_load_failure_policy="fail"`` (vLLM 0.32's default): a request whose external KV
    did not load finishes with ``FINISHED_ERROR`` and no new tokens; an asynchronous load keeps
    its blocks until the worker reports it (``_free_request``)."""
    outputs = []
    for req_id in sorted(req_ids):
        request = sched.requests.get(req_id)
        if request is None or request.is_finished():
            continue
        trace.record("kv_load_failed", req_id=req_id, policy="fail")
        sched.finish_requests([req_id], RequestStatus.FINISHED_ERROR)
        outputs.append((request, []))
    return outputs
