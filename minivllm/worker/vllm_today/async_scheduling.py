"""The model runner's half of asynchronous scheduling (``LLM(..., async_scheduling=True)``), a
mixin over the article's ``ModelRunner`` (``AsyncSchedulingMixin``).

With vLLM 0.32's ``AsyncScheduler`` (vllm/v1/core/sched/async_scheduler.py) the scheduler sends
``[-1] * n`` placeholders in ``scheduled_spec_decode_tokens``; the model runner keeps its own last
proposals and writes them over the placeholders in the next step's input, as
vllm/v1/worker/gpu_model_runner.py scatters ``self._draft_token_ids`` into ``input_ids``
(``_prepare_input_ids``). Placeholders the worker has no draft for (the drafter proposed fewer than
k, or none) stay -1.

A -1 is rejected: the request keeps only the tokens before it. The rejection sampler rejects it itself
(``sample/rejection_sampler.py``), but the runner verifies only the real drafts
(``drop_placeholder_drafts``): the rows sampled then equal what the synchronous flow samples, the same
random draws included, so seeded outputs are identical too. The scheduler still counts every
placeholder as a drafted (and rejected) token, as vLLM's spec metrics do.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from minivllm import trace
from minivllm.spec_decode.metadata import SpecDecodeMetadata

PLACEHOLDER_DRAFT_ID = -1


def substitute_drafts(scheduled: Sequence[int], proposed: Sequence[int]) -> list[int]:
    """The drafts to feed: ``proposed`` over the scheduled placeholders, -1 where none is left.

    ``scheduled`` may be shorter than k (the token budget or ``max_model_len`` cut it), ``proposed``
    shorter than ``scheduled`` (the drafter found fewer)."""
    real = list(proposed)[:len(scheduled)]
    return real + [PLACEHOLDER_DRAFT_ID] * (len(scheduled) - len(real))


def num_real_drafts(drafts: Sequence[int]) -> int:
    """Leading drafts that are not placeholders (a -1 is rejected, so nothing after it counts)."""
    for j, t in enumerate(drafts):
        if t < 0:
            return j
    return len(drafts)


def drop_placeholder_drafts(spec_md: SpecDecodeMetadata, logits: torch.Tensor,
                            num_real: Sequence[int]) -> tuple[Optional[SpecDecodeMetadata], torch.Tensor]:
    """Verify only each request's first ``num_real[i]`` drafts.

    ``logits`` ``[sum(num_draft_tokens) + batch, vocab]`` are the rows of ``spec_md.logits_indices``
    (per request ``num_draft_tokens[i] + 1`` rows, the last token's and one per draft). Returns the
    metadata for ``num_real`` drafts and its ``[sum(num_real) + batch, vocab]`` logits: per request the
    rows up to its first placeholder, the bonus taken there. ``None`` when no request has a real draft
    (then plain sampling of one row each, exactly as without drafts)."""
    num_draft = np.asarray(spec_md.num_draft_tokens, dtype=np.int64)
    num_real = np.asarray(num_real, dtype=np.int64)
    starts = np.cumsum(num_draft + 1) - (num_draft + 1)
    rows = np.concatenate([np.arange(s, s + r + 1) for s, r in zip(starts, num_real)])
    dev = logits.device
    rows_t = torch.from_numpy(rows).to(dev)
    logits = logits[rows_t]
    if not num_real.any():
        return None, logits
    cu_sampled = np.cumsum(num_real + 1)
    first = cu_sampled - (num_real + 1)
    keep = np.concatenate([np.arange(s, s + r) for s, r in
                           zip(np.cumsum(num_draft) - num_draft, num_real)]).astype(np.int64)
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64)).to(dev)  # noqa: E731
    return SpecDecodeMetadata(
        draft_token_ids=spec_md.draft_token_ids[t(keep)],
        num_draft_tokens=num_real.tolist(),
        cu_num_draft_tokens=t(np.cumsum(num_real)).to(torch.int32),
        cu_num_sampled_tokens=t(cu_sampled).to(torch.int32),
        target_logits_indices=t(np.concatenate(
            [np.arange(f, f + r) for f, r in zip(first, num_real)])),
        bonus_logits_indices=t(cu_sampled - 1),
        logits_indices=spec_md.logits_indices[rows_t],
        max_spec_len=int(num_real.max())), logits


class AsyncSchedulingMixin:
    """Overrides ``ModelRunner._update_states`` (the placeholders replaced by the runner's own
    drafts), ``_rejection_sample`` (only the real drafts verified) and
    ``propose_draft_token_ids`` (the drafts stay here: ``take_draft_token_ids`` gives ``None``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._req_draft_token_ids: dict[str, list[int]] = {}   # req_id -> last proposals

    def _update_states(self, so: Any) -> None:
        for req_id in so.finished_req_ids:
            self._req_draft_token_ids.pop(req_id, None)
        super()._update_states(so)
        batch = self.input_batch
        for req_id, drafts in list(batch.spec_token_ids.items()):
            if not drafts or req_id not in batch.req_id_to_index:
                continue
            drafts = substitute_drafts(drafts, self._req_draft_token_ids.get(req_id, ()))
            trace.record("spec_substitute", req_id=req_id, drafts=list(drafts))
            row = batch.req_id_to_index[req_id]
            start = batch.num_tokens_no_spec[row]
            # A placeholder left at -1 (no draft for it) is fed as token 0: it is rejected, so
            # nothing reads its row.
            batch.token_ids_cpu[row, start:start + len(drafts)] = np.maximum(drafts, 0)
            batch.spec_token_ids[req_id] = drafts

    def _rejection_sample(self, spec_md: SpecDecodeMetadata, logits: torch.Tensor,
                          sampling_metadata: Any, partial: np.ndarray) -> list[list[int]]:
        batch = self.input_batch
        real_md, real_logits = drop_placeholder_drafts(spec_md, logits, [
            num_real_drafts(batch.spec_token_ids.get(r, ())) for r in batch.req_ids])
        if real_md is None:   # no real draft: exactly the step without drafts
            return self._sample(real_logits, sampling_metadata, partial)
        return super()._rejection_sample(real_md, real_logits, sampling_metadata, partial)

    def propose_draft_token_ids(self, sampled_token_ids: list[list[int]],
                                state: Any) -> Optional[dict[str, list[int]]]:
        drafts = super().propose_draft_token_ids(sampled_token_ids, state)
        # Kept here for the next step's placeholders; a row that sampled and got no drafts has
        # none (the synchronous scheduler would store [] for it too).
        for i, req_id in enumerate(self.input_batch.req_ids):
            if sampled_token_ids[i]:
                self._req_draft_token_ids[req_id] = list(drafts.get(req_id, ()))
        return None
