"""Decode and verify attention for 16-bit caches as two batched matmuls: where ``cpu_attn`` sends
its short-query groups in bfloat16 and float16 (``cpu_attn._BMM_DTYPES``), instead of SDPA.

Why: SDPA's CPU kernel runs one task per (sequence, kv head), each with its own small matrix
products, and with a decode's few query rows (one per query head of the GQA group) that fixed cost
is most of the call. Here the whole group is one gather and two ``bmm`` calls. In float32 the
same path measured no faster than SDPA on a 2-core CPU, so float32 groups stay on SDPA.

Part of minivllm's counterpart of vLLM's ``CPUAttentionBackend``
(vllm/v1/attention/backends/cpu_attn.py), beside ``cpu_attn.py``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def attend_bmm(q: torch.Tensor, kv_cache: torch.Tensor, g: Any, scale: float,
               gather: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]) -> torch.Tensor:
    """q [B, kv_heads, group * max_q, head_dim] -> o of the same shape, as SDPA gives in
    ``cpu_attn._attend``, for a contiguous ``kv_cache [2, num_blocks, block_size, kv_heads, D]``.
    ``g``: the group's ``cpu_attn.CPUAttentionGroup``; ``gather``: ``cpu_attn._gather`` (an
    ``index_select`` into a reused buffer), passed in so that this module imports no sibling.

    One ``index_select`` over the cache seen as rows of ``head_dim`` gathers K and V head-major,
    [2, B * kv_heads, max_s, head_dim], straight into the layout ``bmm`` takes.

    The scores come out of ``bmm`` rounded to the cache's dtype, as in Hugging Face's eager
    attention (SDPA and vLLM's CPU kernels keep them in float32); the softmax runs in float32.
    Against a float32 run, greedy outputs agree as often as with SDPA (bench/RESULTS.md)."""
    num_kv_heads, head_dim = kv_cache.shape[3:]
    B, rows, S = g.B, q.shape[2], g.max_s
    if g.kv_rows is None or g.kv_rows[0] != kv_cache.shape:
        # The first layer of the step: row (slot, head) of the K half, then the same of V's half.
        half = kv_cache[0].numel() // head_dim
        r = g.slots.view(B, 1, S) * num_kv_heads \
            + torch.arange(num_kv_heads, device=g.slots.device).view(1, -1, 1)
        g.kv_rows = (kv_cache.shape, torch.cat([r.flatten(), r.flatten() + half]))
    kv = gather(kv_cache.view(-1, head_dim), g.kv_rows[1], "kv")
    kv = kv.view(2, B * num_kv_heads, S, head_dim)
    s = torch.bmm(q.reshape(B * num_kv_heads, rows, head_dim).to(kv.dtype), kv[0].transpose(1, 2))
    s = s.float().mul_(scale)
    if g.mask is not None:
        s.view(B, num_kv_heads, rows, S).add_(g.mask)
    p = torch.softmax(s, dim=-1).to(kv.dtype)
    return torch.bmm(p, kv[1]).view(B, num_kv_heads, rows, head_dim)
