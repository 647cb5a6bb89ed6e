"""Triton paged-attention kernels: store K/V through ``slot_mapping``; unified paged attention.

Mirrors vllm/attention/ops/triton_reshape_and_cache_flash.py (``reshape_and_cache_kernel``) and
vllm/attention/ops/triton_unified_attention.py (``kernel_unified_attention``), as called by
vllm/v1/attention/backends/triton_attn.py. The Python wrappers have the signatures of ``torch_ref.py``,
which is the spec; shapes are listed there. On CPU the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``, set by ``minivllm.triton_utils`` before any kernel is defined).

The unified kernel: one program per (tile of BLOCK_Q query tokens of one sequence, kv head). Its
BLOCK_M = BLOCK_Q * num_queries_per_kv rows are the (token, query head) pairs that share this kv
head, so each K/V tile is loaded once for the whole GQA group. It walks the sequence's context in
tiles of TILE_SIZE positions through the block table, keeping an online softmax (running max M,
running sum L, accumulator acc, all float32), and stops at the last position the tile's final
query may see (causal with the offset seq_len - query_len).
"""
from __future__ import annotations

from typing import Optional

import torch

from minivllm.triton_utils import INTERPRETED, KernelLaunch, triton, tl


@triton.jit
def reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_blk, stride_c_off, stride_c_head,
    num_kv_heads, head_size, block_size,
    KV_HEADS_PADDED: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,
):
    # One program per token: copy its [num_kv_heads, head_size] K and V into its cache slot.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, KV_HEADS_PADDED)[:, None]
    d = tl.arange(0, HEAD_SIZE_PADDED)[None, :]
    mask = (h < num_kv_heads) & (d < head_size)
    k = tl.load(key_ptr + token * stride_k_tok + h * stride_k_head + d, mask=mask)
    v = tl.load(value_ptr + token * stride_v_tok + h * stride_v_head + d, mask=mask)
    dst = blk * stride_c_blk + off * stride_c_off + h * stride_c_head + d
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, num_search_steps, BLOCK_Q: tl.constexpr):
    """The sequence owning global query tile ``q_block_idx``: the last s whose first tile
    (query_start_loc[s] // BLOCK_Q + s) is <= q_block_idx. Binary search with a host-computed
    number of steps (ceil(log2(num_seqs))), keeping start(lo) <= q_block_idx < start(hi)."""
    lo = q_block_idx * 0
    hi = lo + num_seqs
    for _ in range(num_search_steps):
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = first_tile <= q_block_idx
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def kernel_unified_attention(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale, num_seqs, num_search_steps,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_blk, stride_c_off, stride_c_head, stride_bt_seq,
    head_size, block_size,
    num_queries_per_kv: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_SIZE: tl.constexpr, DOT_FP32: tl.constexpr,
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq_idx = find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, num_search_steps, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    q_block_local = q_block_global - (q_start // BLOCK_Q + seq_idx)
    if q_block_local * BLOCK_Q >= q_len:  # the grid is an upper bound on the number of tiles
        return

    # Row m of the tile is query token q_block_local * BLOCK_Q + m // G, head kv_head * G + m % G.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    q_idx = q_block_local * BLOCK_Q + offs_m // num_queries_per_kv   # index within this query
    q_head = kv_head * num_queries_per_kv + offs_m % num_queries_per_kv
    row_ok = (offs_m < BLOCK_Q * num_queries_per_kv) & (q_idx < q_len)
    d_ok = offs_d < head_size

    q_offs = (q_start + q_idx)[:, None].to(tl.int64) * stride_q_tok \
        + q_head[:, None] * stride_q_head + offs_d[None, :]
    Q = tl.load(query_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        Q = Q.to(tl.float32)

    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - q_len          # tokens before this step's queries
    q_pos = context_len + q_idx            # absolute position of each row's token

    M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    L = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)

    # Keys up to the last position the tile's final query token may see.
    last_q_idx = tl.minimum((q_block_local + 1) * BLOCK_Q, q_len) - 1
    num_tiles = tl.cdiv(context_len + last_q_idx + 1, TILE_SIZE)
    for j in range(0, num_tiles):
        offs_t = j * TILE_SIZE + tl.arange(0, TILE_SIZE)            # absolute key positions
        t_ok = offs_t < seq_len
        # Paged lookup: position t lives in physical block block_table[seq, t // bs], offset t % bs.
        phys = tl.load(block_tables_ptr + seq_idx * stride_bt_seq + offs_t // block_size,
                       mask=t_ok, other=0).to(tl.int64)
        kv_offs = phys * stride_c_blk + (offs_t % block_size) * stride_c_off + kv_head * stride_c_head
        # K is loaded transposed, [HEAD_SIZE_PADDED, TILE_SIZE], ready for Q @ K^T.
        K = tl.load(key_cache_ptr + kv_offs[None, :] + offs_d[:, None],
                    mask=t_ok[None, :] & d_ok[:, None], other=0.0)
        V = tl.load(value_cache_ptr + kv_offs[:, None] + offs_d[None, :],
                    mask=t_ok[:, None] & d_ok[None, :], other=0.0)

        if DOT_FP32:  # exact float32 products (no TF32 on GPUs)
            S = scale * tl.dot(Q, K.to(tl.float32), input_precision="ieee")
        else:
            S = scale * tl.dot(Q, K.to(Q.dtype))                       # [BLOCK_M, TILE_SIZE] float32
        causal = (offs_t[None, :] <= q_pos[:, None]) & t_ok[None, :] & row_ok[:, None]
        S = tl.where(causal, S, float("-inf"))

        # Online softmax: rescale what we have to the new running max, then add this tile.
        m_new = tl.maximum(M, tl.max(S, axis=1))
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)       # fully masked rows stay finite
        P = tl.exp(S - m_new[:, None])
        alpha = tl.exp(M - m_new)
        L = L * alpha + tl.sum(P, axis=1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(P, V.to(tl.float32), input_precision="ieee")
        else:  # as in flash attention: P rounded to the cache dtype, products summed in float32
            acc = acc * alpha[:, None] + tl.dot(P.to(V.dtype), V)
        M = m_new

    L = tl.where(row_ok, L, 1.0)
    out = acc / L[:, None]
    o_offs = (q_start + q_idx)[:, None].to(tl.int64) * stride_o_tok \
        + q_head[:, None] * stride_o_head + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def reshape_and_cache_launch(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> KernelLaunch:
    """The ``reshape_and_cache_kernel`` call for these inputs (shared with
    ``minivllm.bench.triton_aot``)."""
    num_tokens, num_kv_heads, head_size = key.shape
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    return KernelLaunch(
        reshape_and_cache_kernel, (num_tokens,),
        dict(key_ptr=key, value_ptr=value, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
             slot_mapping_ptr=slot_mapping,
             stride_k_tok=key.stride(0), stride_k_head=key.stride(1),
             stride_v_tok=value.stride(0), stride_v_head=value.stride(1),
             stride_c_blk=key_cache.stride(0), stride_c_off=key_cache.stride(1),
             stride_c_head=key_cache.stride(2),
             num_kv_heads=num_kv_heads, head_size=head_size, block_size=kv_cache.shape[2]),
        dict(KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
             HEAD_SIZE_PADDED=triton.next_power_of_2(head_size)))


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, shared: Optional[dict] = None) -> None:
    """Same contract as ``torch_ref.reshape_and_cache`` (``shared`` unused: the kernel needs no
    per-step plan)."""
    if key.shape[0] == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(4) == 1
    reshape_and_cache_launch(key, value, kv_cache, slot_mapping).run()


def unified_attention_launch(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                             seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                             out: torch.Tensor, interpreted: bool = INTERPRETED) -> KernelLaunch:
    """The ``kernel_unified_attention`` call for these inputs (shared with
    ``minivllm.bench.triton_aot``).

    ``interpreted``: the kernels run in Triton's interpreter, which forces float32 dots."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    num_queries_per_kv = num_heads // num_kv_heads
    # tl.dot wants tiles of at least 16 rows; BLOCK_Q query tokens fill them with their GQA group.
    BLOCK_M = max(16, triton.next_power_of_2(num_queries_per_kv))
    BLOCK_Q = BLOCK_M // num_queries_per_kv
    # Enough tiles for every sequence: sequence s starts at tile query_start_loc[s] // BLOCK_Q + s.
    total_q_blocks = num_tokens // BLOCK_Q + num_seqs
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    return KernelLaunch(
        kernel_unified_attention, (total_q_blocks, num_kv_heads),
        dict(out_ptr=out, query_ptr=query, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
             block_tables_ptr=block_table, seq_lens_ptr=seq_lens,
             query_start_loc_ptr=query_start_loc,
             scale=float(scale), num_seqs=num_seqs, num_search_steps=(num_seqs - 1).bit_length(),
             stride_q_tok=query.stride(0), stride_q_head=query.stride(1),
             stride_o_tok=out.stride(0), stride_o_head=out.stride(1),
             stride_c_blk=key_cache.stride(0), stride_c_off=key_cache.stride(1),
             stride_c_head=key_cache.stride(2), stride_bt_seq=block_table.stride(0),
             head_size=head_size, block_size=block_size),
        dict(num_queries_per_kv=num_queries_per_kv,
             HEAD_SIZE_PADDED=max(16, triton.next_power_of_2(head_size)),
             BLOCK_Q=BLOCK_Q, BLOCK_M=BLOCK_M, TILE_SIZE=32,
             # The interpreter cannot multiply bfloat16 (it stores it as uint16 and tl.dot
             # multiplies the bit patterns, triton-lang/triton#11584), so there every dot runs in
             # float32.
             DOT_FP32=interpreted or query.dtype == torch.float32))


def unified_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                      max_seq_len: int, scale: float, shared: Optional[dict] = None) -> torch.Tensor:
    """Same contract as ``torch_ref.unified_attention`` (``shared`` unused: the kernel finds each
    query block's sequence itself, ``find_seq_idx``)."""
    out = torch.zeros_like(query)
    if seq_lens.shape[0] == 0 or query.shape[0] == 0:
        return out
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1 and block_table.stride(1) == 1
    unified_attention_launch(query, kv_cache, block_table, seq_lens, query_start_loc, scale,
                             out).run()
    return out
