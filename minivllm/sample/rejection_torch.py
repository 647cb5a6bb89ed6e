"""The rejection sampler's "torch" backend, beside rejection_sampler.py: the torch loop and vLLM
0.32's exponential race, with the same signatures as the ``*_triton`` launchers in
rejection_kernels.py. ``rejection_sampler._kernels`` imports it when a backend first runs: the
greedy loop serves every backend, the race both "torch" and "triton".

The torch loop writes its output as the article does (``accept_left_to_right``: per request, left
to right, stop at the first rejection), the loop each program of the Triton kernels runs. On a CPU
it is also the fast path: at batch 1-32 and k 1-5 the plain loop over Python lists takes 8-37 us, a
cumprod/scatter vectorisation 110-150 us.

Shapes as in rejection_kernels.py: ``output_token_ids`` ``[batch, max_spec_len + 1]`` int32,
pre-filled with -1 and written in place; ``draft_token_ids``, ``uniform_probs`` ``[num_tokens]``;
``draft_probs`` (or ``None`` for one-hot drafts) and ``target_probs`` ``[num_tokens, vocab]``.
"""
from __future__ import annotations

import torch

from minivllm.sample.sampler import exponential_noise


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


def rejection_greedy_sample_torch(output_token_ids, cu_num_draft_tokens, draft_token_ids,
                                  target_argmax, bonus_token_ids, is_greedy, max_spec_len) -> None:
    """Greedy rows: a draft is accepted iff it is the target's argmax; at the first mismatch the
    argmax is output instead (it counts as the recovered token)."""
    accepted = draft_token_ids.long() == target_argmax.long()
    accept_left_to_right(output_token_ids, is_greedy, cu_num_draft_tokens, draft_token_ids,
                         accepted, target_argmax, bonus_token_ids)


def rejection_random_sample_torch(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                  target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                                  is_greedy, max_spec_len) -> None:
    """Random rows: a draft is accepted iff ``u <= p_target / p_draft`` (``random_accept_mask``,
    evaluated for every draft at once: one draft's test does not depend on the others)."""
    accepted = random_accept_mask(draft_token_ids, draft_probs, target_probs, uniform_probs)
    accept_left_to_right(output_token_ids, ~is_greedy, cu_num_draft_tokens, draft_token_ids,
                         accepted, recovered_token_ids, bonus_token_ids)


def sample_recovered_tokens_torch(cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, q,
                                  max_spec_len) -> torch.Tensor:
    real = (draft_token_ids >= 0).unsqueeze(-1)
    idx = draft_token_ids.long().clamp(min=0).unsqueeze(-1)
    if draft_probs is None:
        prob = target_probs.scatter(-1, idx, 0.0)
    else:
        prob = (target_probs - draft_probs).clamp_min(0.0)
    # A placeholder drafted nothing: its recovered token is drawn from p_target itself.
    prob = torch.where(real, prob, target_probs)
    counts = torch.diff(cu_num_draft_tokens.long(), prepend=cu_num_draft_tokens.new_zeros(1).long())
    q_per_token = q.repeat_interleave(counts, dim=0, output_size=draft_token_ids.numel())
    return (prob / q_per_token).argmax(dim=-1).to(draft_token_ids.dtype)


def generate_recovery_noise(batch_size: int, vocab_size: int, num_draft_tokens: list[int],
                            generators: dict[int, torch.Generator], device) -> torch.Tensor:
    """``q`` ``[batch, vocab]`` float32 Exp(1): one row per request, shared by all its positions."""
    used = {i: g for i, g in generators.items() if num_draft_tokens[i] > 0}
    return exponential_noise((batch_size, vocab_size), used, device)


def race_random_sample(recover, random_sample, output_token_ids, num_draft_tokens,
                       cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                       bonus_token_ids, uniform_probs, is_greedy, generators) -> None:
    """Random rows as vLLM 0.32 samples them, so that the ids equal vLLM's from the same draws
    (conformance case d): every draft's recovered token is drawn up front by an exponential race,
    ``argmax(residual / q)`` with ``q ~ Exp(1)`` per request, which picks token ``t`` with
    probability ``residual(t) / sum(residual)``: the same distribution as the article's draw from
    ``normalize(max(p_target - p_draft, 0))`` (rejection_reference.py), without normalising.
    ``recover`` and ``random_sample``: the backend's ``sample_recovered_tokens_*`` and
    ``rejection_random_sample_*``."""
    max_spec_len = output_token_ids.shape[1] - 1
    q = generate_recovery_noise(len(num_draft_tokens), target_probs.shape[-1], num_draft_tokens,
                                generators, target_probs.device)
    recovered = recover(cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, q,
                        max_spec_len)
    random_sample(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                  bonus_token_ids, recovered, uniform_probs, is_greedy, max_spec_len)
