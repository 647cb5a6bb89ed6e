"""The built-in logits processors, mirroring vllm/v1/sample/logits_processor/builtin.py
(``LogitBiasLogitsProcessor``, ``MinPLogitsProcessor``) and the sampler's allowed-token mask
(vLLM's ``allowed_token_ids_mask`` in ``InputBatch``). ``min_tokens`` is in
``sample/logits_processor.py``.
"""
from __future__ import annotations

import torch


def apply_allowed_token_ids(logits: torch.Tensor,
                            allowed_token_ids: dict[int, list[int]]) -> torch.Tensor:
    """Rows in ``allowed_token_ids`` keep only those ids; every other logit becomes ``-inf``."""
    if not allowed_token_ids:
        return logits
    mask = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    for row, ids in allowed_token_ids.items():
        mask[row] = True
        mask[row, torch.tensor(ids, dtype=torch.long, device=logits.device)] = False
    return logits.masked_fill_(mask, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, dict[int, float]]) -> torch.Tensor:
    """``logits[row, token] += bias`` for each row's ``{token_id: bias}`` (OpenAI's ``logit_bias``)."""
    if not logit_bias:
        return logits
    rows, cols, biases = [], [], []
    for row, bias in logit_bias.items():
        rows += [row] * len(bias)
        cols += list(bias)
        biases += list(bias.values())
    dev = logits.device
    logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] += torch.tensor(
        biases, dtype=logits.dtype, device=dev)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's ``MinPLogitsProcessor.apply``: drop tokens whose probability is below ``min_p`` times
    the row's largest. ``logits`` ``[rows, vocab]`` after temperature, ``min_p`` ``[rows]``."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))
