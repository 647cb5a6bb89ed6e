"""Plain-PyTorch paged attention: the reference, and the spec of the other backends.

Mirrors the two ops vLLM's attention backends call per layer and step
(vllm/v1/attention/backends/triton_attn.py): storing the new K/V into the paged cache
(vllm/attention/ops/triton_reshape_and_cache_flash.py) and one unified paged-attention call for
prefill chunks, decode and spec-decode verification (vllm/attention/ops/triton_unified_attention.py).
``cpu_attn.py`` (the CPU default, planned for speed) and ``triton_attn.py`` have the same two
functions with the same signatures and compute the same attention.

Shapes:
    key, value     [num_tokens, num_kv_heads, head_dim]
    kv_cache       [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = keys, 1 = values)
    slot_mapping   [num_tokens] int64; slot s = block s // block_size, offset s % block_size; < 0 = padding
    query, out     [num_tokens, num_heads, head_dim]
    block_table    [num_seqs, max_num_blocks_per_seq] int32
    seq_lens       [num_seqs] int32, context length including this step's query tokens
    query_start_loc [num_seqs + 1] int32, cumulative query lengths

Written to be read and stepped through, one sequence at a time: gather its K/V through its block
table, then one causal ``scaled_dot_product_attention`` over its new tokens. ``shared`` (the step's
``AttentionMetadata.shared``) is accepted for the common signature and not used.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from minivllm.utils import cdiv


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, shared: Optional[dict] = None) -> None:
    """Write each token's K/V into its cache slot, in place; slots < 0 are padding tokens."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    # Index the 5-D cache directly (not a flattened view) so that a strided cache is written in place too.
    kv_cache[0, blocks, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value[keep].to(kv_cache.dtype)


def unified_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                      max_seq_len: int, scale: float, shared: Optional[dict] = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    Query token j of sequence s (query length q, context length L = seq_lens[s]) sits at absolute
    position p = L - q + j and attends to the keys at positions 0..p, where position t lives in block
    block_table[s, t // block_size] at offset t % block_size. The same rule covers a plain prefill
    (q = L), a prefill chunk after earlier context or a prefix-cache hit (q < L), a decode (q = 1)
    and the (k+1)-token verification of k drafts (causal among the new tokens). Rows of ``query``
    past query_start_loc[-1] (batch padding) come back as zeros.
    """
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for seq_idx, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[seq_idx], starts[seq_idx + 1]
        key, value = gather_kv(kv_cache, block_table[seq_idx], seq_len)
        out[q_start:q_end] = causal_attention(query[q_start:q_end], key.to(query.dtype),
                                              value.to(query.dtype), scale)
    return out


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor,
              seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values, each ``[seq_len, num_kv_heads, head_dim]``: its first
    ceil(seq_len / block_size) blocks, in block-table order, cut to the context length. Entries of
    ``block_ids`` past those are never read."""
    block_size = kv_cache.shape[2]
    num_blocks = cdiv(seq_len, block_size)
    blocks = block_ids[:num_blocks].long()
    key = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    value = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return key, value


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """``query`` ``[q_len, num_heads, head_dim]``, the sequence's last q_len positions, over
    ``key``/``value`` ``[seq_len, num_kv_heads, head_dim]``; returns ``[q_len, num_heads, head_dim]``."""
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    # GQA: each kv head serves num_heads // num_kv_heads consecutive query heads.
    key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)
    value = value.repeat_interleave(num_heads // num_kv_heads, dim=1)
    # Causal with an offset: query j sits at position seq_len - q_len + j and sees keys 0..that.
    # (SDPA's is_causal aligns the mask to the top-left corner, right only when q_len == seq_len.)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
    mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]   # [q_len, seq_len]
    out = F.scaled_dot_product_attention(query.transpose(0, 1), key.transpose(0, 1),
                                         value.transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)                                                  # [q_len, heads, dim]
