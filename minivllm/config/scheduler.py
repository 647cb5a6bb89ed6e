"""``SchedulerConfig``: the scheduler's budgets per step (requests, tokens) and chunked prefill;
mirrors vllm/config/scheduler.py. The token budget the article's ``schedule()`` spends (``spec.4``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    # vLLM 0.32's SchedulerConfig.async_scheduling: AsyncScheduler (core/sched/async_scheduler.py).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
