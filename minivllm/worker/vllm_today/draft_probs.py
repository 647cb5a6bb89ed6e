"""Probabilistic drafting's half in the model runner (vLLM 0.32's
``draft_sample_method="probabilistic"`` for "eagle", "eagle3" and "draft_model"), a mixin over the
article's ``ModelRunner``: it hands the drafter a ``ProbabilisticDraftSampler``, so each draft is
sampled from the drafter's own distribution ``q`` (vLLM 0.32's v1/spec_decode/llm_base_proposer.py)
instead of taken as the argmax; the runner keeps each request's ``q`` and hands the rows of the
drafts it scheduled to the rejection sampler, which then accepts draft ``x`` with probability
``min(1, p(x) / q(x))`` instead of treating it as certain (the article's one-hot drafts). vLLM
caches the draft probabilities the same way, per request, in gpu_model_runner.py.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.sampler import Sampler, compute_probs
from minivllm.spec_decode.base_proposer import DraftSampler
from minivllm.spec_decode.metadata import SpecDecodeMetadata


class ProbabilisticDraftSampler(DraftSampler):
    """Each draft row sampled from the drafter's own distribution at its request's temperature /
    top-k / top-p, with the request's generator (seeded requests stay reproducible); greedy
    requests still take the argmax."""

    def __call__(self, logits: torch.Tensor, batch: Any, rows: np.ndarray,
                 drafting_rows: Optional[set[int]] = None,
                 ) -> tuple[np.ndarray, Optional[torch.Tensor]]:
        """Draft ids ``[m]`` and their distributions ``[m, vocab]`` float32 from ``logits`` ``[m,
        vocab]``; only rows in ``drafting_rows`` draw from their generator."""
        params = [batch.sampling_params[batch.req_ids[r]] for r in rows]
        gens = {i: batch.generators[r] for i, r in enumerate(rows)
                if r in batch.generators and (drafting_rows is None or r in drafting_rows)}
        sm = SamplingMetadata.from_params(params, gens, logits.device)
        sm.min_tokens = {}   # drafts are verified against the masked target; q stays the drafter's
        probs = compute_probs(logits, sm)
        ids = Sampler()(logits, sm)
        return ids.cpu().numpy(), probs


class ProbabilisticDraftsMixin:
    """Overrides ``ModelRunner.__init__`` (hands the drafter its sampler),
    ``propose_draft_token_ids`` (keeps the drafter's ``q``) and ``_scheduled_draft_probs`` (gives
    it to the rejection sampler)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drafter.draft_sampler = ProbabilisticDraftSampler()
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
