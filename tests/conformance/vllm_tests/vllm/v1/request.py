"""vllm/v1/request.py -> minivllm/request.py."""
from __future__ import annotations

import enum

from minivllm.request import Request as _Request
from minivllm.request import RequestStatus
from vllm import _missing


class FinishReason(str, enum.Enum):
    """vLLM's FinishReason; its values are minivllm's ``get_finished_reason()`` strings."""
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


class Request(_Request):
    """vLLM's constructor: the EOS id comes with the sampling params
    (``update_from_generation_config``); multimodal inputs, pooling, LoRA, priorities and
    prompt embeddings are not in minivllm."""

    def __init__(self, request_id, prompt_token_ids, sampling_params, pooling_params=None,
                 eos_token_id=None, arrival_time=None, mm_features=None, lora_request=None,
                 cache_salt=None, priority=0, block_hasher=None, prompt_embeds=None, **kwargs):
        for name, value in (("pooling_params", pooling_params), ("mm_features", mm_features),
                            ("lora_request", lora_request), ("prompt_embeds", prompt_embeds),
                            ("priority", priority or None), *kwargs.items()):
            if value is not None and (not isinstance(value, (list, dict, str)) or value):
                _missing._raise(f"vllm.v1.request.Request({name}=...)")
        if eos_token_id is None and sampling_params is not None:
            eos_token_id = getattr(sampling_params, "_model_eos_token_id", None)
        super().__init__(request_id, prompt_token_ids, sampling_params, eos_token_id,
                         arrival_time=arrival_time, block_hasher=None)
        self.cache_salt = cache_salt
        if block_hasher is not None:   # after cache_salt: the salt enters the first block's hash
            self._block_hasher = block_hasher
            self.block_hashes = block_hasher(self)


__getattr__ = _missing.module_getattr(__name__)
__all__ = ["FinishReason", "Request", "RequestStatus"]
