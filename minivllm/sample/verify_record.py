"""The rejection sampler's record of one verification: the ``"spec_verify"`` step records
(trace.py) of article step 7. minivllm's own: vLLM keeps only the counters of
vllm/v1/spec_decode/metrics.py.

A record is built only while a step is recorded (``sampler.record``, or a recording trace step); it
is not part of the article's step, so it lives beside it. Per request, per position up to and
including the emitted token, one dict (see ``build_record``).

Beside each decision the record keeps the one the sampler would have made had the logits processors
(penalties, bad words) ignored the drafts, each draft row counting only its request's committed
outputs: the mistake vLLM 0.32's ``RejectionSampler.apply_logits_processors`` /
``_combine_outputs_with_spec_tokens`` avoid, which notebook 02 shows step by step.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Optional

import torch

from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.rejection_torch import random_accept_mask

if TYPE_CHECKING:   # annotations only: the drafts' metadata loads with speculative decoding
    from minivllm.spec_decode.metadata import SpecDecodeMetadata


def _processed_drafts_ignored(target_logits: torch.Tensor, md: SamplingMetadata,
                              metadata: SpecDecodeMetadata) -> torch.Tensor:
    """``ops/processors.apply_draft_logits_processors`` with the drafts left out of each draft row's
    outputs: ``[num_draft_tokens, vocab]`` float32."""
    from minivllm.sample.logits_processor import apply_min_tokens
    from minivllm.sample.ops import drafts, processors
    repeat = [i for i, n in enumerate(metadata.num_draft_tokens) for _ in range(n)]
    rows = dataclasses.replace(drafts.draft_rows_metadata(md, metadata),
                               output_token_ids=[md.output_token_ids[i] for i in repeat])
    logits = processors.apply_logits_processors(target_logits, rows)
    return apply_min_tokens(logits, md, metadata.num_draft_tokens)


def _at_drafts(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return logits.gather(-1, idx).squeeze(-1)


def build_record(metadata: SpecDecodeMetadata, sampling_metadata: SamplingMetadata,
                 target_logits: torch.Tensor, draft_probs: Optional[torch.Tensor],
                 target_probs: torch.Tensor, target_argmax: torch.Tensor,
                 uniform_probs: Optional[torch.Tensor], output: torch.Tensor, *,
                 is_greedy: torch.Tensor, processed: torch.Tensor,
                 constrain: Callable[[torch.Tensor], torch.Tensor]) -> list[list[dict]]:
    """The per-position decisions, gathered from the same tensors the kernels read.

    From the rejection sampler, which calls this and is never imported here: ``is_greedy``
    ``[batch]`` bool, its greedy rows; ``processed`` ``[num_draft_tokens, vocab]``, the logits after
    its logits processors (drafts counted as outputs), before the sampling constraints;
    ``constrain``, its sampling constraints (temperature, min_p, top-k, top-p) over such logits.

    ``target_logits`` ``[num_draft_tokens, vocab]``: the target's logits before the logits
    processors; ``target_probs`` ``[num_draft_tokens, vocab]`` what the drafts were tested against
    (after them and the sampling constraints); ``target_argmax`` ``[num_draft_tokens]``;
    ``uniform_probs`` ``[num_draft_tokens]`` or ``None`` (all greedy); ``output`` ``[batch, k + 1]``.

    Per request, one dict per position up to and including the emitted token:

    - ``draft_token_id`` (None for a bonus), ``p_target``, ``p_draft`` (1.0 for one-hot drafts),
      ``uniform`` (None on greedy rows), ``accepted``, ``kind`` (accepted | recovered | bonus; a
      greedy mismatch emits the target argmax, which counts as recovered), ``output_token_id``;
    - draft positions only: ``penalty``, what the logits processors added to the draft token's logit
      (processed minus raw, ``-inf`` when masked), the earlier drafts of the request counted as
      outputs, as the sampler did; ``penalty_drafts_ignored``, ``p_target_drafts_ignored`` and
      ``accepted_if_drafts_ignored``: the same with only the request's committed outputs counted,
      and the decision the sampler's rule (greedy: argmax equality; random: ``random_accept_mask``
      with the same uniform) gives then; ``target_argmax`` and ``target_argmax_drafts_ignored``, the
      argmax token of each variant (a greedy row's decision: the argmax can move because other
      tokens' penalties change, the draft's own unchanged).

    A bonus position has None in the first four fields, ``accepted`` False and no ``penalty`` or
    ``*drafts_ignored`` fields (no draft was tested); a -1 placeholder draft has None penalties.
    """
    md = sampling_metadata
    draft = metadata.draft_token_ids.long()
    idx = draft.clamp(min=0).unsqueeze(-1)
    counts = torch.tensor(metadata.num_draft_tokens, dtype=torch.long, device=draft.device)
    greedy_tok = is_greedy.repeat_interleave(counts, output_size=draft.numel())

    raw = target_logits.float()
    ignored = _processed_drafts_ignored(raw, md, metadata) if md.needs_logits_processors else processed
    constrained_ignored = constrain(ignored)
    probs_ignored = constrained_ignored.softmax(dim=-1, dtype=torch.float32)

    def decide(probs: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
        accepted = draft == argmax
        if uniform_probs is None:
            return accepted
        return torch.where(greedy_tok, accepted,
                           random_accept_mask(draft, draft_probs, probs, uniform_probs))

    real = draft >= 0
    accepted = decide(target_probs, target_argmax)
    argmax_ignored = constrained_ignored.argmax(dim=-1)
    accepted_ignored = decide(probs_ignored, argmax_ignored)
    penalty = [p if r else None for p, r in zip(
        (_at_drafts(processed, idx) - _at_drafts(raw, idx)).tolist(), real.tolist())]
    penalty_ignored = [p if r else None for p, r in zip(
        (_at_drafts(ignored, idx) - _at_drafts(raw, idx)).tolist(), real.tolist())]
    p_target = _at_drafts(target_probs, idx).tolist()
    p_target_ignored = _at_drafts(probs_ignored, idx).tolist()
    p_draft = (torch.ones(draft.shape) if draft_probs is None
               else _at_drafts(draft_probs, idx).cpu())
    p_draft = torch.where(draft.cpu() >= 0, p_draft, 0.0).tolist()   # a -1 placeholder: nothing drafted
    uniform = None if uniform_probs is None else uniform_probs.tolist()
    greedy_tok, accepted, accepted_ignored = greedy_tok.tolist(), accepted.tolist(), accepted_ignored.tolist()
    argmax, argmax_ignored = target_argmax.tolist(), argmax_ignored.tolist()
    draft, out = draft.tolist(), output.tolist()
    # What was kept is read from the output (every emitted token but the last is a kept draft), so
    # the record holds under block verification too, whose test is not p_target / p_draft >= u.
    start = 0
    for i, n in enumerate(metadata.num_draft_tokens):
        kept = sum(t != -1 for t in out[i]) - 1
        accepted[start:start + n] = [j < kept for j in range(n)]
        start += n

    records, start = [], 0
    for i, n in enumerate(metadata.num_draft_tokens):
        positions = []
        for j in range(n):
            t = start + j
            positions.append(dict(
                draft_token_id=draft[t], p_target=p_target[t], p_draft=p_draft[t],
                uniform=None if greedy_tok[t] else uniform[t], accepted=accepted[t],
                kind="accepted" if accepted[t] else "recovered", output_token_id=out[i][j],
                penalty=penalty[t], penalty_drafts_ignored=penalty_ignored[t],
                p_target_drafts_ignored=p_target_ignored[t],
                accepted_if_drafts_ignored=accepted_ignored[t], target_argmax=argmax[t],
                target_argmax_drafts_ignored=argmax_ignored[t]))
            if not accepted[t]:
                break
        else:
            positions.append(dict(draft_token_id=None, p_target=None, p_draft=None, uniform=None,
                                  accepted=False, kind="bonus", output_token_id=out[i][n]))
        records.append(positions)
        start += n
    return records
