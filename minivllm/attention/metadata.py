"""Per-step attention metadata, built once by ``ModelRunner._prepare_inputs`` and shared by all layers.

Mirrors vLLM's ``CommonAttentionMetadata`` (vllm/v1/attention/backends/utils.py), reduced to what the
unified paged-attention kernel needs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor   # [num_reqs + 1] int32, cumulative query lengths (starts at 0)
    seq_lens: torch.Tensor          # [num_reqs] int32, context length after this step's tokens
    block_table: torch.Tensor       # [num_reqs, max_num_blocks_per_req] int32
    slot_mapping: torch.Tensor      # [num_tokens] int64, where each new token's K/V is written
    max_query_len: int
    max_seq_len: int
    # Per-step values every layer's backend would otherwise recompute alike (cpu_attn's plan:
    # groups, gather indices, masks): the first layer fills it, the rest reuse it. vLLM's backends
    # build theirs once per step in ``AttentionMetadataBuilder.build``. Valid for this step only,
    # which is why a fresh metadata object is built for every forward.
    shared: dict = field(default_factory=dict, repr=False, compare=False)
