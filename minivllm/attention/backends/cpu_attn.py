"""Planned paged attention for the CPU: the default on a CPU ("auto"), beside the plain reference.

minivllm's counterpart of vLLM's ``CPUAttentionBackend`` (vllm/v1/attention/backends/cpu_attn.py):
the same two functions and signatures as the reference ``torch_ref.py`` (the spec, with the shapes)
and ``triton_attn.py``, the same attention, scheduled for speed:

- K/V are gathered with one ``index_select`` per group into a padded batch (reused buffers), and
  attention is one SDPA call per group with an explicit causal mask (``_attend``); in bfloat16 and
  float16, short queries run as two batched matmuls instead (``cpu_attn_bmm.py``);
- a lone sequence takes a shortcut with less bookkeeping (``_attend_single``);
- short queries (decodes, verifies) run in length-sorted groups, and a long query next to others
  that would waste too much padding (a long prefill beside decodes) runs alone;
- the plan (groups, gather indices, masks) depends only on the step's metadata: the first layer
  builds it (``build_plan``, the part of vLLM's ``CPUAttentionMetadataBuilder.build`` minivllm
  needs) and keeps it in ``AttentionMetadata.shared`` for the step's other layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

# A group of sequences is padded to its longest query and longest context. Above this ratio of padded
# to useful work (e.g. one long prefill next to many decodes) the long-query sequences run alone.
_MAX_PADDING_WASTE = 2.0
# Query length up to which a sequence always joins the shared batch (decode, k+1 verify, small chunks).
_SHORT_QUERY_LEN = 16
# Short queries run in groups of this many sequences, sorted by context length; in these dtypes they
# run in cpu_attn_bmm.py, where a bigger group costs less per sequence.
_GROUP_SEQS, _BMM_GROUP_SEQS, _BMM_DTYPES = 8, 16, (torch.bfloat16, torch.float16)
# Reused gather buffers (``_gather``): a fresh large tensor per layer and step costs more in
# page faults than the gather (glibc returns large freed blocks to the OS). Not safe across threads.
_BUFFERS: dict[tuple, torch.Tensor] = {}


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, shared: Optional[dict] = None) -> None:
    """Write each token's K/V into its cache slot, in place; slots < 0 are padding tokens.

    ``shared``: the step's ``AttentionMetadata.shared`` (see ``unified_attention``); the real
    tokens and their slots are the same for every layer, so they are found once per step."""
    entry = shared.get("slots") if shared is not None else None
    if entry is None:
        keep = slot_mapping >= 0
        entry = (None if bool(keep.all()) else keep, slot_mapping[keep].long())
        if shared is not None:
            shared["slots"] = entry
    keep, slots = entry
    if keep is not None:
        key, value = key[keep], value[keep]
    if kv_cache.is_contiguous():   # slot s is row s of each half seen as [slots, heads, head_dim]
        rows = kv_cache.view(2, -1, *kv_cache.shape[3:])
        rows[0].index_copy_(0, slots, key.to(kv_cache.dtype))
        rows[1].index_copy_(0, slots, value.to(kv_cache.dtype))
        return
    # A strided cache (a view) cannot be seen as rows: index its 5-D form, which writes in place.
    block_size = kv_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key.to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value.to(kv_cache.dtype)


@dataclass
class CPUAttentionGroup:
    """What one padded attention call over B sequences needs besides the layer's tensors (same in
    every layer of a step): which query rows, which cache slots, which keys each row may see."""
    tok: torch.Tensor               # [B * max_q] query row of each padded query (clamped)
    slots: torch.Tensor             # [B * max_s] cache slot of each padded key (clamped)
    mask: Optional[torch.Tensor]    # [B, 1, group * max_q, max_s] 0 / -inf, None: every key is seen
    rows: Optional[torch.Tensor]    # [num real queries] which padded query rows are real; None: all
    out_tok: torch.Tensor           # [num real queries] where each real query's output goes
    B: int
    max_q: int
    max_s: int
    kv_rows: Optional[tuple] = None  # cpu_attn_bmm's (cache shape, [2 * B * kv_heads * max_s] rows)


def unified_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                      max_seq_len: int, scale: float, shared: Optional[dict] = None) -> torch.Tensor:
    """The reference's attention (``torch_ref.unified_attention``: the rule, the shapes, zeros for
    rows past ``query_start_loc[-1]``), computed by the plan below.

    ``shared``: a dict that lives for one step (``AttentionMetadata.shared``). The plan below (how
    sequences are grouped, their gather indices and masks) depends only on the step's metadata,
    so the first layer builds it and the others reuse it: vLLM's backends do the same once per
    step in their ``AttentionMetadataBuilder.build`` (vllm/v1/attention/backends/).
    """
    out = torch.zeros_like(query)
    if seq_lens.shape[0] == 0:
        return out
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    plan_key = ("plan", block_size, query.shape[1] // num_kv_heads, query.dtype)
    plan = shared.get(plan_key) if shared is not None else None
    if plan is None:
        plan = build_plan(query.shape[0], query.shape[1] // num_kv_heads, block_size, block_table,
                          seq_lens, query_start_loc, max_query_len, max_seq_len, query.dtype)
        if shared is not None:
            shared[plan_key] = plan
    if isinstance(plan, tuple):   # a lone request: nothing to pad, so cheaper bookkeeping
        _attend_single(query, kv_cache, *plan, scale, out)
        return out
    for g in plan:
        _attend(query, kv_cache, g, scale, out)
    return out


def build_plan(num_tokens: int, group: int, block_size: int, block_table: torch.Tensor,
               seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
               max_seq_len: int, dtype: torch.dtype):
    """A lone sequence: ``(its blocks, q_len, seq_len, mask)`` for ``_attend_single``. Otherwise a
    list of ``CPUAttentionGroup``: one padded batch when padding costs little, else the short queries
    together (split by context length, so short contexts are not padded to the longest) and
    each long query on its own. The grouping only schedules the work: every query row attends
    to the same keys, whichever group it lands in."""
    q_starts = query_start_loc[:-1].long()
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    seq_lens = seq_lens.long()
    if seq_lens.shape[0] == 1:
        q_len, seq_len = int(q_lens[0]), int(seq_lens[0])
        mask = None                                           # a decode sees the whole context
        if q_len > 1:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=seq_lens.device)
            mask = torch.arange(seq_len, device=seq_lens.device)[None, :] <= q_pos[:, None]
            mask = _additive(mask.expand(group, q_len, seq_len).reshape(1, 1, group * q_len,
                                                                        seq_len), dtype)
        return (block_table[0, :-(-seq_len // block_size)], q_len, seq_len, mask)
    useful = int((q_lens * seq_lens).sum())
    num_seqs = seq_lens.shape[0]
    if num_seqs * max_query_len * max_seq_len <= _MAX_PADDING_WASTE * useful \
            and max_query_len > _SHORT_QUERY_LEN:
        groups = [torch.arange(num_seqs, device=seq_lens.device)]
    else:
        short = q_lens <= _SHORT_QUERY_LEN
        size = _BMM_GROUP_SEQS if dtype in _BMM_DTYPES else _GROUP_SEQS
        groups = _split_by_length(short.nonzero().flatten(), seq_lens, size) \
            if bool(short.any()) else []
        groups += [i.view(1) for i in (~short).nonzero().flatten()]
    return [_group(num_tokens, group, block_size, block_table[i], seq_lens[i], q_starts[i],
                   q_lens[i], dtype) for i in groups]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: the key is seen) as SDPA's additive one, 0 or -inf in the queries'
    dtype, made once per step: given a boolean mask, SDPA would convert it in every layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask,
                                                                                 float("-inf"))


def _split_by_length(idx: torch.Tensor, seq_lens: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Sequences ``idx`` sorted by context length, in groups of ``size``: neighbours in length pad
    little to each other, and a group's gathered K/V can stay in the CPU's cache while it is used."""
    order = torch.argsort(seq_lens[idx], descending=True)
    return list(idx[order].split(size))


def _group(num_tokens: int, group: int, block_size: int, block_table: torch.Tensor,
           seq_lens: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
           dtype: torch.dtype) -> CPUAttentionGroup:
    B, dev = seq_lens.shape[0], seq_lens.device
    max_q, max_s = int(q_lens.max()), int(seq_lens.max())
    # Queries: row j of sequence b is token q_starts[b] + j. Rows past q_lens[b] are padding; they read
    # some valid token (clamped index) and are never written back.
    j = torch.arange(max_q, device=dev)
    tok = q_starts[:, None] + j                                   # [B, max_q]
    q_valid = j < q_lens[:, None]
    tok = tok.clamp(max=num_tokens - 1)
    # Keys/values: position t of sequence b sits at slot block_table[b, t // bs] * bs + t % bs.
    # Positions past the context are clamped to the last real token, so that the padded batch only
    # ever reads written (finite) cache entries and no garbage block-table entry is dereferenced.
    t = torch.arange(max_s, device=dev)
    pos = torch.minimum(t[None, :], seq_lens[:, None] - 1)       # [B, max_s]
    blocks = block_table.long().gather(1, pos // block_size)
    slots = (blocks * block_size + pos % block_size).flatten()
    # The causal rule with its offset: query row j sees key t iff t <= L - q + j. This also keeps the
    # clamped padding keys (t >= L) away from every real row.
    q_pos = seq_lens[:, None] - q_lens[:, None] + j              # [B, max_q] absolute positions
    mask = t[None, None, :] <= q_pos[:, :, None]                 # [B, max_q, max_s]
    all_real = bool(q_valid.all())
    if all_real and max_q == 1 and bool((seq_lens == max_s).all()):
        mask = None                                              # decodes of equal length
    else:   # rows are (head in group, token) pairs, as the queries are laid out in _attend
        mask = _additive(mask[:, None].expand(B, group, max_q, max_s).reshape(
            B, 1, group * max_q, max_s), dtype)
    # The real rows as indices, found once here: a boolean index would run ``nonzero`` per layer.
    rows = None if all_real else q_valid.flatten().nonzero().flatten()
    return CPUAttentionGroup(tok.flatten(), slots, mask, rows, tok[q_valid], B, max_q, max_s)


def _attend(query: torch.Tensor, kv_cache: torch.Tensor, g: CPUAttentionGroup, scale: float,
            out: torch.Tensor) -> None:
    """Attention for the group's B sequences padded to [B, max_q] queries x [B, max_s] keys, into ``out``."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads        # query heads per kv head (GQA)
    B, max_q, max_s = g.B, g.max_q, g.max_s
    # GQA without copying K/V: the `group` query heads that share kv head h become extra query rows
    # of h (rows are (head in group, token) pairs), the grouping the Triton kernel's tiles use too.
    q = query.index_select(0, g.tok).view(B, max_q, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(B, num_kv_heads, group * max_q, head_dim)
    if query.dtype in _BMM_DTYPES and max_q <= _SHORT_QUERY_LEN and kv_cache.is_contiguous():
        from minivllm.attention.backends.cpu_attn_bmm import attend_bmm
        o = attend_bmm(q, kv_cache, g, scale, _gather)
    else:   # SDPA computes the softmax of bfloat16 inputs in float32.
        k_cache, v_cache = kv_cache.flatten(1, 2)   # each [num_blocks * bs, kv_heads, head_dim]
        k = _gather(k_cache, g.slots, "k").view(B, max_s, num_kv_heads, head_dim).to(query.dtype)
        v = _gather(v_cache, g.slots, "v").view(B, max_s, num_kv_heads, head_dim).to(query.dtype)
        o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=g.mask, scale=scale)
    o = o.view(B, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    o = o.reshape(B * max_q, num_heads, head_dim)
    o = o if g.rows is None else o.index_select(0, g.rows)
    out.index_copy_(0, g.out_tok, o.to(out.dtype))


def _attend_single(query: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor,
                   q_len: int, seq_len: int, mask: Optional[torch.Tensor], scale: float,
                   out: torch.Tensor) -> None:
    """``_attend`` for one sequence (query tokens 0..q_len-1): its K/V are its first whole blocks."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    kv = kv_cache.index_select(1, blocks).flatten(1, 2)[:, :seq_len]
    k, v = kv.to(query.dtype).transpose(1, 2).unsqueeze(1)        # each [1, kv_heads, seq_len, head_dim]
    q = query[:q_len].view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    q = q.reshape(1, num_kv_heads, group * q_len, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out[:q_len] = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).flatten(1, 2)


def _gather(cache: torch.Tensor, slots: torch.Tensor, name: str) -> torch.Tensor:
    """``cache.index_select(0, slots)`` into a reused buffer."""
    numel = slots.numel() * cache[0].numel()
    # A buffer made under inference_mode (the engine's steps) is an inference tensor, which cannot
    # be written outside it (a direct call, a test): one buffer per mode.
    key = (name, cache.device, cache.dtype, torch.is_inference_mode_enabled())
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        buf = _BUFFERS[key] = torch.empty(numel, dtype=cache.dtype, device=cache.device)
    out = buf[:numel].view(slots.numel(), *cache.shape[1:])
    return torch.index_select(cache, 0, slots, out=out)
