"""Stop checks, mirroring vllm/v1/core/sched/utils.py ``check_stop``."""
from __future__ import annotations

from typing import Any, Callable, Optional

from minivllm import trace
from minivllm.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int,
               detokenize: Optional[Callable[[list[int]], str]] = None) -> bool:
    """After one appended token: EOS, stop token ids, length, then (from ``min_tokens`` on) stop
    strings; vLLM 0.32's order. EOS and stop ids cannot appear before ``min_tokens``: the sampler
    masks them (sample/logits_processor.py). Sets status."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if not params.ignore_eos and last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in params._all_stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if request.num_output_tokens < params.min_tokens:
        return False
    if params.stop and detokenize is not None:
        # vLLM checks stop strings in the front-end detokenizer; doing it here, token by token, lets an
        # accepted run of drafts end exactly where plain decoding would.
        text = detokenize(request.output_token_ids)
        for s in params.stop:
            if s in text:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = s
                return True
    return False


def record_schedule(scheduler: Any, so: Any, token_budget: int) -> None:
    """The "schedule" and "kv_cache" step records (minivllm/trace.py) for one schedule() call."""
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
        waiting=[r.request_id for r in scheduler.waiting],
        statuses={r.request_id: r.status.name for r in scheduler.requests.values()})
    ids = [r.request_id for r in scheduler.running]
    snap = scheduler.kv_cache_manager.snapshot(ids)
    snap["num_computed_tokens"] = {r.request_id: r.num_computed_tokens for r in scheduler.running}
    trace.record("kv_cache", **snap)
