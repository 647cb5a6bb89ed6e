"""Stop checks, mirroring vllm/v1/core/sched/utils.py ``check_stop`` (article spec step 8: repeat
until a stop condition is met), with the stop strings of vllm/v1/engine/detokenizer.py beside it:
the scheduler checks them after each token (``check_stop``), the engine cuts the output text at
them (``truncate_at_stop``); and what one ``Scheduler.schedule()`` call builds on its way to the
``SchedulerOutput`` (``ScheduledRequests``, ``schedule_spec_tokens``,
``make_cached_request_data``)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

from minivllm.core.kv_cache_utils import KVCacheBlocks
from minivllm.core.sched.output import CachedRequestData
from minivllm.request import Request, RequestStatus

if TYPE_CHECKING:
    from minivllm.config import VllmConfig
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.distributed.kv_transfer.base import KVConnectorBase_V1


class SchedulerState:
    """What the functions beside the scheduler (kv_holding.py, delayed_free.py, failed_loads.py)
    use of their host ``Scheduler``, which they take as an argument and never import: its state,
    set in ``Scheduler.__init__``, and the methods they call. Declarations only, for the reader
    and the editor."""
    vllm_config: VllmConfig
    block_size: int
    max_num_running_reqs: int
    enable_chunked_prefill: bool
    num_lookahead_tokens: int
    long_prefill_token_threshold: int
    kv_cache_manager: KVCacheManager
    connector: Optional[KVConnectorBase_V1]
    requests: dict[str, Request]
    waiting: deque[Request]
    kv_holding_waiting: deque[Request]
    running: list[Request]
    waiting_for_remote_kvs: dict[str, int]
    finished_recving_kv_req_ids: set[str]
    delayed_free: dict[str, set[str]]
    finish_requests: Callable[[list[str], RequestStatus], None]
    _allocate_and_update_state: Callable[..., Optional[KVCacheBlocks]]
    _add_to_running: Callable[..., None]


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
    gives them as locals (vllm/v1/core/sched/scheduler.py): the running loop makes it, the waiting
    loop adds to it, ``_make_scheduler_output`` turns it into the ``SchedulerOutput``."""
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


def make_cached_request_data(running_reqs: list[Request], resumed_reqs: list[Request],
                             req_to_new_blocks: dict[str, KVCacheBlocks]) -> CachedRequestData:
    """The requests the worker already knows (running) or knew (resumed after preemption), as
    column-oriented deltas (vLLM's ``_make_cached_request_data``)."""
    data = CachedRequestData()
    for req in running_reqs + resumed_reqs:
        data.req_ids.append(req.request_id)
        resumed = req in resumed_reqs
        if resumed:
            data.resumed_req_ids.add(req.request_id)
            data.resumed_req_token_ids[req.request_id] = list(req.all_token_ids)
        data.new_block_ids.append(req_to_new_blocks[req.request_id].get_block_ids())
        data.num_computed_tokens.append(req.num_computed_tokens)
        data.num_output_tokens.append(req.num_output_tokens)
    return data


def schedule_spec_tokens(request: Request, num_new_tokens: int,
                         scheduled_spec_decode_tokens: dict[str, list[int]]) -> None:
    """The drafts that fit in ``num_new_tokens`` go to the workers (the budget or max_model_len
    may have cut some); ``request.spec_token_ids`` is emptied, fresh drafts arrive through
    ``update_draft_token_ids()`` after this step (vLLM's "Speculative decode related" lines)."""
    num_scheduled_spec_tokens = (num_new_tokens + request.num_computed_tokens
                                 - request.num_tokens)
    if num_scheduled_spec_tokens > 0:
        scheduled_spec_decode_tokens[request.request_id] = (
            request.spec_token_ids[:num_scheduled_spec_tokens])
    request.spec_token_ids = []


def check_stop(request: Request, max_model_len: int,
               detokenize: Optional[Callable[[list[int]], str]] = None) -> bool:
    """After one appended token: EOS, stop token ids, length, then (from ``min_tokens`` on) stop
    strings; vLLM 0.32's order. EOS and stop ids cannot appear before ``min_tokens``: the sampler
    masks them (sample/logits_processor.py). Sets status.
    A free function, not a ``Scheduler`` method: vLLM keeps it free."""
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
    if params.stop and detokenize is not None:   # text, so a tokenizer
        # vLLM checks stop strings in the front-end detokenizer; doing it here, token by token,
        # lets an accepted run of drafts end exactly where plain decoding would.
        text = detokenize(request.output_token_ids)
        for stop_str in params.stop:
            if stop_str in text:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = stop_str
                return True
    return False


def truncate_at_stop(text: str, stop: str, include_stop_str_in_output: bool) -> str:
    """The output text up to the stop string (included with ``include_stop_str_in_output``)."""
    if stop not in text:
        return text
    cut = text.index(stop)
    return text[:cut + len(stop)] if include_stop_str_in_output else text[:cut]
