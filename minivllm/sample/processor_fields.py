"""The fields of ``SamplingMetadata`` for vLLM 0.32's logits processors and logprobs (the penalties,
``min_p``, logit bias, allowed ids, bad words, ``min_tokens``, ``max_num_logprobs``), filled by
``SamplingMetadata.from_params`` (sample/metadata.py) only when a row's ``SamplingParams`` asks for
one (``needs_processor_fields``); otherwise they keep their empty defaults.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from minivllm.sampling_params import _SAMPLING_EPS, SamplingParams


def fill_logits_processor_fields(md: Any, params: Sequence[SamplingParams],
                                  prompt_token_ids: Optional[Sequence[list[int]]],
                                  num_output_tokens: Optional[Sequence[int]], device) -> None:
    """The penalties, min_p, logit bias, allowed ids, bad words, min_tokens and logprobs fields of
    ``md``, the ``SamplingMetadata`` being built, whose ``output_token_ids`` are filled (this
    module never imports its host); the other arguments as in ``from_params``."""
    if not all(p.no_penalties for p in params):
        t = lambda name: torch.tensor([getattr(p, name) for p in params],  # noqa: E731
                                      dtype=torch.float32, device=device)
        md.presence_penalties = t("presence_penalty")
        md.frequency_penalties = t("frequency_penalty")
        md.repetition_penalties = t("repetition_penalty")
        md.prompt_token_ids = (list(prompt_token_ids) if prompt_token_ids is not None
                               else [[] for _ in params])
    if any(p.min_p > _SAMPLING_EPS for p in params):
        md.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    md.logit_bias = {i: p.logit_bias for i, p in enumerate(params) if p.logit_bias}
    md.allowed_token_ids = {i: list(p.allowed_token_ids) for i, p in enumerate(params)
                            if p.allowed_token_ids is not None}
    md.bad_words_token_ids = {i: p.bad_words_token_ids for i, p in enumerate(params)
                              if p.bad_words_token_ids}
    for i, p in enumerate(params):   # the rows whose stop ids are still masked
        done = num_output_tokens[i] if num_output_tokens is not None else len(md.output_token_ids[i])
        if done < p.min_tokens and p.all_stop_token_ids:
            md.min_tokens[i] = (p.min_tokens, done, sorted(p.all_stop_token_ids))
    asked = [p.logprobs for p in params if p.logprobs is not None]
    if asked:
        md.max_num_logprobs = -1 if -1 in asked else max(asked)
