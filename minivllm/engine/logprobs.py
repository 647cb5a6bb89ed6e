"""A request's logprobs as the outputs give them, mirroring vllm/v1/engine/logprobs.py
(``LogprobsProcessor``) and ``append_logprobs_for_next_position`` in vllm/logprobs.py.

Each step the scheduler leaves on the request what the runner computed for its new tokens
(``request.new_logprobs``: per token ``(token_ids, logprobs, rank)``, the sampled token first, then
the top k; ``request.new_prompt_logprobs`` likewise per prompt position). They become one
``{token_id: Logprob}`` dict per position: the top k get ranks 1..k, the sampled token its own rank;
when it is among the top k the two entries are the same.
"""
from __future__ import annotations

from typing import Any, Optional

from minivllm.outputs import Logprob, PromptLogprobs, SampleLogprobs
from minivllm.sampling_params import SamplingParams


class LogprobsProcessor:
    def __init__(self, params: SamplingParams, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.num_logprobs = params.logprobs
        self.num_prompt_logprobs = params.prompt_logprobs
        self.tokenizer = tokenizer
        self.logprobs: Optional[SampleLogprobs] = [] if params.logprobs is not None else None
        self.cumulative_logprob: Optional[float] = 0.0 if params.logprobs is not None else None
        # The first prompt token has no logprob (vLLM's create_prompt_logprobs).
        self.prompt_logprobs: Optional[PromptLogprobs] = None
        self._num_prompt_tokens = len(prompt_token_ids)

    def _decode(self, token_id: int) -> Optional[str]:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _position(self, token_ids: list[int], logprobs: list[float], rank: int,
                  num_logprobs: int) -> dict[int, Logprob]:
        """vLLM's ``append_logprobs_for_next_position`` for one position."""
        n = len(logprobs) - 1 if num_logprobs == -1 else num_logprobs
        ranks = [rank, *range(1, n + 1)]
        return {t: Logprob(lp, r, self._decode(t))
                for t, lp, r in zip(token_ids[:n + 1], logprobs[:n + 1], ranks)}

    def update_from_output(self, request: Any, new_token_ids: list[int]) -> None:
        new = getattr(request, "new_logprobs", None)
        if self.logprobs is not None and new and new_token_ids:
            for token_ids, logprobs, rank in new[:len(new_token_ids)]:
                self.logprobs.append(self._position(token_ids, logprobs, rank, self.num_logprobs))
                self.cumulative_logprob += logprobs[0]
        prompt = getattr(request, "new_prompt_logprobs", None)
        if self.num_prompt_logprobs is not None and prompt and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] + [
                self._position(t, lp, r, self.num_prompt_logprobs) for t, lp, r in prompt]
