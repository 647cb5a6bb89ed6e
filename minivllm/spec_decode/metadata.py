"""Where the drafts sit in a verify step: ``SpecDecodeMetadata``, mirroring
vllm/v1/spec_decode/metadata.py (article steps 6 and 7).

For a batch of ``batch`` requests with ``num_draft_tokens[i]`` drafts each (``num_tokens`` in all):

| field | shape | meaning |
|---|---|---|
| ``draft_token_ids`` | ``[num_tokens]`` int32 | all drafts, flattened in request order |
| ``num_draft_tokens`` | list ``[batch]`` | drafts per request (may be 0) |
| ``cu_num_draft_tokens`` | ``[batch]`` int32 | inclusive cumulative sum of drafts, no leading 0 |
| ``cu_num_sampled_tokens`` | ``[batch]`` int32 | inclusive cumulative sum of drafts + 1 |
| ``target_logits_indices`` | ``[num_tokens]`` int32 | row of the selected logits holding draft j's target |
| ``bonus_logits_indices`` | ``[batch]`` int32 | row of the selected logits for each bonus token |
| ``logits_indices`` | ``[num_tokens + batch]`` int32 | hidden-state rows to compute logits for |

``max_spec_len = max(num_draft_tokens)`` is derived after construction unless given. Article step 6
(``ModelRunner._calc_spec_decode_metadata``, whose docstring works an example through) fills the
index tensors; ``make_dummy`` zeroes them, which is enough for the rejection sampler alone (article
step 7): it only reads the drafts and their counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch


@dataclass
class SpecDecodeMetadata:
    draft_token_ids: torch.Tensor
    num_draft_tokens: list[int]
    cu_num_draft_tokens: torch.Tensor
    cu_num_sampled_tokens: torch.Tensor
    target_logits_indices: torch.Tensor
    bonus_logits_indices: torch.Tensor
    logits_indices: torch.Tensor
    # Derived (as in vLLM) when not given; a larger value only adds placeholder columns to the output.
    max_spec_len: Optional[int] = None

    def __post_init__(self) -> None:
        longest = max(self.num_draft_tokens, default=0)
        if self.max_spec_len is None:
            self.max_spec_len = longest
        elif self.max_spec_len < longest:
            raise ValueError(f"max_spec_len={self.max_spec_len} is below the longest draft ({longest}).")

    @classmethod
    def make_dummy(cls, draft_token_ids: list[list[int]],
                   device: Union[str, torch.device] = "cpu") -> "SpecDecodeMetadata":
        """Metadata for these drafts (one list per request) with zeroed index tensors."""
        batch_size = len(draft_token_ids)
        num_draft_tokens = [len(ids) for ids in draft_token_ids]
        flat = [t for ids in draft_token_ids for t in ids]
        num_tokens = len(flat)
        cu_draft = np.cumsum(num_draft_tokens, dtype=np.int32)
        cu_sampled = np.cumsum([n + 1 for n in num_draft_tokens], dtype=np.int32)

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        return cls(
            draft_token_ids=torch.tensor(flat, dtype=torch.int32, device=device),
            num_draft_tokens=num_draft_tokens,
            cu_num_draft_tokens=torch.from_numpy(cu_draft).to(device),
            cu_num_sampled_tokens=torch.from_numpy(cu_sampled).to(device),
            target_logits_indices=zeros(num_tokens),
            bonus_logits_indices=zeros(batch_size),
            logits_indices=zeros(num_tokens + batch_size),
        )
