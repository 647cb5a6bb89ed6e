"""The rejection sampler's "torch" backend, ``TorchRejectionBackend``: the kernels of
vllm/v1/sample/rejection_sampler.py as torch loops (article step 7, "accept/reject left to right"),
so that its ids equal vLLM 0.32's from the same draws. It overrides the two paths of
``ReferenceRejectionBackend`` (rejection_reference.py) and keeps its expansion.

The torch loop writes its output as the article does (``accept_left_to_right``: per request, left
to right, stop at the first rejection), the loop each program of the Triton kernels runs. On a CPU
it is also the fast path: at batch 1-32 and k 1-5 the plain loop over Python lists takes 8-37 us, a
cumprod/scatter vectorisation 110-150 us.

Shapes: ``output_token_ids`` ``[batch, max_spec_len + 1]`` int32, pre-filled with -1 and written in
place; ``draft_token_ids``, ``uniform_probs`` ``[num_tokens]``; ``draft_probs`` (or ``None`` for
one-hot drafts) and ``target_probs`` ``[num_tokens, vocab]``; ``cu_num_draft_tokens`` ``[batch]``
inclusive cumsum.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from minivllm.sample.rejection_reference import ReferenceRejectionBackend
from minivllm.sample.sampler import exponential_noise

if TYPE_CHECKING:   # annotations only
    from minivllm.spec_decode.metadata import SpecDecodeMetadata


def random_accept_mask(draft_token_ids, draft_probs, target_probs, uniform_probs) -> torch.Tensor:
    """Per draft token: does it pass ``p_d > 0 and p_t / p_d >= u`` (float32 ratio, float64 compare)?
    A -1 placeholder never passes. (verify_record.py records the same decisions.)"""
    real = draft_token_ids >= 0
    idx = draft_token_ids.long().clamp(min=0).unsqueeze(-1)
    p_target = target_probs.gather(-1, idx).squeeze(-1)
    if draft_probs is None:
        return real & (p_target >= uniform_probs)
    p_draft = draft_probs.gather(-1, idx).squeeze(-1)
    return real & (p_draft > 0) & (p_target / p_draft >= uniform_probs)


def accept_left_to_right(output_token_ids, rows, cu_num_draft_tokens, draft_token_ids, accepted,
                         recovered_token_ids, bonus_token_ids) -> None:
    """Article step "accept/reject left to right", one request at a time (what one program of
    ``rejection_*_sample_kernel`` does).

    For each request in ``rows`` ([batch] bool), go over its drafts left to right: while
    ``accepted[token]`` holds, the draft is output; at the first rejection the recovered token is
    output there and the request stops; when nothing was rejected, the bonus token follows the last
    draft. Every other slot keeps ``PLACEHOLDER_TOKEN_ID``.

    ``accepted``, ``draft_token_ids``, ``recovered_token_ids``: ``[num_tokens]``;
    ``output_token_ids`` ``[batch, max_spec_len + 1]`` int32, written in place.
    """
    # Plain Python lists: reading a tensor element by element costs microseconds each.
    out = output_token_ids.tolist()
    rows, cu, drafts, accepted, recovered, bonus = (t.tolist() for t in (
        rows, cu_num_draft_tokens, draft_token_ids, accepted, recovered_token_ids,
        bonus_token_ids.view(-1)))
    start_idx = 0
    for req_idx, end_idx in enumerate(cu):
        if rows[req_idx]:
            row = out[req_idx]
            for pos, token_idx in enumerate(range(start_idx, end_idx)):
                if not accepted[token_idx]:
                    row[pos] = recovered[token_idx]
                    break
                row[pos] = drafts[token_idx]
            else:
                row[end_idx - start_idx] = bonus[req_idx]
        start_idx = end_idx
    output_token_ids.copy_(torch.tensor(out, dtype=torch.int32, device=output_token_ids.device)
                           .view(output_token_ids.shape))


def rejection_random_sample_torch(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                  target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                                  is_greedy) -> None:
    """vLLM's ``rejection_random_sample_kernel``: on the random rows a draft is accepted iff
    ``u <= p_target / p_draft`` (``random_accept_mask``, evaluated for every draft at once: one
    draft's test does not depend on the others); at the first rejection its recovered token
    (``recovered_token_ids`` ``[num_tokens]``) is output."""
    accepted = random_accept_mask(draft_token_ids, draft_probs, target_probs, uniform_probs)
    accept_left_to_right(output_token_ids, ~is_greedy, cu_num_draft_tokens, draft_token_ids,
                         accepted, recovered_token_ids, bonus_token_ids)


def sample_recovered_tokens_torch(draft_token_ids: torch.Tensor, draft_probs: Optional[torch.Tensor],
                                  target_probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """vLLM's ``sample_recovered_tokens_kernel``: each draft's recovered token ``[num_tokens]``,
    ``argmax(residual / q)`` over the residual ``max(p_target - p_draft, 0)`` (one-hot drafts:
    ``p_target`` without the draft). ``q`` ``[num_tokens, vocab]``: each draft's Exp(1) noise, its
    request's row repeated (``expand_batch_to_tokens``)."""
    real = (draft_token_ids >= 0).unsqueeze(-1)
    idx = draft_token_ids.long().clamp(min=0).unsqueeze(-1)
    if draft_probs is None:
        prob = target_probs.scatter(-1, idx, 0.0)
    else:
        prob = (target_probs - draft_probs).clamp_min(0.0)
    # A placeholder drafted nothing: its recovered token is drawn from p_target itself.
    prob = torch.where(real, prob, target_probs)
    return (prob / q).argmax(dim=-1).to(draft_token_ids.dtype)


def generate_recovery_noise(batch_size: int, vocab_size: int, num_draft_tokens: list[int],
                            generators: dict[int, torch.Generator], device) -> torch.Tensor:
    """``q`` ``[batch, vocab]`` float32 Exp(1): one row per request, shared by all its positions."""
    used = {i: g for i, g in generators.items() if num_draft_tokens[i] > 0}
    return exponential_noise((batch_size, vocab_size), used, device)


class TorchRejectionBackend(ReferenceRejectionBackend):
    """``"torch"``: the batch as vLLM's kernels take it, one loop over Python lists."""

    @staticmethod
    def rejection_greedy_sample(*, output_token_ids: torch.Tensor, metadata: SpecDecodeMetadata,
                                target_argmax: torch.Tensor, bonus_token_ids: torch.Tensor,
                                is_greedy: torch.Tensor) -> None:
        """vLLM's ``rejection_greedy_sample_kernel``: on the greedy rows a draft is accepted iff it
        is the target's argmax; at the first mismatch the argmax is output instead (it counts as
        the recovered token)."""
        accepted = metadata.draft_token_ids.long() == target_argmax.long()
        accept_left_to_right(output_token_ids, is_greedy, metadata.cu_num_draft_tokens,
                             metadata.draft_token_ids, accepted, target_argmax, bonus_token_ids)

    @staticmethod
    def rejection_random_sample(*, output_token_ids: torch.Tensor, metadata: SpecDecodeMetadata,
                                draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                                bonus_token_ids: torch.Tensor, uniform_probs: torch.Tensor,
                                is_greedy: torch.Tensor,
                                generators: dict[int, torch.Generator]) -> None:
        """The random rows as vLLM 0.32 samples them, so that the ids equal vLLM's from the same
        draws (conformance case d): every draft's recovered token is drawn up front by an
        exponential race, ``argmax(residual / q)`` with ``q ~ Exp(1)`` per request, which picks
        token ``t`` with probability ``residual(t) / sum(residual)``: the same distribution as the
        article's draw from ``normalize(max(p_target - p_draft, 0))`` (rejection_reference.py),
        without normalising. Then the drafts are accepted left to right."""
        num_draft_tokens = metadata.num_draft_tokens
        q = generate_recovery_noise(len(num_draft_tokens), target_probs.shape[-1], num_draft_tokens,
                                    generators, target_probs.device)
        recovered_token_ids = sample_recovered_tokens_torch(
            draft_token_ids=metadata.draft_token_ids, draft_probs=draft_probs,
            target_probs=target_probs,
            q=ReferenceRejectionBackend.expand_batch_to_tokens(q, metadata))
        rejection_random_sample_torch(
            output_token_ids=output_token_ids, cu_num_draft_tokens=metadata.cu_num_draft_tokens,
            draft_token_ids=metadata.draft_token_ids, draft_probs=draft_probs,
            target_probs=target_probs, bonus_token_ids=bonus_token_ids,
            recovered_token_ids=recovered_token_ids, uniform_probs=uniform_probs,
            is_greedy=is_greedy)
