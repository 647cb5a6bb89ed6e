"""vllm/v1/sample/rejection_sampler.py -> minivllm/sample/rejection_sampler.py (torch reference).

vLLM's sampler is built around a ``Sampler`` and samples the bonus tokens itself from
``logits[bonus_logits_indices]``; minivllm's takes the bonus tokens as an argument and the target
logits only (delta row 11). ``forward`` here asks the given sampler for the bonus tokens, then runs
minivllm's, and returns vLLM's ``SamplerOutput``. Logprobs are not in minivllm."""
from __future__ import annotations

import itertools

from minivllm.sample import rejection_sampler as _mini
from minivllm.sample import rejection_torch as _mini_torch
from minivllm.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID
from minivllm.spec_decode.metadata import SpecDecodeMetadata
from vllm import _missing
from vllm.v1.sample.sampler import SamplerOutput


class RejectionSampler(_mini.RejectionSampler):
    def __init__(self, sampler, *args, **kwargs):
        if args or any(kwargs.values()):   # synthetic acceptance, block verification
            _missing._raise("vllm RejectionSampler(rejection_sample_method / synthetic rates)")
        super().__init__(backend="torch")
        self.sampler = sampler

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        bonus = self.sampler(logits=logits[metadata.bonus_logits_indices],
                             sampling_metadata=sampling_metadata).sampled_token_ids
        target_logits = logits[metadata.target_logits_indices]
        out = super().forward(metadata, draft_probs, target_logits, bonus.reshape(-1),
                              sampling_metadata)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)


def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                            draft_token_ids, draft_probs, target_probs, sampling_metadata,
                            device, **kwargs):
    if any(kwargs.values()):
        _missing._raise(f"vllm sample_recovered_tokens({', '.join(kwargs)})")
    q = _mini_torch.generate_recovery_noise(len(num_draft_tokens), target_probs.shape[-1],
                                            list(num_draft_tokens), sampling_metadata.generators,
                                            device)
    flat = draft_token_ids.reshape(-1)
    ids, starts = flat.tolist(), [0, *itertools.accumulate(num_draft_tokens)]
    md = SpecDecodeMetadata.make_dummy([ids[a:b] for a, b in zip(starts, starts[1:])], device)
    q_per_draft = _mini_torch.TorchRejectionBackend.expand_batch_to_tokens(q, md)
    recovered = _mini_torch.sample_recovered_tokens_torch(flat, draft_probs, target_probs, q_per_draft)
    return recovered.reshape(draft_token_ids.shape)


__getattr__ = _missing.module_getattr(__name__)
__all__ = ["PLACEHOLDER_TOKEN_ID", "RejectionSampler", "sample_recovered_tokens"]
