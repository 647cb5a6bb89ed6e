"""vLLM 0.32's logits processors in the sampler's order, mirroring ``Sampler.apply_logits_processors``
in vllm/v1/sample/sampler.py: the allowed-token mask, bad words, ``min_tokens``, logit bias, then the
penalties. They run only for a batch where some row asked for one of them
(``SamplingMetadata.needs_logits_processors``); the article's sampling needs none of them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from minivllm.sample.logits_processor import apply_min_tokens
from minivllm.sample.metadata import SamplingMetadata

if TYPE_CHECKING:   # annotations only: the drafts' metadata loads with speculative decoding
    from minivllm.spec_decode.metadata import SpecDecodeMetadata
from minivllm.sample.ops import drafts
from minivllm.sample.ops.bad_words import apply_bad_words
from minivllm.sample.ops.builtin import apply_allowed_token_ids, apply_logit_bias
from minivllm.sample.ops.penalties import apply_all_penalties


def combine_outputs_with_spec_tokens(output_token_ids: list[list[int]],
                                     spec_token_ids: Optional[list[list[int]]],
                                     num_draft_tokens: list[int]) -> list[list[int]]:
    """vLLM's ``Sampler._combine_outputs_with_spec_tokens``: a bonus row follows all its request's
    drafts, so they count as outputs there (penalties, bad words)."""
    if spec_token_ids is None:
        return output_token_ids
    return [[*out, *spec[:n]] for out, spec, n in zip(output_token_ids, spec_token_ids,
                                                      num_draft_tokens)]


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata,
                            num_draft_tokens: Optional[list[int]] = None) -> torch.Tensor:
    """``Sampler.apply_logits_processors`` on float32 ``logits`` ``[n, vocab]``, in its order:
    allowed-token mask, bad words, min_tokens, logit bias, penalties. With ``num_draft_tokens`` the
    rows are bonus rows (``min_tokens`` and the counted outputs include the drafts)."""
    output_token_ids = md.output_token_ids
    if num_draft_tokens is not None and (md.bad_words_token_ids or not md.no_penalties):
        output_token_ids = combine_outputs_with_spec_tokens(output_token_ids, md.spec_token_ids,
                                                            num_draft_tokens)
    if md.allowed_token_ids or md.bad_words_token_ids or md.logit_bias or not md.no_penalties:
        logits = logits.clone()   # the ops below write in place; the caller's logits stay
    logits = apply_allowed_token_ids(logits, md.allowed_token_ids)
    if md.bad_words_token_ids:
        apply_bad_words(logits, md.bad_words_token_ids, output_token_ids)
    logits = apply_min_tokens(logits, md, num_draft_tokens, bonus=num_draft_tokens is not None)
    logits = apply_logit_bias(logits, md.logit_bias)
    if not md.no_penalties:
        logits = apply_all_penalties(logits, md.prompt_token_ids, md.presence_penalties,
                                     md.frequency_penalties, md.repetition_penalties,
                                     output_token_ids)
    return logits


def apply_draft_logits_processors(logits: torch.Tensor, md: SamplingMetadata,
                                  metadata: SpecDecodeMetadata) -> torch.Tensor:
    """``RejectionSampler.apply_logits_processors``: the processors at every draft position
    (``drafts.draft_rows_metadata``: a row per draft, the earlier drafts counted as outputs), then
    ``min_tokens`` by output position (vLLM's ``MinTokensLogitsProcessor.apply_with_spec_decode``), so
    a masked stop token is never accepted. Unlike vLLM 0.32 the logit bias applies here too, as in
    the plain sampler."""
    if md.allowed_token_ids or md.bad_words_token_ids or md.logit_bias or not md.no_penalties:
        logits = apply_logits_processors(logits, drafts.draft_rows_metadata(md, metadata))
    return apply_min_tokens(logits, md, metadata.num_draft_tokens)
