"""What the scheduler hands the workers each step, mirroring vllm/v1/core/sched/output.py.

New requests travel in full (``NewRequestData``); requests the worker already knows travel as
column-oriented deltas (``CachedRequestData``). For a request resumed after preemption,
``new_block_ids`` *replaces* the worker's block list; otherwise it is appended.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from minivllm.request import Request
from minivllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int

    @classmethod
    def from_request(cls, request: Request, block_ids: tuple[list[int], ...]) -> "NewRequestData":
        return cls(req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                   sampling_params=request.sampling_params, block_ids=block_ids,
                   num_computed_tokens=request.num_computed_tokens)


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    # For resumed requests only: every token id so far (the worker dropped its row at preemption).
    resumed_req_token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids: list[Optional[tuple[list[int], ...]]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> number of tokens scheduled this step (drafts included)
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> draft token ids to verify this step (only requests that have drafts)
    scheduled_spec_decode_tokens: dict[str, list[int]]
    num_common_prefix_blocks: list[int]
    # Requests finished since the previous step: the worker drops their rows.
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = field(default_factory=set)
    # Opaque to the scheduler: what the scheduler-side KV connector tells the worker-side one.
    kv_connector_metadata: Any = None
    # vLLM 0.32: a request admitted this step loads external KV synchronously (the context manager
    # option kv_connector_context="vllm_today" starts loads before the forward only then).
    has_sync_kv_loads: bool = False
