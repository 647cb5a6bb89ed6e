"""The rejection sampler's accept rule (vllm/v1/sample/rejection_sampler.py), in a file of its own
because two readers share it: the torch reference in ``rejection_sampler.py``, which accepts with
it, and ``verify_record.py``, which records the same decisions for the trace and the notebooks.
"""
from __future__ import annotations

import torch

from minivllm.sample.metadata import SamplingMetadata

GREEDY_TEMPERATURE = 0.0


def random_accept_mask(draft_token_ids, draft_probs, target_probs, uniform_probs) -> torch.Tensor:
    """Per draft token: does it pass ``p_d > 0 and p_t / p_d >= u`` (float32 ratio, float64 compare)?
    A -1 placeholder never passes."""
    real = draft_token_ids >= 0
    idx = draft_token_ids.long().clamp(min=0).unsqueeze(-1)
    p_target = target_probs.gather(-1, idx).squeeze(-1)
    if draft_probs is None:
        return real & (p_target >= uniform_probs)
    p_draft = draft_probs.gather(-1, idx).squeeze(-1)
    return real & (p_draft > 0) & (p_target / p_draft >= uniform_probs)


def _is_greedy(sampling_metadata: SamplingMetadata, batch_size: int, device) -> torch.Tensor:
    if sampling_metadata.all_greedy or sampling_metadata.all_random:
        return torch.full((batch_size,), sampling_metadata.all_greedy, dtype=torch.bool, device=device)
    return sampling_metadata.temperature == GREEDY_TEMPERATURE
