"""Draft positions as rows of their own, mirroring ``RejectionSampler.apply_logits_processors`` /
``_combine_outputs_with_spec_tokens`` in vllm/v1/sample/rejection_sampler.py.

The rejection sampler tests draft j of a request against the target's logits at that position.
Plain decoding would have seen, there, the request's outputs *and* drafts 0..j-1 (they are output
by the time draft j is reached), so penalties and bad words must count them: each draft position
becomes a row with its request's parameters and those outputs.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

import torch

from minivllm.sample.metadata import SamplingMetadata

if TYPE_CHECKING:   # annotations only: the drafts' metadata loads with speculative decoding
    from minivllm.spec_decode.metadata import SpecDecodeMetadata


def combine_outputs_with_spec_tokens(output_token_ids: list[list[int]],
                                     draft_token_ids: list[list[int]]) -> list[list[int]]:
    """vLLM's ``RejectionSampler._combine_outputs_with_spec_tokens``: one list per draft position,
    the request's outputs followed by its drafts before that position (draft j is tested as if
    drafts 0..j-1 had been output already, which they have when j is reached)."""
    return [[*out, *drafts[:j]] for out, drafts in zip(output_token_ids, draft_token_ids)
            for j in range(len(drafts))]


def draft_rows_metadata(sampling_metadata: SamplingMetadata,
                        metadata: SpecDecodeMetadata) -> SamplingMetadata:
    """``sampling_metadata`` with one row per draft position (vLLM's ``repeat_indices``): each row
    carries its request's penalties, bias, allowed ids and bad words, and the outputs it follows."""
    md, num_draft = sampling_metadata, metadata.num_draft_tokens
    repeat = [i for i, n in enumerate(num_draft) for _ in range(n)]
    flat = metadata.draft_token_ids.tolist()
    starts = [0, *itertools.accumulate(num_draft)]
    per_request = [flat[starts[i]:starts[i + 1]] for i in range(len(num_draft))]
    remap = lambda per_req: {r: per_req[i] for r, i in enumerate(repeat) if i in per_req}  # noqa: E731
    rows = dataclasses.replace(
        md, min_tokens={}, logit_bias=remap(md.logit_bias),
        allowed_token_ids=remap(md.allowed_token_ids),
        bad_words_token_ids=remap(md.bad_words_token_ids),
        output_token_ids=combine_outputs_with_spec_tokens(md.output_token_ids, per_request))
    if not md.no_penalties:
        idx = torch.tensor(repeat, dtype=torch.long, device=md.presence_penalties.device)
        rows = dataclasses.replace(
            rows, presence_penalties=md.presence_penalties[idx],
            frequency_penalties=md.frequency_penalties[idx],
            repetition_penalties=md.repetition_penalties[idx],
            prompt_token_ids=[md.prompt_token_ids[i] for i in repeat])
    return rows
