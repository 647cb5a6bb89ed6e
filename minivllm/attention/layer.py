"""The attention layer every model uses, mirroring vllm/attention/layer.py.

Shapes: ``query`` ``[num_tokens, num_heads * head_dim]``, ``key``/``value``
``[num_tokens, num_kv_heads * head_dim]``, output ``[num_tokens, num_heads * head_dim]``.
``self.kv_cache`` is this layer's paged cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = keys, 1 = values), bound by the model runner once the cache is allocated.

Per step, in order: (1) a KV connector may block until this layer's external KV is loaded
(``wait_for_layer_load``); (2) the new K/V are written into the paged cache through ``slot_mapping``
(``reshape_and_cache``); (3) one unified paged-attention call serves prefill chunks, decode and
multi-token spec-decode verification alike; (4) a connector may save this layer's KV
(``save_kv_layer``). Steps (1) and (4) are vLLM's ``maybe_transfer_kv_layer`` decorator (article,
"Disaggregated P/D": "KV transfers can also be done layer-by-layer").
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from minivllm.attention.backends import get_attn_backend
from minivllm.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 prefix: str = "", backend: str = "torch") -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_name = prefix
        self.backend = get_attn_backend(backend)
        self.kv_cache = torch.empty(0)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        md = ctx.attn_metadata
        connector = ctx.kv_connector
        transfer = connector is not None and connector.has_connector_metadata()
        if transfer:
            connector.wait_for_layer_load(self.layer_name)

        n = query.shape[0]
        q = query.view(n, self.num_heads, self.head_dim)
        k = key.view(n, self.num_kv_heads, self.head_dim)
        v = value.view(n, self.num_kv_heads, self.head_dim)
        self.backend.reshape_and_cache(k, v, self.kv_cache, md.slot_mapping, shared=md.shared)
        out = self.backend.unified_attention(
            q, self.kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
            md.max_query_len, md.max_seq_len, self.scale, shared=md.shared)

        if transfer:
            connector.save_kv_layer(self.layer_name, self.kv_cache, md)
        return out.view(n, self.num_heads * self.head_dim)


def kv_cache_bytes_per_token(layers: Iterable[Attention], dtype: torch.dtype) -> int:
    """K and V of one token across ``layers``: the unit the worker sizes the paged cache in."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return sum(2 * layer.num_kv_heads * layer.head_dim * elem for layer in layers)


def bind_kv_caches(layers: Iterable[Attention], num_blocks: int, block_size: int,
                   dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Give each layer its paged cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""
    caches = []
    for layer in layers:
        # Uninitialised on purpose: both attention backends only read slots that were written
        # (tests fill unused slots with NaN to prove it), and untouched pages then cost no memory.
        layer.kv_cache = torch.empty(2, num_blocks, block_size, layer.num_kv_heads,
                                     layer.head_dim, dtype=dtype, device=device)
        caches.append(layer.kv_cache)
    return caches
