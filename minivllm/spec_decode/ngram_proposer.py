"""Prompt-lookup (n-gram) drafting, mirroring vllm/v1/spec_decode/ngram_proposer.py.

Article step "propose k drafts": find an earlier place in the context (prompt + output so far) whose
tokens match the context's last n tokens, and propose the k tokens that followed it there.

The rule of vLLM's ``_find_longest_matched_ngram_and_propose_tokens`` (December 2025), for a context of
``total`` tokens: the longest n in ``[min_n, max_n]`` wins; among equally long matches the **earliest**
occurrence wins (``match="first"``); the occurrence may overlap the suffix itself (``[1, 2, 1, 2, 1]``,
n = 3, proposes ``[2, 1]``); ``k`` is capped by ``max_model_len - total`` and by how many tokens follow
the match. ``match="last"`` takes the most **recent** earlier occurrence instead, the recency bias the
article suggests (recent text is more likely to repeat).

vLLM finds the match with one KMP pass over the reversed context, compiled with numba. Here the same
answer comes from numpy: for every end position e < total - 1, the length of the common suffix of
``context[:e + 1]`` and ``context``, capped at ``max_n``, built with ``max_n`` vectorised comparisons.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from minivllm.config import SpeculativeConfig
from minivllm.spec_decode.base_proposer import Proposer


class NgramProposer(Proposer):
    """The drafter for ``method="ngram"`` (the object ``create_drafter`` returns, via
    ``from_config``): ``propose`` on one context, ``propose_for_batch`` on the runner's batch."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int,
                 max_model_len: Optional[int] = None, match: str = "first") -> None:
        super().__init__()
        # The configuration's checks (ValueError naming the field), for a proposer built directly.
        SpeculativeConfig(method="ngram", num_speculative_tokens=num_speculative_tokens,
                          prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max,
                          ngram_match=match)
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.match = match

    @classmethod
    def from_config(cls, vllm_config: Any, device: Any = None, dtype: Any = None) -> "NgramProposer":
        """vLLM's ``NgramProposer(vllm_config)``: the bounds, k and the match rule from
        ``speculative_config``."""
        spec = vllm_config.speculative_config
        return cls(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens,
                   max_model_len=vllm_config.model_config.max_model_len, match=spec.ngram_match)

    def propose_for_batch(self, runner: Any, limits: dict[str, int], so: Any) -> dict[str, list[int]]:
        """Article step 2 for the batch: ``propose`` on each request's row of
        ``input_batch.token_ids_cpu`` (its context without this step's drafts), cut to its limit."""
        batch = runner.input_batch
        drafts = {}
        for req_id, limit in limits.items():
            if limit <= 0:
                continue
            row = batch.req_id_to_index[req_id]
            context = batch.token_ids_cpu[row, :batch.num_tokens_no_spec[row]]
            proposal = self.propose(context)[:limit]
            if len(proposal):
                drafts[req_id] = [int(t) for t in proposal]
        return drafts

    def propose(self, context_token_ids: Sequence[int]) -> list[int]:
        """Up to k draft tokens continuing ``context_token_ids`` (prompt + output); [] when no match."""
        tokens = np.asarray(context_token_ids, dtype=np.int64)
        total = tokens.shape[0]
        if total < self.min_n:
            return []
        k = self.k if self.max_model_len is None else min(self.k, self.max_model_len - total)
        if k <= 0:
            return []
        match_len = self._suffix_match_lengths(tokens)
        longest = int(match_len.max(initial=0))
        if longest < self.min_n:
            return []
        ends = np.flatnonzero(match_len == longest)
        end = ends[0] if self.match == "first" else ends[-1]
        start = int(end) + 1
        return tokens[start:start + min(k, total - start)].tolist()

    def propose_batch(self, contexts: Sequence[Sequence[int]]) -> list[list[int]]:
        """One ``propose`` per context (one list per request, empty = no draft)."""
        return [self.propose(c) for c in contexts]

    def _suffix_match_lengths(self, tokens: np.ndarray) -> np.ndarray:
        """``[total - 1]``: for each end e, how many tokens ending at e equal the context's last ones.

        Capped at ``max_n``; e = total - 1 (the suffix matching itself) is left out, so every match has
        at least one token after it to propose.
        """
        total = tokens.shape[0]
        match_len = np.zeros(max(total - 1, 0), dtype=np.int64)
        still_matching = np.ones_like(match_len, dtype=bool)
        for m in range(min(self.max_n, total - 1)):
            # Offset m: does tokens[e - m] equal tokens[total - 1 - m]? Only ends e >= m can.
            still_matching[:m] = False
            still_matching[m:] &= tokens[:total - 1 - m] == tokens[total - 1 - m]
            if not still_matching.any():
                break
            match_len += still_matching
        return match_len
