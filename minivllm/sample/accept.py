"""What the rejection sampler applies to the target's logits before it accepts
(vllm/v1/sample/rejection_sampler.py: ``apply_logits_processors``, ``apply_sampling_constraints``)
and which of its rows are greedy, in a file of its own because two readers share them:
``rejection_sampler.py``, which accepts with them, and ``verify_record.py``, which records the same
decisions for the trace and the notebooks. The random rows' accept test itself,
``random_accept_mask``, is the torch backend's (rejection_torch.py); the record uses it too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minivllm.sample.metadata import SamplingMetadata

if TYPE_CHECKING:   # annotations only: the drafts' metadata loads with speculative decoding
    from minivllm.sample.spec_decode_metadata import SpecDecodeMetadata
from minivllm.sample.sampler import apply_temperature, apply_top_k_top_p

GREEDY_TEMPERATURE = 0.0


def _is_greedy(sampling_metadata: SamplingMetadata, batch_size: int, device) -> torch.Tensor:
    if sampling_metadata.all_greedy or sampling_metadata.all_random:
        return torch.full((batch_size,), sampling_metadata.all_greedy, dtype=torch.bool, device=device)
    return sampling_metadata.temperature == GREEDY_TEMPERATURE


def expand_batch_to_tokens_torch(x, cu_num_tokens, num_tokens, max_spec_len, replace_from=0,
                                 replace_to=0) -> torch.Tensor:
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return x.repeat_interleave(counts, output_size=num_tokens)


def apply_sampling_constraints(logits: torch.Tensor, metadata: SpecDecodeMetadata,
                               sampling_metadata: SamplingMetadata, backend: str = "torch") -> torch.Tensor:
    """Temperature, min_p, top-k and top-p per draft token: each request's values repeated over its
    drafts (vLLM 0.32 leaves min_p out here; applying it keeps every position distributed as the
    plain sampler's)."""
    if sampling_metadata.all_greedy:
        return logits
    expand = expand_batch_to_tokens_torch
    if backend == "triton":
        from minivllm.sample.rejection_kernels import expand_batch_to_tokens_triton as expand
    n, cu, msl = logits.shape[0], metadata.cu_num_draft_tokens, metadata.max_spec_len
    temperature = expand(sampling_metadata.temperature, cu, n, msl, GREEDY_TEMPERATURE, 1.0)
    top_k = None if sampling_metadata.top_k is None else expand(sampling_metadata.top_k, cu, n, msl)
    top_p = None if sampling_metadata.top_p is None else expand(sampling_metadata.top_p, cu, n, msl)
    logits = apply_temperature(logits, temperature)
    if sampling_metadata.min_p is not None:
        from minivllm.sample.ops.builtin import apply_min_p
        logits = apply_min_p(logits, expand(sampling_metadata.min_p, cu, n, msl))
    return apply_top_k_top_p(logits, top_k, top_p)


def apply_draft_logits_processors(logits: torch.Tensor, sampling_metadata: SamplingMetadata,
                                  metadata: SpecDecodeMetadata) -> torch.Tensor:
    """vLLM's ``RejectionSampler.apply_logits_processors``: the sampler's processors at every
    draft position, the earlier drafts counted as outputs (``ops/processors.py``), when a
    request asked for one."""
    if not sampling_metadata.needs_logits_processors:
        return logits
    from minivllm.sample.ops import processors
    return processors.apply_draft_logits_processors(logits, sampling_metadata, metadata)
