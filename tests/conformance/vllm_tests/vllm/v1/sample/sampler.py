"""vllm/v1/sample/sampler.py: the output type; ``Sampler`` is minivllm's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from minivllm.sample.sampler import Sampler
from vllm import _missing


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    logprobs_tensors: Optional[Any] = None


__getattr__ = _missing.module_getattr(__name__)
__all__ = ["Sampler", "SamplerOutput"]
