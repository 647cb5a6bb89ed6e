"""Presence, frequency and repetition penalties, mirroring vllm/v1/sample/ops/penalties.py
(``apply_all_penalties``) and vllm/model_executor/layers/utils.py (``apply_penalties``).

Per row, with ``counts[v]`` = how often token v is among the row's *output* tokens:

- repetition (vLLM's ``apply_repetition_penalties``): tokens seen in the prompt *or* the output have
  their logit divided by ``repetition_penalty`` when positive, multiplied by it otherwise;
- frequency: ``logit -= frequency_penalty * counts``;
- presence: ``logit -= presence_penalty * (counts > 0)``.

Frequency and presence follow OpenAI's definition and count output tokens only; repetition counts
the prompt too. Negative ids (a draft slot with nothing behind it) are not counted.
"""
from __future__ import annotations

import torch


def token_bin_counts(token_ids: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """``[rows, vocab]`` int64: how often each id occurs in each row's list (vLLM's
    ``get_token_bin_counts_and_mask``, lists padded with ``vocab_size``, a column dropped after)."""
    width = max((len(t) for t in token_ids), default=0)
    padded = torch.full((len(token_ids), width), vocab_size, dtype=torch.int64)
    for i, ids in enumerate(token_ids):
        if ids:
            row = torch.tensor(ids, dtype=torch.int64)
            padded[i, :len(ids)] = torch.where(row < 0, vocab_size, row)
    counts = torch.zeros((len(token_ids), vocab_size + 1), dtype=torch.int64)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size].to(device)


def apply_all_penalties(logits: torch.Tensor, prompt_token_ids: list[list[int]],
                        presence_penalties: torch.Tensor, frequency_penalties: torch.Tensor,
                        repetition_penalties: torch.Tensor,
                        output_token_ids: list[list[int]]) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` float32 (changed in place and returned); the penalties ``[rows]``;
    ``prompt_token_ids`` / ``output_token_ids`` one list per row."""
    vocab_size = logits.shape[-1]
    prompt_mask = token_bin_counts(prompt_token_ids, vocab_size, logits.device) > 0
    output_counts = token_bin_counts(output_token_ids, vocab_size, logits.device)
    output_mask = output_counts > 0
    penalties = torch.where(prompt_mask | output_mask, repetition_penalties.unsqueeze(1), 1.0)
    logits *= torch.where(logits > 0, 1.0 / penalties, penalties)
    logits -= frequency_penalties.unsqueeze(1) * output_counts
    logits -= presence_penalties.unsqueeze(1) * output_mask
    return logits
