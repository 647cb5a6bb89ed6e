"""The worker's half of asynchronous scheduling (``LLM(..., async_scheduling=True)``).

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

from typing import Optional, Sequence

import numpy as np
import torch

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
