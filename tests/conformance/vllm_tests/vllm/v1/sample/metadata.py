"""vllm/v1/sample/metadata.py -> minivllm/sample/metadata.py.

vLLM's per-batch tensors become minivllm's per-request fields: ``allowed_token_ids_mask`` (True =
not allowed) becomes ``allowed_token_ids`` (the allowed ids of each masked row), a prompt tensor
becomes lists, penalties stay tensors. Custom logits processors are not in minivllm."""
from __future__ import annotations

from minivllm.sample.metadata import SamplingMetadata as _SamplingMetadata
from vllm import _missing


def SamplingMetadata(temperature, all_greedy, all_random, top_p, top_k, generators,
                     max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
                     frequency_penalties=None, presence_penalties=None,
                     repetition_penalties=None, output_token_ids=(), spec_token_ids=None,
                     allowed_token_ids_mask=None, bad_words_token_ids=None, logitsprocs=None,
                     **kwargs) -> _SamplingMetadata:
    if any(v is not None for v in kwargs.values()) or getattr(logitsprocs, "custom", None):
        _missing._raise(f"vllm.v1.sample.metadata.SamplingMetadata({', '.join(kwargs)})")
    allowed = {}
    if allowed_token_ids_mask is not None:
        for row, mask in enumerate(allowed_token_ids_mask.tolist()):
            if any(mask):
                allowed[row] = [t for t, masked in enumerate(mask) if not masked]
    if prompt_token_ids is not None and hasattr(prompt_token_ids, "tolist"):
        prompt_token_ids = prompt_token_ids.tolist()
    penalties = {} if no_penalties else dict(
        presence_penalties=presence_penalties, frequency_penalties=frequency_penalties,
        repetition_penalties=repetition_penalties)
    return _SamplingMetadata(
        temperature=temperature, all_greedy=all_greedy, all_random=all_random, top_p=top_p,
        top_k=top_k, generators=dict(generators or {}), max_num_logprobs=max_num_logprobs,
        prompt_token_ids=prompt_token_ids, output_token_ids=list(output_token_ids),
        spec_token_ids=list(spec_token_ids) if spec_token_ids is not None else None,
        allowed_token_ids=allowed, bad_words_token_ids=dict(bad_words_token_ids or {}),
        **penalties)


__getattr__ = _missing.module_getattr(__name__)
