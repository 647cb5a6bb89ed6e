"""Requests finished from outside the step, mirroring vLLM's ``Scheduler.finish_requests``
(vllm/v1/core/sched/scheduler.py): an abort (``LLMEngine.abort_request``,
``FINISHED_ABORTED``) or a KV load that failed under ``kv_load_failure_policy="fail"``
(failed_loads.py, ``FINISHED_ERROR``).

A request that finishes on its own (EOS, a stop, its length) is freed in ``update_from_output``;
the article's examples finish no other way, so they never read this file.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.request import RequestStatus

if TYPE_CHECKING:
    from minivllm.core.sched.scheduler import Scheduler


def finish_requests(sched: "Scheduler", request_ids: list[str],
                    finished_status: RequestStatus) -> None:
    """Take each unfinished request out of whichever queue holds it, set its status and free it
    (``_free_request``: its blocks may stay while a transfer still uses them)."""
    for req_id in request_ids:
        request = sched.requests.get(req_id)
        if request is None or request.is_finished():
            continue
        for queue in (sched.running, sched.waiting, sched.kv_holding_waiting):
            if request in queue:
                queue.remove(request)
        request.status = finished_status
        sched._free_request(request)
