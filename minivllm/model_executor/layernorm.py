"""``RMSNorm``, mirroring vllm/model_executor/layers/layernorm.py (the residual add fused in)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """vllm/model_executor/layers/layernorm.py: ``forward(x, residual)`` fuses the residual add.

    With a residual it returns ``(norm(x + residual), x + residual)``, so the decoder layer carries
    the un-normalised stream as ``residual`` (vLLM's layout) instead of adding it back itself.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32 and x.device.type != "cpu":   # one fused kernel on a GPU
            out = F.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)
            return out if residual is None else (out, residual)
        # Below: the same numbers as F.rms_norm's, in fewer ops on a CPU, where torch runs
        # F.rms_norm as some 17 small ops (casts and copies included), each paying its dispatch.
        orig_dtype = x.dtype
        # The variance is taken in float32 even for bfloat16 weights: squares overflow/lose bits otherwise.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = self.weight * x32.to(orig_dtype)
        return out if residual is None else (out, residual)
