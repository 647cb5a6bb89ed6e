"""``RMSNorm``, mirroring vllm/model_executor/layers/layernorm.py (the residual add fused in)."""
from __future__ import annotations

from typing import Optional

import torch
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
        # Hugging Face's formula, the variance in float32 even for bfloat16 (squares overflow or
        # lose bits otherwise; a bfloat16 x times the float32 factor is computed in float32).
        # F.rms_norm gives the same numbers, but on a CPU it runs as some 17 small ops.
        out = self.weight * (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)
                                             + self.variance_epsilon)).to(x.dtype)
        return out if residual is None else (out, residual)
