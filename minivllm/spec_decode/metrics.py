"""Speculative-decoding counters, mirroring vllm/v1/spec_decode/metrics.py.

The scheduler calls ``observe_draft(num_draft_tokens, num_accepted_tokens)`` once per request and step
that had drafts (``num_accepted = len(generated_token_ids) - 1``). Reported as vLLM does:
- mean acceptance length ``1 + accepted / drafts`` (the 1 is the token every verify step yields anyway),
- per-position acceptance rate ``accepted_per_pos[i] / drafts`` (draft i passed, so did all before it),
- draft acceptance rate ``accepted / drafted * 100`` (percent).
Counters behind the metrics ``spec_decode_num_drafts``, ``spec_decode_num_draft_tokens``,
``spec_decode_num_accepted_tokens`` and ``spec_decode_num_accepted_tokens_per_pos``.

With ``async_scheduling`` the scheduler sees only ``-1`` placeholders, so ``num_draft_tokens`` counts
every scheduled placeholder, the ones the worker had no draft for included (always rejected), as
vLLM 0.32's scheduler.py does (it counts ``len(scheduled_spec_token_ids)``): the same run reports the
same accepted tokens and more drafted ones than with synchronous scheduling.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        if len(self.num_accepted_tokens_per_pos) != self.num_spec_tokens:
            raise ValueError("num_accepted_tokens_per_pos needs one entry per speculative position.")

    @classmethod
    def new(cls, num_spec_tokens: int) -> "SpecDecodingStats":
        return cls(num_spec_tokens=num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(
                f"need 0 <= accepted ({num_accepted_tokens}) <= drafted ({num_draft_tokens}) <= "
                f"num_spec_tokens ({self.num_spec_tokens}).")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        # Acceptance is a prefix: accepting position i means positions 0 .. i - 1 passed too.
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: ``1 + accepted / drafts``; NaN before any draft."""
        if self.num_drafts == 0:
            return float("nan")
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """For each position i, the share of drafts whose draft i was accepted; NaNs before any draft."""
        if self.num_drafts == 0:
            return [float("nan")] * self.num_spec_tokens
        return [n / self.num_drafts for n in self.num_accepted_tokens_per_pos]

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted ones, in percent; NaN before any draft."""
        if self.num_draft_tokens == 0:
            return float("nan")
        return self.num_accepted_tokens / self.num_draft_tokens * 100.0
