"""Probabilistic drafting's half in the model runner (vLLM 0.32's
``draft_sample_method="probabilistic"`` for "eagle", "eagle3" and "draft_model"), a mixin over the
article's ``ModelRunner``: the drafter samples each draft from its own distribution ``q``
(spec_decode/utils.py ``sample_draft_tokens``); the runner keeps each request's ``q`` and hands the
rows of the drafts it scheduled to the rejection sampler, which then accepts draft ``x`` with
probability ``min(1, p(x) / q(x))`` instead of treating it as certain (the article's one-hot drafts).
vLLM caches the draft probabilities the same way, per request, in gpu_model_runner.py.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from minivllm.spec_decode.metadata import SpecDecodeMetadata


class ProbabilisticDraftsMixin:
    """Overrides ``ModelRunner.propose_draft_token_ids`` (keeps the drafter's ``q``) and
    ``_scheduled_draft_probs`` (gives it to the rejection sampler)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._draft_probs: dict[str, torch.Tensor] = {}   # req_id -> [num_drafts, vocab]

    def propose_draft_token_ids(self, sampled_token_ids: list[list[int]], state: Any):
        drafts = super().propose_draft_token_ids(sampled_token_ids, state)
        self._draft_probs = dict(self.drafter.last_draft_probs)
        return drafts

    def _scheduled_draft_probs(self, spec_md: SpecDecodeMetadata) -> Optional[torch.Tensor]:
        """``draft_probs`` ``[num_draft_tokens, vocab]`` for the drafts scheduled this step, in
        batch order: the distributions they were sampled from, or ``None`` when there are none.
        The scheduler may have cut drafts, so a request uses the first rows of its cached ``q``; a
        draft without one (none cached) gets a one-hot row, which is what ``p_draft = 1`` means."""
        if not self._draft_probs:
            return None
        batch, rows = self.input_batch, []
        vocab = next(iter(self._draft_probs.values())).shape[-1]
        for i, req_id in enumerate(batch.req_ids):
            d = spec_md.num_draft_tokens[i]
            if not d:
                continue
            q = self._draft_probs.get(req_id)
            if q is None or q.shape[0] < d:
                ids = torch.tensor(batch.spec_token_ids[req_id][:d], device=self.device)
                q = torch.nn.functional.one_hot(ids.clamp(min=0), vocab).float()
            rows.append(q[:d])
        return torch.cat(rows).to(self.device)
