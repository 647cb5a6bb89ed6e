"""``SiluAndMul``, mirroring vllm/model_executor/layers/activation.py: the SwiGLU gate applied to
the output of a fused ``gate_up_proj``.

``x [num_tokens, 2 * d]`` (gate rows first, then up, as ``MergedColumnParallelLinear`` stacks them)
-> ``silu(x[:, :d]) * x[:, d:]`` ``[num_tokens, d]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        # silu on the gate half writes a fresh tensor; the product is then taken in place into it.
        return F.silu(x[..., :d]).mul_(x[..., d:])
