"""Logprobs of sampled tokens, mirroring ``Sampler.compute_logprobs`` / ``gather_logprobs`` in
vllm/v1/sample/sampler.py and vllm/v1/sample/ops/logprobs.py (``batched_count_greater_than``).

``logprobs_mode`` (vLLM's engine argument) says which numbers come back:
``raw_logprobs`` (default: ``log_softmax`` of the model's logits), ``raw_logits``,
``processed_logprobs`` / ``processed_logits`` (after penalties, bias, masks, temperature, min_p,
top-k and top-p: what the token was drawn from).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def logprobs_source(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """What ``mode`` returns for these logits: their logprobs, or the logits themselves."""
    return logits.float().clone() if mode.endswith("_logits") else compute_logprobs(logits)


def logprobs_to_return(logits: torch.Tensor, processed: torch.Tensor, mode: str) -> torch.Tensor:
    """``SamplerOutput.logprobs``: ``raw_*`` from the model's ``logits``, ``processed_*`` from the
    ``processed`` logits the tokens were drawn from; ``[rows, vocab]``."""
    if mode.startswith("raw"):
        return logprobs_source(logits, mode)
    return processed if mode == "processed_logits" else compute_logprobs(processed)


@dataclass
class LogprobsTensors:
    """vLLM's ``LogprobsTensors``: ``logprob_token_ids`` ``[rows, k + 1]`` (the sampled or prompt
    token first, then the top k), ``logprobs`` the same shape, ``selected_token_ranks`` ``[rows]``."""
    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor

    def tolists(self) -> list[tuple[list[int], list[float], int]]:
        ids, lps, ranks = (t.tolist() for t in (self.logprob_token_ids, self.logprobs,
                                                 self.selected_token_ranks))
        return list(zip(ids, lps, ranks))


def batched_count_greater_than(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row, how many entries of ``x`` are >= ``values`` (the rank, 1 = the largest)."""
    return (x >= values).sum(-1)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int,
                    token_ids: torch.Tensor) -> LogprobsTensors:
    """The top ``num_logprobs`` (-1: all, in descending order) of each row and ``token_ids``'s own,
    first; ``token_ids`` ``[rows]`` int64."""
    k = logprobs.shape[-1] if num_logprobs == -1 else num_logprobs
    topk_logprobs, topk_indices = torch.topk(logprobs, k, dim=-1)
    token_ids = token_ids.long().unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = batched_count_greater_than(logprobs, token_logprobs)
    return LogprobsTensors(torch.cat((token_ids, topk_indices), dim=1).to(torch.int32),
                           torch.cat((token_logprobs, topk_logprobs), dim=1), ranks)
