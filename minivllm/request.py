"""A request's engine-side state, mirroring vllm/v1/request.py.

Key fields (vLLM's names): ``num_computed_tokens`` is optimistic: the scheduler adds the scheduled count
before the model runs, and ``update_from_output`` subtracts rejected drafts afterwards.
``spec_token_ids`` holds the current unverified drafts (article step 3: "store these in
request.spec_token_ids").
"""
from __future__ import annotations

import enum
import time
from typing import Callable, Optional

from minivllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()     # kv_load_failure_policy="fail": the external KV did not load

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> Optional[str]:
        return _FINISHED_REASON.get(status)


_FINISHED_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: Optional[int],
        arrival_time: Optional[float] = None,
        block_hasher: Optional[Callable[["Request"], list[bytes]]] = None,
        prompt: Optional[str] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        if eos_token_id is not None:
            # The worker sees only the SamplingParams; min_tokens masks EOS there.
            sampling_params._eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int | str] = None
        self.max_tokens = sampling_params.max_tokens
        # P/D: what the client sent (vLLM reads it from SamplingParams.extra_args), and what the
        # connector's request_finished returned, for RequestOutput.kv_transfer_params.
        self.kv_transfer_params = (sampling_params.extra_args or {}).get("kv_transfer_params")
        self.output_kv_transfer_params: Optional[dict] = None

        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Set each step by the scheduler: the step computes only part of the prompt, samples
        # nothing, so no drafts are kept for it (vLLM's is_prefill_chunk).
        self.is_prefill_chunk = False
        # A request that must compute every prompt position reads no cached KV, neither the local
        # prefix cache nor the connector's (vLLM's skip_reading_prefix_cache): one asking for
        # prompt logprobs, as in vLLM's get_skip_reading_prefix_cache.
        self.skip_reading_prefix_cache = sampling_params.prompt_logprobs is not None
        # Local prefix-cache hit + externally loaded tokens, fixed when first scheduled.
        self.num_cached_tokens = -1
        self.num_external_computed_tokens = 0
        self.num_preemptions = 0
        # Text produced so far (detokenized by the engine), used for `stop` strings.
        self.output_text = ""

        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.block_hashes = block_hasher(self)

    # ---- read-only views -------------------------------------------------
    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> Optional[str]:
        return RequestStatus.get_finished_reason(self.status)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def __lt__(self, other: "Request") -> bool:
        return (self.arrival_time, self.request_id) < (other.arrival_time, other.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens}, "
                f"spec_token_ids={self.spec_token_ids})")
