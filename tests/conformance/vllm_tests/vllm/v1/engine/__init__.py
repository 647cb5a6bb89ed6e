"""vllm/v1/engine: the output types the scheduler's ``update_from_output`` returns in vLLM."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from vllm import _missing
from vllm.v1.request import FinishReason


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: Optional[FinishReason] = None
    stop_reason: Any = None
    kv_transfer_params: Optional[dict] = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: Any = None
    finished_requests: Optional[set[str]] = None


__getattr__ = _missing.module_getattr(__name__)
