"""``RMSNorm``, mirroring vllm/model_executor/layers/layernorm.py (the residual add fused in), with
the dispatch of vllm/model_executor/custom_op.py (``CustomOp``): ``forward_native`` is the formula,
``forward_cuda`` the fused op, and the choice is made once, not inside the forward. Article step:
the forward of every step (each decoder layer's two norms and the final one).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """vllm/model_executor/layers/layernorm.py: ``forward(x, residual)`` fuses the residual add.

    With a residual it returns ``(norm(x + residual), x + residual)``, so the decoder layer carries
    the un-normalised stream as ``residual`` (vLLM's layout) instead of adding it back itself.
    ``x`` and ``residual`` are ``[num_tokens, hidden_size]``.

    ``forward`` is the method ``dispatch_forward`` chose for the weight's device (vLLM's
    ``CustomOp``): ``forward_cuda`` on a GPU, ``forward_native`` elsewhere. A model is built on the
    meta device and then materialised where it runs, so the choice is made again whenever the
    weight moves (``.to()``, ``.to_empty()``, ``.cuda()``).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        # An instance attribute, so that ``norm(x)`` steps straight into the chosen method.
        self.forward = self.dispatch_forward()

    def dispatch_forward(self) -> Callable:
        """vLLM's ``CustomOp.dispatch_forward``: the fused op on CUDA, the formula elsewhere."""
        return self.forward_cuda if self.weight.device.type == "cuda" else self.forward_native

    def _apply(self, fn: Callable, recurse: bool = True) -> "RMSNorm":
        super()._apply(fn, recurse)
        self.forward = self.dispatch_forward()   # the weight may be on another device now
        return self

    def forward_native(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Hugging Face's formula, the variance in float32 even for bfloat16 (squares overflow or
        lose bits otherwise; a bfloat16 x times the float32 factor is computed in float32). On a
        CPU it takes fewer ops than ``F.rms_norm``, which runs there as some 17 small ones."""
        if residual is not None:
            x = residual = x + residual
        out = self.weight * (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)
                                             + self.variance_epsilon)).to(x.dtype)
        return out if residual is None else (out, residual)

    def forward_cuda(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """The same numbers in one fused kernel: ``F.rms_norm`` (vLLM calls its own
        ``rms_norm`` / ``fused_add_rms_norm`` kernels here)."""
        if residual is not None:
            x = residual = x + residual
        out = F.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)
        return out if residual is None else (out, residual)
