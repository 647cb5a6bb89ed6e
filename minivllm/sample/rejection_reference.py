"""The article's accept/reject rule for one request, written as the article says it (article step
7; Leviathan et al. 2023, the same rule as gpt-fast's ``speculative_decode``): the readable
reference for ``rejection_sampler.py``.

Left to right over the drafts: draft ``x`` at position ``j`` is accepted while
``p_target(x) >= p_draft(x)``, or else with probability ``p_target(x) / p_draft(x)``
(``u < p_target(x) / p_draft(x)``, ``u ~ U[0, 1)``). At the first rejection the recovered token is
drawn from the residual ``normalize(max(p_target - p_draft, 0))`` and the request stops there; if
every draft passed, the bonus token is drawn from ``p_target`` after the last draft. Each emitted
token is then distributed exactly as the target model's.

``RejectionSampler`` computes the same rule for a whole batch, with its random draws made once
(``generate_uniform_probs``, ``generate_recovery_noise``), so that its ids equal vLLM 0.32's from
the same draws; there the residual is sampled by an exponential race, ``argmax(residual / q)``
with ``q ~ Exp(1)``, which picks token ``t`` with probability ``residual(t) / sum(residual)``:
the same distribution as ``torch.multinomial`` on the normalised residual here
(tests/test_rejection_article_rule.py checks the two agree).
"""
from __future__ import annotations

from typing import Optional

import torch


def rejection_sample_one(draft_token_ids: list[int], draft_probs: Optional[torch.Tensor],
                         target_probs: torch.Tensor,
                         generator: Optional[torch.Generator] = None) -> list[int]:
    """One request's verify step. ``draft_token_ids``: its k drafts; ``draft_probs``: ``[k, vocab]``
    the drafter's distributions, or ``None`` for one-hot drafts (n-gram: ``p_draft(x) = 1``);
    ``target_probs``: ``[k + 1, vocab]``, row j the target's distribution at draft j's position,
    row k the one after the last draft. -> the accepted drafts, then one recovered or bonus token."""
    for j, x in enumerate(draft_token_ids):
        p_draft = torch.zeros_like(target_probs[j]).index_fill_(0, torch.tensor(x), 1.0) \
            if draft_probs is None else draft_probs[j]
        p_target_x, p_draft_x = target_probs[j, x].item(), p_draft[x].item()
        u = torch.rand((), generator=generator, dtype=torch.float64).item()
        if p_target_x >= p_draft_x or u < p_target_x / p_draft_x:
            continue                                           # accepted: on to the next draft
        residual = (target_probs[j] - p_draft).clamp_min(0.0)
        recovered = torch.multinomial(residual / residual.sum(), 1, generator=generator)
        return draft_token_ids[:j] + [int(recovered)]
    bonus = torch.multinomial(target_probs[len(draft_token_ids)], 1, generator=generator)
    return list(draft_token_ids) + [int(bonus)]
