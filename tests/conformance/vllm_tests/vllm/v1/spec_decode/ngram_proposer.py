"""vllm/v1/spec_decode/ngram_proposer.py -> minivllm/spec_decode/ngram_proposer.py.

vLLM's proposer takes the batch (``token_ids_cpu`` rows, ``num_tokens_no_spec``); minivllm's
proposes for one context (delta row 19). A request that sampled nothing this step (a partial
prefill) gets no drafts, as in vLLM. vLLM's numba thread pool and its batch buffers
(``valid_ngram_draft``) are not in minivllm."""
from __future__ import annotations

import numpy as np

from minivllm.spec_decode.ngram_proposer import NgramProposer as _NgramProposer
from vllm import _missing


class NgramProposer(_NgramProposer):
    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        super().__init__(spec.prompt_lookup_min, spec.prompt_lookup_max,
                         spec.num_speculative_tokens, vllm_config.model_config.max_model_len)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                num_speculative_tokens=None, **kwargs):
        if num_speculative_tokens not in (None, self.k) or any(kwargs.values()):
            _missing._raise("vllm NgramProposer.propose(num_speculative_tokens per step / ...)")
        return [super(NgramProposer, self).propose(token_ids_cpu[i, :num_tokens_no_spec[i]])
                if len(sampled) else [] for i, sampled in enumerate(sampled_token_ids)]


def _find_longest_matched_ngram_and_propose_tokens(origin_tokens, min_ngram, max_ngram,
                                                   max_model_len, k):
    drafts = _NgramProposer(min_ngram, max_ngram, k, max_model_len).propose(origin_tokens)
    return np.array(drafts, dtype=np.int32)


__getattr__ = _missing.module_getattr(__name__)
