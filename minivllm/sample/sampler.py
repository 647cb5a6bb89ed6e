"""The ordinary sampler, mirroring vllm/v1/sample/sampler.py (and ops/topk_topp_sampler.py).

``Sampler()(logits [num_reqs, vocab] float32, sampling_metadata) -> [num_reqs] int64``:
greedy rows take the argmax (first index on ties); random rows divide by their temperature, apply
top-k then top-p (vLLM's order), take the softmax and sample with the exponential race
``argmax(probs / q)``, ``q ~ Exp(1)`` per vocabulary entry. ``argmax(p / q)`` picks token x with
probability ``p(x) / sum(p)``: ``q(x) / p(x)`` is Exp(p(x)), and the smallest of independent
exponentials is x with probability proportional to its rate. It needs no cumulative sum and no
normalisation, and a seeded row can draw its own ``q`` with its own generator.

``apply_top_k_top_p`` and ``compute_probs`` are reused by the rejection sampler on per-token rows.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from minivllm.sample.logits_processor import apply_min_tokens
from minivllm.sample.metadata import SamplingMetadata

_SAMPLING_EPS = 1e-5
# An Exp(1) draw of exactly 0 would turn a masked (probability 0) entry into 0 / 0 = NaN, which argmax
# would pick; clamping to the smallest normal float changes nothing else.
_TINY = torch.finfo(torch.float32).tiny


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits [n, vocab] / temperature [n]``; rows with temperature 0 (greedy) are divided by 1."""
    temperature = torch.where(temperature < _SAMPLING_EPS, torch.ones_like(temperature), temperature)
    return logits / temperature.unsqueeze(-1).to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, k: Optional[torch.Tensor],
                      p: Optional[torch.Tensor]) -> torch.Tensor:
    """Mask logits [n, vocab] to -inf outside each row's top-k, then outside its top-p nucleus.

    ``k`` [n] int (0 = off), ``p`` [n] float (1.0 = off), either may be ``None``. As in vLLM, tokens tied
    with the k-th largest logit stay, and top-p keeps the smallest set of most likely tokens whose mass
    reaches p (at least one token), measured after top-k. Returns a new tensor.
    """
    if k is None and p is None:
        return logits
    vocab = logits.shape[-1]
    # Ascending order: the tokens to drop are a prefix of every row.
    logits_sort, order = logits.sort(dim=-1, descending=False)
    if k is not None:
        k = torch.where(k <= 0, torch.full_like(k, vocab), k).clamp(max=vocab).long()
        kth_largest = logits_sort.gather(-1, (vocab - k).unsqueeze(-1))
        logits_sort = logits_sort.masked_fill(logits_sort < kth_largest, float("-inf"))
    if p is not None:
        cum_probs = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        # Drop the least likely tokens while what they add up to stays within 1 - p.
        drop = cum_probs <= 1 - p.to(cum_probs.dtype).unsqueeze(-1)
        drop[:, -1] = False
        logits_sort = logits_sort.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, logits_sort)


def compute_probs(logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
    """Probabilities [n, vocab] float32 after temperature, top-k and top-p of each row.

    All-greedy batches get the plain softmax (their temperature is ``None``); greedy rows inside a
    mixed batch have temperature 0, treated as 1, and no top-k/top-p (SamplingParams resets them).
    """
    logits = logits.float()
    if not sampling_metadata.all_greedy and sampling_metadata.temperature is not None:
        logits = apply_temperature(logits, sampling_metadata.temperature)
        logits = apply_top_k_top_p(logits, sampling_metadata.top_k, sampling_metadata.top_p)
    return logits.softmax(dim=-1, dtype=torch.float32)


def exponential_noise(shape: tuple[int, int], generators: dict[int, torch.Generator],
                      device: torch.device) -> torch.Tensor:
    """``q ~ Exp(1)`` of ``shape`` [rows, vocab] float32; rows in ``generators`` redraw with their own."""
    q = torch.empty(shape, dtype=torch.float32, device=device)
    if len(generators) != shape[0]:
        q.exponential_()
    for i, generator in generators.items():
        q[i].exponential_(generator=generator)
    return q.clamp_min_(_TINY)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` [n, vocab] by the exponential race ``argmax(probs / q)``."""
    q = exponential_noise(tuple(probs.shape), generators, probs.device)
    return (probs / q).argmax(dim=-1)


class Sampler(nn.Module):
    """``forward(logits [num_reqs, vocab], sampling_metadata) -> [num_reqs]`` int64 sampled ids.

    ``num_draft_tokens`` (bonus rows after verification): request i's row predicts output position
    ``num_output_tokens + num_draft_tokens[i]``, which is what ``min_tokens`` masks by."""

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata,
                num_draft_tokens: Optional[list[int]] = None) -> torch.Tensor:
        logits = apply_min_tokens(logits.float(), sampling_metadata, num_draft_tokens,
                                  bonus=num_draft_tokens is not None)
        greedy = None if sampling_metadata.all_random else logits.argmax(dim=-1)
        if sampling_metadata.all_greedy:
            return greedy
        probs = compute_probs(logits, sampling_metadata)
        sampled = random_sample(probs, sampling_metadata.generators)
        if greedy is None:
            return sampled
        is_greedy = sampling_metadata.temperature < _SAMPLING_EPS
        return torch.where(is_greedy, greedy, sampled)

