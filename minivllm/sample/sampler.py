"""The ordinary sampler, mirroring vllm/v1/sample/sampler.py (and ops/topk_topp_sampler.py).

``Sampler()(logits [num_reqs, vocab] float32, sampling_metadata) -> [num_reqs] int64``, in vLLM
0.32's order (``Sampler.forward``'s docstring there):

1. the logprobs to return, when ``logprobs_mode`` is ``raw_*`` (``compute_logprobs``; here they are
   taken after the draw, from the same logits: the processors never write into them);
2. ``apply_logits_processors``: the allowed-token mask (``allowed_token_ids_mask``), bad words
   (``ops/bad_words.apply_bad_words``), ``min_tokens`` (``MinTokensLogitsProcessor``), logit bias
   (``LogitBiasLogitsProcessor``), then the penalties (``ops/penalties.apply_all_penalties``);
3. ``sample``: greedy rows take the argmax (first index on ties); random rows are divided by their
   temperature (``apply_temperature``), then min_p (``MinPLogitsProcessor``, ops/builtin.py), top-k
   and top-p (``apply_top_k_top_p``), and drawn from the softmax;
4. the logprobs, ``processed_*`` taken from the logits the token was drawn from.

The draw is the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)`` per vocabulary entry, which
picks token x with probability ``p(x) / sum(p)``: ``q(x) / p(x)`` is Exp(p(x)), and the smallest of
independent exponentials is x with probability proportional to its rate. It needs no cumulative sum
and no normalisation, and a seeded row can draw its own ``q`` with its own generator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from minivllm.sample.metadata import SamplingMetadata
from minivllm.sampling_params import check_logprobs_mode

_SAMPLING_EPS = 1e-5
# An Exp(1) draw of exactly 0 would turn a masked (probability 0) entry into 0 / 0 = NaN, which argmax
# would pick; clamping to the smallest normal float changes nothing else.
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SamplerOutput:
    """vLLM's ``SamplerOutput`` (vllm/v1/outputs.py): ``sampled_token_ids`` ``[rows]`` int64;
    ``logprobs`` ``[rows, vocab]``: what ``logprobs_mode`` names for each row (``None`` when no row
    asked for logprobs), gathered later per request (``ops/logprobs.gather_logprobs``)."""
    sampled_token_ids: torch.Tensor
    logprobs: Optional[torch.Tensor] = None


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


def process_logits(logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, min_p, top-k and top-p of each row (``logits`` float32 ``[n, vocab]``); all-greedy
    batches are returned as they are. Greedy rows inside a mixed batch have temperature 0, treated
    as 1, and no min_p/top-k/top-p (SamplingParams resets them)."""
    if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
        return logits
    logits = apply_temperature(logits, sampling_metadata.temperature)
    if sampling_metadata.min_p is not None:   # vLLM's MinPLogitsProcessor (ops/builtin.py)
        from minivllm.sample.ops.builtin import apply_min_p
        logits = apply_min_p(logits, sampling_metadata.min_p)
    return apply_top_k_top_p(logits, sampling_metadata.top_k, sampling_metadata.top_p)


def compute_probs(logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
    """Probabilities [n, vocab] float32 of what ``Sampler`` draws from: the logits processors, then
    temperature, min_p, top-k and top-p of each row."""
    logits = apply_logits_processors(logits.float(), sampling_metadata)
    return process_logits(logits, sampling_metadata).softmax(dim=-1, dtype=torch.float32)


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata,
                            num_draft_tokens: Optional[list[int]] = None) -> torch.Tensor:
    """vLLM 0.32's logits processors (``ops/processors.py``) on float32 ``logits`` ``[n, vocab]``,
    when any row asked for one; the article's sampler needs none. With ``num_draft_tokens`` the rows
    are bonus rows (their drafts count as outputs)."""
    if not md.needs_logits_processors:
        return logits
    from minivllm.sample.ops import processors
    return processors.apply_logits_processors(logits, md, num_draft_tokens)


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
    """``forward(logits [num_reqs, vocab], sampling_metadata) -> [num_reqs]`` int64 sampled ids;
    ``sample_output`` also gives the logprobs ``logprobs_mode`` names.

    ``num_draft_tokens`` (bonus rows after verification): request i's row predicts output position
    ``num_output_tokens + num_draft_tokens[i]``, which is what ``min_tokens`` masks by, and its
    drafts count as outputs for penalties and bad words."""

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        super().__init__()
        self.logprobs_mode = check_logprobs_mode(logprobs_mode)

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata,
                num_draft_tokens: Optional[list[int]] = None) -> torch.Tensor:
        return self.sample_output(logits, sampling_metadata, num_draft_tokens).sampled_token_ids

    def sample_output(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata,
                      num_draft_tokens: Optional[list[int]] = None,
                      logprobs_mode: Optional[str] = None) -> SamplerOutput:
        """vLLM's ``Sampler.forward``: steps 2 and 3 of the module docstring, then, when a row
        asked for logprobs, steps 1 and 4 (the raw ones after the draw: the logits processors never
        write into ``logits``)."""
        processed = apply_logits_processors(logits.float(), sampling_metadata, num_draft_tokens)
        sampled, processed = self.sample(processed, sampling_metadata)
        if sampling_metadata.max_num_logprobs is None:
            return SamplerOutput(sampled)
        from minivllm.sample.ops.logprobs import logprobs_to_return   # vLLM 0.32's (ops/logprobs.py)
        mode = logprobs_mode or self.logprobs_mode
        return SamplerOutput(sampled, logprobs_to_return(logits, processed, mode))

    @staticmethod
    def sample(logits: torch.Tensor,
               sampling_metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the sampled ids ``[n]`` and the processed logits they were drawn from."""
        greedy = None if sampling_metadata.all_random else logits.argmax(dim=-1)
        if sampling_metadata.all_greedy:
            return greedy, logits
        processed = process_logits(logits, sampling_metadata)
        probs = processed.softmax(dim=-1, dtype=torch.float32)
        sampled = random_sample(probs, sampling_metadata.generators)
        if greedy is None:
            return sampled, processed
        is_greedy = sampling_metadata.temperature < _SAMPLING_EPS
        return torch.where(is_greedy, greedy, sampled), processed
