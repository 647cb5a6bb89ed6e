"""Logits processors, mirroring vllm/v1/sample/logits_processor/builtin.py (``MinTokensLogitsProcessor``).

``min_tokens``: until a request has ``min_tokens`` output tokens, its stop tokens (``stop_token_ids``,
the generation config's extra EOS ids, and the EOS id, even with ``ignore_eos``, as vLLM's
``SamplingParams.all_stop_token_ids``) get logit ``-inf``, so they can never be sampled, accepted
as a draft, recovered or emitted as a bonus token. A stop check alone would let them into the output.

Which output position a logits row predicts (``SamplingMetadata.min_tokens[row] = (min_tokens,
num_output_tokens, stop_ids)``, ``num_output_tokens`` counted before this step):
- plain sampling, one row per request: position ``num_output_tokens``;
- verification (vLLM's ``apply_with_spec_decode``), ``num_draft_tokens[i]`` target rows per request:
  row j checks draft j, position ``num_output_tokens + j``;
- the bonus rows after those drafts: position ``num_output_tokens + num_draft_tokens[i]``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from minivllm.sample.metadata import SamplingMetadata


def apply_min_tokens(logits: torch.Tensor, sampling_metadata: SamplingMetadata,
                     num_draft_tokens: Optional[Sequence[int]] = None,
                     bonus: bool = False) -> torch.Tensor:
    """``logits`` [rows, vocab] with rows as described in the module docstring; returns the masked
    logits (a new tensor when anything is masked, the input otherwise).

    ``num_draft_tokens=None``: one row per request. With ``num_draft_tokens`` and ``bonus=False``:
    the target rows of verification. With ``bonus=True``: one bonus row per request."""
    if not sampling_metadata.min_tokens:
        return logits
    rows, cols = [], []
    starts = [0] * (len(num_draft_tokens) + 1) if num_draft_tokens is not None else None
    if num_draft_tokens is not None:
        for i, d in enumerate(num_draft_tokens):
            starts[i + 1] = starts[i] + d
    for req, (min_tokens, num_output, stop_ids) in sampling_metadata.min_tokens.items():
        if num_draft_tokens is None:
            positions = [(req, num_output)]
        elif bonus:
            positions = [(req, num_output + num_draft_tokens[req])]
        else:
            positions = [(starts[req] + j, num_output + j) for j in range(num_draft_tokens[req])]
        for row, pos in positions:
            if pos < min_tokens:
                rows.extend([row] * len(stop_ids))
                cols.extend(stop_ids)
    if not rows:
        return logits
    logits = logits.clone()
    logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = (
        float("-inf"))
    return logits
