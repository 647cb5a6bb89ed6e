"""The linear layers every model projection uses, mirroring vllm/model_executor/layers/linear.py:
the layer asks its ``quant_method`` to compute ``y = x @ W.T + b`` (``LinearMethodBase.apply``),
and the fused layers ``MergedColumnParallelLinear`` (``gate_up_proj``) and ``QKVParallelLinear``
(``qkv_proj``) hold the checkpoint's separate matrices stacked along the output dim.

A fresh layer's method is ``UnquantizedLinearMethod``: plain ``F.linear``. The CPU's measured
routes (oneDNN on a packed weight, a 2-row GEMM, ...) are another method, set on each layer once
after loading (``cpu_linear.process_weights_after_loading``, as vLLM's
``UnquantizedLinearMethod.process_weights_after_loading`` dispatches the CPU GEMM); this file does
not know them.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethodBase:
    """How a ``Linear`` computes its product (vLLM: ``LinearMethodBase``, one per layer)."""

    def apply(self, layer: nn.Linear, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethodBase):
    """vLLM's ``UnquantizedLinearMethod.apply``: ``x [m, in]`` -> ``[m, out]`` with ``F.linear``."""

    def apply(self, layer: nn.Linear, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same names) whose forward is its ``quant_method``'s
    ``apply``. ``quant_method`` is a plain attribute, not a module: ``state_dict``, ``.to()`` and
    every reader of ``weight`` see only the parameters."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.quant_method: LinearMethodBase = UnquantizedLinearMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


ShardId = Union[int, str]


class MergedColumnParallelLinear(Linear):
    """Several projections of the same input in one matrix: ``weight [sum(output_sizes), in]``.

    vLLM's ``gate_up_proj`` (``output_sizes = [intermediate, intermediate]``, shard ids 0 and 1).
    One device here, so nothing is split across ranks; the name is vLLM's for a reader moving on.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard_range(self, shard_id: ShardId) -> tuple[int, int]:
        """``(offset, size)`` of one shard's rows in the stacked weight."""
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be in 0..{len(self.output_sizes) - 1}, got {shard_id!r}.")
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def shard(self, param: torch.Tensor, shard_id: ShardId) -> torch.Tensor:
        """A view of ``param`` (weight or bias) holding one checkpoint tensor: copying into it is
        vLLM's ``weight_loader(param, loaded_weight, shard_id)``."""
        offset, size = self.shard_range(shard_id)
        return param.narrow(0, offset, size)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: ShardId) -> None:
        target = self.shard(param, shard_id)
        if target.shape != loaded_weight.shape:
            raise ValueError(f"shard {shard_id!r} of a {tuple(param.shape)} stacked parameter has "
                             f"shape {tuple(target.shape)}, the checkpoint tensor "
                             f"{tuple(loaded_weight.shape)}.")
        target.copy_(loaded_weight)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``[m, sum(output_sizes)]`` -> one ``[m, size]`` view per shard."""
        return y.split(self.output_sizes, dim=-1)


class QKVParallelLinear(MergedColumnParallelLinear):
    """vLLM's ``qkv_proj``: ``weight [(num_heads + 2 * num_kv_heads) * head_size, hidden]``, rows in
    the order q, k, v (shard ids ``"q"``, ``"k"``, ``"v"``)."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False) -> None:
        self.q_size = total_num_heads * head_size
        self.kv_size = total_num_kv_heads * head_size
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=bias)

    def shard_range(self, shard_id: ShardId) -> tuple[int, int]:
        ids = ("q", "k", "v")
        if shard_id not in ids:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}.")
        return super().shard_range(ids.index(shard_id))
