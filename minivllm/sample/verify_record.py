"""The rejection sampler's record of one verification, for the trace, the tour and the notebooks.

``RejectionSampler.forward`` calls ``build_record`` only when someone records (``sampler.record``,
or a recording trace step); it is not part of the article's step, so it lives beside it. Per
request, per position up to and including the emitted token, one dict (see ``RejectionSampler``).
"""
from __future__ import annotations

from typing import Optional, TYPE_CHECKING

import torch

from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.accept import _is_greedy, random_accept_mask

if TYPE_CHECKING:
    from minivllm.spec_decode.metadata import SpecDecodeMetadata


def build_record(metadata: "SpecDecodeMetadata", sampling_metadata: SamplingMetadata,
                 target_logits: torch.Tensor, draft_probs: Optional[torch.Tensor],
                 target_probs: torch.Tensor, target_argmax: torch.Tensor,
                 uniform_probs: Optional[torch.Tensor], output: torch.Tensor) -> list[list[dict]]:
    """The per-position decisions, gathered from the same tensors the kernels read.

    ``target_logits`` ``[num_draft_tokens, vocab]``: the target's logits before the logits
    processors; ``target_probs`` what the drafts were tested against (after them)."""
    is_greedy = _is_greedy(sampling_metadata, output.shape[0], output.device)
    draft = metadata.draft_token_ids.long()
    idx = draft.clamp(min=0).unsqueeze(-1)
    counts = torch.tensor(metadata.num_draft_tokens, dtype=torch.long, device=draft.device)
    greedy_tok = is_greedy.repeat_interleave(counts, output_size=draft.numel())
    accepted = draft == target_argmax
    if uniform_probs is not None:
        accepted = torch.where(greedy_tok, accepted,
                               random_accept_mask(draft, draft_probs, target_probs, uniform_probs))
    p_target = target_probs.gather(-1, idx).squeeze(-1).tolist()
    p_draft = (torch.ones(draft.shape) if draft_probs is None
               else draft_probs.gather(-1, idx).squeeze(-1).cpu())
    p_draft = torch.where(draft.cpu() >= 0, p_draft, 0.0).tolist()   # a -1 placeholder: nothing drafted
    uniform = None if uniform_probs is None else uniform_probs.tolist()
    greedy_tok, accepted, draft, out = greedy_tok.tolist(), accepted.tolist(), draft.tolist(), output.tolist()
    records, start = [], 0
    for i, n in enumerate(metadata.num_draft_tokens):
        positions = []
        for j in range(n):
            t = start + j
            positions.append(dict(
                draft_token_id=draft[t], p_target=p_target[t], p_draft=p_draft[t],
                uniform=None if greedy_tok[t] else uniform[t], accepted=accepted[t],
                kind="accepted" if accepted[t] else "recovered", output_token_id=out[i][j]))
            if not accepted[t]:
                break
        else:
            positions.append(dict(draft_token_id=None, p_target=None, p_draft=None, uniform=None,
                                  accepted=False, kind="bonus", output_token_id=out[i][n]))
        records.append(positions)
        start += n
    return records
