"""The scheduler's step records (minivllm/trace.py): ``"schedule"`` and ``"kv_cache"``, one each
per ``Scheduler.schedule()`` call. Read only when a step is being recorded
(``engine.tracer.enabled = True``: the tours, the notebooks' figures); a plain run never imports
this file."""
from __future__ import annotations

from typing import Any

from minivllm import trace


def record_schedule(scheduler: Any, so: Any, token_budget: int) -> None:
    """``so``: the step's ``SchedulerOutput``; ``token_budget``: what was left of the budget."""
    trace.record(
        "schedule", num_scheduled_tokens=dict(so.num_scheduled_tokens),
        scheduled_spec_decode_tokens={k: list(v) for k, v in
                                      so.scheduled_spec_decode_tokens.items()},
        preempted_req_ids=sorted(so.preempted_req_ids),
        new_req_ids=[r.req_id for r in so.scheduled_new_reqs],
        resumed_req_ids=sorted(so.scheduled_cached_reqs.resumed_req_ids),
        total_num_scheduled_tokens=so.total_num_scheduled_tokens,
        token_budget=scheduler.max_num_scheduled_tokens, token_budget_left=token_budget,
        running=[r.request_id for r in scheduler.running],
        waiting=[r.request_id for r in (*scheduler.kv_holding_waiting, *scheduler.waiting)],
        statuses={r.request_id: r.status.name for r in scheduler.requests.values()})
    ids = [r.request_id for r in scheduler.running]
    snap = scheduler.kv_cache_manager.snapshot(ids)
    snap["num_computed_tokens"] = {r.request_id: r.num_computed_tokens for r in scheduler.running}
    trace.record("kv_cache", **snap)
