"""The rejection sampler's "block" backend, ``BlockRejectionBackend``: block verification for a
batch (Sun et al. 2024; article step 7's variant, vLLM 0.32's
``speculative_config={"rejection_sample_method": "block"}``, the Triton kernel's
``USE_BLOCK_VERIFICATION`` path in ``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py``).
It overrides the random path of the "torch" backend (rejection_torch.py) and keeps its greedy loop
(a greedy draft is kept iff it is the argmax, under either rule, as in vLLM).

The rule, one request at a time, is ``rejection_reference.block_verify`` (its docstring works an
example by hand). Here the same quantities for every draft of the batch at once:

- ``joint_ratio`` ``[num_tokens]``: ``p_i = min(p_{i-1} * p_target(x_i) / p_draft(x_i), 1)``,
  ``p_0 = 1``, per request (a draft with ``p_draft(x) = 0`` could not have been drawn: ``p_i = 0``).
- ``thresholds`` ``[num_tokens]``: ``h_i = m_i / (m_i + 1 - p_i)`` with the residual mass
  ``m_i = sum_v max(p_i * p_target(v | x_<=i) - p_draft(v | x_<=i), 0)`` of the next position, or
  ``h_i = p_i`` at the last draft (and before a -1 placeholder, which ends the block).
- the kept length ``tau``: the last ``i`` with ``u_i <= h_i`` (0 if none); then the bonus token if
  every draft was kept, else one token from ``max(p_tau * p_target - p_draft, 0)`` at position tau
  (one-hot drafts: ``p_target`` without the draft there; a placeholder: ``p_target`` itself),
  drawn by the exponential race with the request's own noise row, as the "torch" backend draws.

For one-hot drafts (n-gram, suffix, greedy drafters) ``m_i = p_i * (1 - p_target(x_{i+1}))`` and the
kept length has the token-wise rule's distribution exactly: ``P(tau >= i) = p_i`` under both (the
largest any rule can give a fixed draft), so block verification gains nothing there, and loses
nothing. The gain comes with drafts sampled from a real ``q`` (``draft_sample_method=
"probabilistic"``): a draft that the target likes less than the drafter can be made up for by the
next ones.

Where this differs from vLLM's kernel (read for the details, not run here: the vLLM CPU build has
no Triton backend): vLLM works in log space on logits (``cumulative_log_p``, log-sum-exp per vocab
block of 8192) and draws ``u`` and the recovered token from a counter-based Philox stream seeded by
(seed, position) with a Gumbel argmax; this works on the probabilities the rejection sampler already
made (``softmax`` after temperature, top-k/top-p and min_p) and draws ``u`` from the shared torch
uniforms (``generate_uniform_probs``) and the recovered token by the exponential race, so ids
equal vLLM's in distribution, not draw for draw. vLLM also applies the draft's temperature to
cached draft logits; here ``draft_probs`` arrive as the drafter's final distribution.

Shapes as in rejection_torch.py: ``output_token_ids`` ``[batch, max_spec_len + 1]`` int32 written
in place; ``draft_token_ids``, ``uniform_probs`` ``[num_tokens]``; ``draft_probs`` (``None`` for
one-hot drafts) and ``target_probs`` ``[num_tokens, vocab]``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from minivllm.sample.rejection_torch import TorchRejectionBackend, generate_recovery_noise

if TYPE_CHECKING:   # annotations only
    from minivllm.spec_decode.metadata import SpecDecodeMetadata


def joint_ratios_and_thresholds(num_draft_tokens: list[int], draft_token_ids: torch.Tensor,
                                draft_probs: Optional[torch.Tensor],
                                target_probs: torch.Tensor) -> tuple[list[float], list[float]]:
    """``(p, h)``, each ``[num_tokens]`` as lists: every draft's joint ratio ``p_i`` and its
    acceptance threshold ``h_i`` (see the module docstring). A placeholder's entries are 0."""
    drafts = draft_token_ids.tolist()
    idx = draft_token_ids.long().clamp(min=0).unsqueeze(-1)
    p_target_x = target_probs.gather(-1, idx).squeeze(-1).tolist()
    p_draft_x = [1.0] * len(drafts) if draft_probs is None else \
        draft_probs.gather(-1, idx).squeeze(-1).tolist()
    p, has_next, start = [0.0] * len(drafts), [False] * len(drafts), 0
    for n in num_draft_tokens:
        prefix = 1.0
        for t in range(start, start + n):
            if drafts[t] < 0:
                break
            prefix = min(prefix * p_target_x[t] / p_draft_x[t], 1.0) if p_draft_x[t] > 0 else 0.0
            p[t] = prefix
            has_next[t] = t + 1 < start + n and drafts[t + 1] >= 0
        start += n
    rows = [t for t, nxt in enumerate(has_next) if nxt]
    h = list(p)
    if rows:
        nxt = torch.tensor(rows, device=target_probs.device) + 1
        p_rows = torch.tensor([p[t] for t in rows], dtype=target_probs.dtype,
                              device=target_probs.device)
        if draft_probs is None:   # a one-hot q: the mass has a closed form
            mass = p_rows * (1.0 - target_probs[nxt].gather(-1, idx[nxt]).squeeze(-1))
        else:
            mass = (p_rows.unsqueeze(-1) * target_probs[nxt] - draft_probs[nxt]).clamp_min(0.0).sum(-1)
        denom = mass + 1.0 - p_rows
        h_rows = torch.where(denom > 0, mass / denom.clamp_min(1e-30), torch.ones_like(mass))
        for t, value in zip(rows, h_rows.tolist()):
            h[t] = value
    return p, h


def block_residual(target_rows: torch.Tensor, draft_rows: Optional[torch.Tensor],
                   draft_token_ids: torch.Tensor, prefix_ratios: torch.Tensor) -> torch.Tensor:
    """``[n, vocab]`` the unnormalised residual at each request's first position not kept:
    ``max(p_tau * p_target - p_draft, 0)``; for one-hot drafts ``p_target`` without the draft
    (``p_tau`` cancels when normalised); at a placeholder ``p_target`` itself. ``target_rows``,
    ``draft_rows`` (``None``: one-hot) ``[n, vocab]``; ``draft_token_ids``, ``prefix_ratios``
    ``[n]``."""
    real = (draft_token_ids >= 0).unsqueeze(-1)
    if draft_rows is None:
        residual = target_rows.scatter(-1, draft_token_ids.long().clamp(min=0).unsqueeze(-1), 0.0)
    else:
        residual = (prefix_ratios.unsqueeze(-1) * target_rows - draft_rows).clamp_min(0.0)
    return torch.where(real, residual, target_rows)


class BlockRejectionBackend(TorchRejectionBackend):
    """``"block"``: the random rows by block verification; the greedy rows as "torch" keeps them."""

    @staticmethod
    def rejection_random_sample(*, output_token_ids: torch.Tensor, metadata: SpecDecodeMetadata,
                                draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                                bonus_token_ids: torch.Tensor, uniform_probs: torch.Tensor,
                                is_greedy: torch.Tensor,
                                generators: dict[int, torch.Generator]) -> None:
        """The random rows of a batch by block verification: per request the longest prefix
        whose draw passes its threshold, then the bonus or one token from the residual after it,
        drawn by the exponential race with the request's own noise row (``generators``)."""
        num_draft_tokens = metadata.num_draft_tokens
        p, h = joint_ratios_and_thresholds(num_draft_tokens, metadata.draft_token_ids, draft_probs,
                                           target_probs)
        drafts, u = metadata.draft_token_ids.tolist(), uniform_probs.tolist()
        greedy, bonus = is_greedy.tolist(), bonus_token_ids.view(-1).tolist()
        out = output_token_ids.tolist()
        recover_reqs, recover_taus, recover_rows, recover_ratios = [], [], [], []
        start = 0
        for i, n in enumerate(num_draft_tokens):
            if not greedy[i]:
                tau = 0
                for j in range(n):
                    if drafts[start + j] < 0:
                        break
                    if u[start + j] <= h[start + j]:
                        tau = j + 1                      # the last passing prefix is kept
                out[i][:tau] = drafts[start:start + tau]
                if tau == n:
                    out[i][tau] = bonus[i]
                else:
                    recover_reqs.append(i)
                    recover_taus.append(tau)
                    recover_rows.append(start + tau)
                    recover_ratios.append(1.0 if tau == 0 else p[start + tau - 1])
            start += n
        if recover_reqs:
            device = target_probs.device
            q = generate_recovery_noise(len(num_draft_tokens), target_probs.shape[-1],
                                        num_draft_tokens, generators, device)
            rows = torch.tensor(recover_rows, device=device)
            residual = block_residual(
                target_probs[rows], None if draft_probs is None else draft_probs[rows],
                metadata.draft_token_ids[rows],
                torch.tensor(recover_ratios, dtype=target_probs.dtype, device=device))
            recovered = (residual / q[recover_reqs]).argmax(-1).tolist()
            for i, tau, token in zip(recover_reqs, recover_taus, recovered):
                out[i][tau] = token
        output_token_ids.copy_(torch.tensor(out, dtype=torch.int32, device=output_token_ids.device))
