"""The linear layers every model projection uses, mirroring vllm/model_executor/layers/linear.py:
``UnquantizedLinearMethod.apply`` (one place that decides how ``y = x @ W.T + b`` runs) and the
fused layers ``MergedColumnParallelLinear`` (``gate_up_proj``) and ``QKVParallelLinear``
(``qkv_proj``), whose weight is the checkpoint's separate matrices stacked along the output dim.

On the CPU, a product can run several ways at very different speeds (a decode batch: one row
per request; spec-decode verification: k + 1 per request; a prefill chunk: many rows); which is
fastest is measured per weight shape and row count (``kernel_choice``), not assumed. CUDA and
non-2-D inputs take ``F.linear``. All routes agree with ``F.linear`` to float32 rounding.
"""
from __future__ import annotations

from typing import Union

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model_executor.kernel_choice import CANDIDATES, MAX_TUNED_ROWS, PREPARE, choose


def _f_linear_only(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """No route to choose: CUDA, a non-2-D input, or autograd. The oneDNN routes have no
    backward, and a packed copy is not the parameter, so a gradient would silently miss the
    weight."""
    return x.device.type != "cpu" or x.dim() != 2 or x.shape[0] == 0 or (
        torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           route: str | None = None) -> torch.Tensor:
    """``x [m, in]``, ``weight [out, in]``, ``bias [out]`` -> ``[m, out]``."""
    if _f_linear_only(x, weight):
        return F.linear(x, weight, bias)
    return _run_route(x, weight, bias, route or choose(weight, x.shape[0]))


def _run_route(x: torch.Tensor, operand: torch.Tensor, bias: torch.Tensor | None,
               route: str) -> torch.Tensor:
    """``route`` on ``operand`` (the weight, or the copy a prepared route reads), plus ``bias``."""
    if route == "f_linear":
        return F.linear(x, operand, bias)
    out = CANDIDATES[route](x, operand)
    return out if bias is None else out + bias


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same names) that runs through :func:`linear`, remembering
    the measured route per row count so the forward pays one list lookup.

    A route that reads a prepared copy of the weight (``kernel_choice.PREPARE``: oneDNN's packed
    layout) gets it from :meth:`prepared_weight`, made on first use and remade whenever ``weight``
    is replaced or written in place (its version counter moves), so the copy is never stale. The
    copy is a plain attribute, not a buffer: ``state_dict``, ``.to()`` and every reader of
    ``weight`` see only the parameter."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Index m for m <= MAX_TUNED_ROWS rows, the last entry for more (a prefill).
        self._route_by_rows: list = [None] * (MAX_TUNED_ROWS + 2)
        self._prepared: tuple | None = None   # (route, weight, its version, the copy)

    def set_prepared(self, route: str, copy: torch.Tensor) -> None:
        """Adopt ``copy`` (``PREPARE[route](self.weight)``, made elsewhere: the tuner's)."""
        self._prepared = (route, self.weight, self.weight._version, copy)

    def prepared_weight(self, route: str) -> torch.Tensor:
        w, p = self.weight, self._prepared
        version = w._version
        if p is None or p[0] != route or p[1] is not w or p[2] != version:
            with torch.no_grad():
                p = self._prepared = (route, w, version, PREPARE[route](w.detach()))
        return p[3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _f_linear_only(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        m = x.shape[0]
        i = min(m, MAX_TUNED_ROWS + 1)
        route = self._route_by_rows[i]
        if route is None:
            route = self._route_by_rows[i] = choose(self.weight, m)
        operand = self.prepared_weight(route) if route in PREPARE else self.weight
        return _run_route(x, operand, self.bias, route)


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
